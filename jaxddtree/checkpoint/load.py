"""Loading checkpoints into runnable models: `load_target` and `load_drafter` accept an HF directory
(safetensors) or a directory written by `python -m convert` (orbax), and pick the reader."""

from __future__ import annotations

import os
from typing import Any

from jaxddtree.checkpoint import orbax_format
from jaxddtree.checkpoint.hf_drafter import load_drafter_params
from jaxddtree.checkpoint.hf_target import load_params
from jaxddtree.checkpoint.params import CheckpointError, target_from_params
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


def load_drafter(path: str, target: Any, dtype: Any = "bfloat16") -> Drafter:
    """Parse + validate config, check compatibility with `target`, load weights strictly; on a sharded
    target's mesh the drafter is replicated."""
    cfg = DrafterConfig.from_pretrained(path)
    check_compatible(cfg, target, source=path)
    if orbax_format.is_converted(path):
        params = orbax_format.restore_drafter_params(path, cfg, dtype)
    else:
        params = load_drafter_params(path, cfg, dtype)
    return Drafter(config=cfg, params=sharding.replicate(params, getattr(target, "mesh", None)), path=path)
