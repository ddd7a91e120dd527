"""A draft vocabulary: the drafter's logits over a subset of the token ids (the most frequent ones) instead of the
whole vocabulary. At Qwen3.6-27B the full lm_head [5120, 248320] is ~2.5 GB of the ~6 GB a drafter call streams.

Set-up, once (`make`): the target's lm_head columns of the ids are gathered into a small head [H, Vp] in the
drafter's dtype (Vp = the ids' count rounded up to a multiple of PAD: zero columns whose logits a -inf bias masks),
and `column` [V] maps every full-vocabulary id to its column (Vp: outside the subset). Each call (`logits`): the
drafter's final hidden states times that head (the same einsum as the full lm_head, a smaller N), then one gather
back to full-vocabulary logits [.., V], -inf for every id outside the subset: probability 0 in the draft, so such a
token is never drafted (DDTree's build makes a -inf prefix a padding node; the chain's argmax never picks one while a
subset id is finite). Padding columns are never gathered back. The tree / chain, the verify and the acceptance
then run as without a draft vocabulary: only which tokens get drafted changes, never the output.

Host helpers: `count` (the token frequencies of tokenised text), `frequent_ids` (the n most frequent ids),
`coverage` (the share of the counted tokens a subset holds), `save` / `load` (a 1-D integer array as .json or
.npy), `COUNTS_FILE` (a drafter directory's frequency table: `load_drafter(..., draft_vocab=N)` reads it)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

PAD = 128  # the head's width is a multiple of this (GEMM / TMA tiles)
COUNTS_FILE = "token_counts.json"  # [V] token counts next to a drafter checkpoint (`load_drafter(draft_vocab=N)`)

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftVocab:
    ids: Array  # [Vp] int32: the full-vocabulary id of each column, ascending; padding columns -1
    head: Array  # [H, Vp] the target's lm_head columns of `ids` (padding: zeros), in the drafter's dtype
    bias: Array  # [Vp] fp32: 0, -inf on padding columns
    column: Array  # [V] int32: the column of each full-vocabulary id; Vp for ids outside the subset

    @property
    def size(self) -> int:
        """The number of real ids (padding excluded)."""
        return int(np.sum(np.asarray(self.ids) >= 0))


def check_ids(ids, vocab_size: int) -> np.ndarray:
    """ids (any 1-D integer sequence) -> sorted int32 numpy; ValueError (one line) unless they are unique and in
    [0, vocab_size), at least one."""
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"draft_vocab must be a non-empty 1-D list of token ids, got {_show(ids)}")
    a = a.astype(np.int64)
    bad = a[(a < 0) | (a >= vocab_size)]
    if bad.size:
        raise ValueError(f"draft_vocab: ids {bad[:5].tolist()} outside the vocabulary [0, {vocab_size})")
    s = np.sort(a)
    dup = s[1:][s[1:] == s[:-1]]
    if dup.size:
        raise ValueError(f"draft_vocab: ids {np.unique(dup)[:5].tolist()} given more than once")
    return s.astype(np.int32)


def _show(x) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


@functools.partial(jax.jit, static_argnames=("dtype", "width"))
def _columns(lm_head, ids, *, dtype, width: int):
    """The lm_head [H, V] (an array or an Fp8Weight: dequantized inside this program) columns of ids [Vd],
    as `draft_logits` reads the full one (`lm_head.astype(dtype)`), zero-padded to [H, width]."""
    cols = jnp.take(lm_head.astype(dtype), ids, axis=1)
    return jnp.pad(cols, ((0, 0), (0, width - ids.shape[0])))


def make(ids, lm_head, dtype) -> DraftVocab:
    """The DraftVocab of `ids` (checked: unique, in [0, V)), its head gathered once from the target's lm_head
    [H, V] in `dtype` (the drafter's)."""
    V = int(lm_head.shape[-1])
    ids = check_ids(ids, V)
    n = len(ids)
    width = -(-n // PAD) * PAD
    column = np.full((V,), width, np.int32)
    column[ids] = np.arange(n, dtype=np.int32)
    bias = np.where(np.arange(width) < n, 0.0, -np.inf).astype(np.float32)
    head = _columns(lm_head, jnp.asarray(ids), dtype=jnp.dtype(dtype), width=width)
    padded = np.concatenate([ids, np.full((width - n,), -1, np.int32)])
    return DraftVocab(ids=jnp.asarray(padded), head=head, bias=jnp.asarray(bias), column=jnp.asarray(column))


def subset_logits(vocab: DraftVocab, h: Array) -> Array:
    """h [..., H] -> fp32 logits [..., Vp] over the subset's columns (padding: -inf)."""
    return jnp.einsum("...h,hv->...v", h, vocab.head.astype(h.dtype), preferred_element_type=jnp.float32) + vocab.bias


def logits(vocab: DraftVocab, h: Array) -> Array:
    """h [..., H] -> fp32 logits [..., V] over the full vocabulary: the subset's, -inf for every other id."""
    return jnp.take(subset_logits(vocab, h), vocab.column, axis=-1, mode="fill", fill_value=-jnp.inf)


def ids_of(vocab: DraftVocab | None, cols: Array) -> Array:
    """Columns of `subset_logits` -> token ids (a padding column: -1); vocab None: the columns are the ids."""
    return cols if vocab is None else jnp.take(vocab.ids, cols, axis=0)


def columns_of(vocab: DraftVocab | None, ids: Array) -> Array:
    """Token ids -> their columns of `subset_logits` (an id outside the subset: Vp, one past the last column: read
    with mode="fill"); vocab None: the ids are the columns."""
    return ids if vocab is None else jnp.take(vocab.column, ids, axis=0)


# ------------------------------------------------------------------------------------------------ host helpers
def count(token_ids, vocab_size: int, counts=None) -> np.ndarray:
    """Token frequencies [V] int64 of `token_ids` (1-D), added to `counts` when given."""
    a = np.asarray(token_ids, np.int64).reshape(-1)
    c = np.bincount(a[(a >= 0) & (a < vocab_size)], minlength=vocab_size).astype(np.int64)
    return c if counts is None else np.asarray(counts, np.int64) + c


def frequent_ids(counts, n: int) -> np.ndarray:
    """The n most frequent ids of `counts` [V] (ties: the lower id first), most frequent first; int32."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.number):
        raise ValueError(f"a frequency table is a 1-D array of counts, one per token id, got shape {counts.shape}")
    if not 1 <= int(n) <= counts.shape[0]:
        raise ValueError(f"draft_vocab: n must be in [1, {counts.shape[0]}] (the vocabulary size), got {n}")
    return np.argsort(-counts, kind="stable")[:int(n)].astype(np.int32)


def coverage(counts, ids) -> float:
    """The share of the counted tokens whose id is in `ids` (1.0 for an empty table)."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum()
    return float(counts[np.asarray(ids, np.int64)].sum() / total) if total > 0 else 1.0


def save(path: str, values) -> None:
    """A 1-D integer array (token ids, or counts) as a JSON list (.json) or a numpy file (.npy)."""
    a = np.asarray(values).reshape(-1)
    if path.endswith(".npy"):
        np.save(path, a)
    else:
        with open(path, "w") as f:
            json.dump([int(x) for x in a], f)


def load(path: str) -> np.ndarray:
    """What `save` wrote: a 1-D int64 array (a .npy file, else a JSON list of integers); ValueError (one line)
    for anything else."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    try:
        if path.endswith(".npy"):
            a = np.load(path, allow_pickle=False)
        else:
            with open(path) as f:
                a = np.asarray(json.load(f))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON list of integers or a .npy array ({' '.join(str(e).split())})") from None
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{path}: expected a non-empty 1-D list of integers, got shape {a.shape}, dtype {a.dtype}")
    return a.astype(np.int64)
