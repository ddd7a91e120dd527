"""Loading checkpoints into runnable models: `load_target` and `load_drafter` accept an HF directory
(safetensors) or a directory written by `python -m convert` (orbax), and pick the reader."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxddtree.checkpoint import orbax_format
from jaxddtree.checkpoint.hf_drafter import load_drafter_params
from jaxddtree.checkpoint.hf_target import load_params
from jaxddtree.checkpoint.params import CheckpointError, target_from_params
from jaxddtree.model import draft_vocab as draft_vocab_lib
from jaxddtree.model import sharding
from jaxddtree.model.config import load_config
from jaxddtree.model.drafter import Drafter, check_compatible
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.target import Target, as_dtype


def load_target(path: str, dtype="bfloat16", progress: bool = False, tp: int = 1) -> Target:
    """Load a Qwen3.5/3.6 checkpoint: an HF directory (config.json + safetensors, wrapper or text-only,
    single or sharded) or a directory written by `python -m convert`. `progress`: a bar on stderr while an HF
    directory's tensors load. `tp` > 1: tensor parallelism over the first tp devices (model/sharding.py;
    ValueError listing the valid values unless tp divides the head counts, intermediate size and vocab)."""
    dt = as_dtype(dtype)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if orbax_format.is_converted(path):
        if tp != 1:  # before any restore work; tp = 1 leaves the marker checks (kind, version) to the restore
            sharding.check_tp(load_config(path), tp)
        return orbax_format.restore_target(path, dt).shard(tp, consume=True)
    cfg = load_config(path)
    sharding.check_tp(cfg, tp)
    target = target_from_params(cfg, load_params(cfg, path, dt, progress=progress), dt, source=path)
    return target.shard(tp, consume=True)


def load_drafter(path: str, target: Any, dtype: Any = "bfloat16", draft_vocab=None) -> Drafter:
    """Parse + validate config, check compatibility with `target`, load weights strictly; on a sharded
    target's mesh the drafter is replicated. `draft_vocab`: None (every token id), token ids (a 1-D integer
    sequence) or an int N: the N most frequent ids of the frequency table `path/token_counts.json`
    (`model.draft_vocab`) -> `Drafter.with_draft_vocab` (the drafter drafts only those ids)."""
    ids = draft_vocab_ids(draft_vocab, path, int(target.config.vocab_size))  # before the weights load
    cfg = DrafterConfig.from_pretrained(path)
    check_compatible(cfg, target, source=path)
    if orbax_format.is_converted(path):
        params = orbax_format.restore_drafter_params(path, cfg, dtype)
    else:
        params = load_drafter_params(path, cfg, dtype)
    drafter = Drafter(config=cfg, params=sharding.replicate(params, getattr(target, "mesh", None)), path=path)
    return drafter if ids is None else drafter.with_draft_vocab(ids, target)


def draft_vocab_ids(draft_vocab, path: str, vocab_size: int):
    """`load_drafter`'s draft_vocab -> checked sorted ids (numpy int32) or None. ValueError (one line) for a bad
    value or, with an int, a missing frequency table."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, (int, np.integer)) and not isinstance(draft_vocab, bool):
        table = os.path.join(path, draft_vocab_lib.COUNTS_FILE)
        if not os.path.isfile(table):
            raise ValueError(f"draft_vocab={int(draft_vocab)} needs a token frequency table {table} (a JSON list of "
                             f"{vocab_size} counts); give the token ids instead")
        counts = draft_vocab_lib.load(table)
        if counts.shape[0] != vocab_size:
            raise ValueError(f"{table}: {counts.shape[0]} counts for a vocabulary of {vocab_size}")
        return draft_vocab_lib.check_ids(draft_vocab_lib.frequent_ids(counts, draft_vocab), vocab_size)
    return draft_vocab_lib.check_ids(draft_vocab, vocab_size)
