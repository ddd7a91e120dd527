"""Public API: load_target, score, score_tree (generate and load_drafter live in loop.py/drafter.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxddtree import layout as layout_lib
from jaxddtree.target import Target, load_target  # noqa: F401  (re-exported)
from jaxddtree.verify import verify

PREFILL_CHUNK = 256


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _ids(token_ids, name="token_ids") -> np.ndarray:
    """`token_ids` as a flat int64 array; TypeError for text or non-integer values (never truncated)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be integer token ids, not a string (tokenize the text first)")
    ids = np.asarray(token_ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {ids.dtype} values")
    if ids.size == 0:
        raise ValueError(f"{name} is empty")
    return ids.astype(np.int64).reshape(-1)


def _check_vocab(target: Target, ids: np.ndarray, name: str):
    if ids.min() < 0 or ids.max() >= target.config.vocab_size:
        raise ValueError(f"{name} must lie in [0, {target.config.vocab_size}); got {ids.min()}..{ids.max()}")


def padded_chunks(ids: np.ndarray, chunk: int = PREFILL_CHUNK):
    """Yield (tokens [1, size] int32, n real) for `ids` cut into chunks of one fixed size (one compilation
    per size): size = min(chunk, len(ids) rounded up to 8); the last chunk is zero-padded."""
    size = min(chunk, _round_up(len(ids), 8))
    for s in range(0, len(ids), size):
        part = ids[s:s + size]
        padded = np.zeros((1, size), np.int32)
        padded[0, :len(part)] = part
        yield jnp.asarray(padded), len(part)


def prefill_ids(target: Target, cache, ids: np.ndarray, feature_layers=(), logits="last",
                chunk: int = PREFILL_CHUNK):
    """Prefill a prompt in fixed-size chunks (one compilation per chunk size). Returns the last chunk's
    logits, the cache, and the features of every prompt position (concatenated) or None."""
    T = len(ids)
    size = min(chunk, _round_up(T, 8))
    # every chunk is written whole (padding included): a write past the cache end would be clamped by
    # dynamic_update_slice onto earlier rows, silently corrupting the cache
    need = int(cache.length) + _round_up(T, size)
    if need > cache.max_len:
        raise ValueError(f"cache too small: prefilling {T} tokens in chunks of {size} after "
                         f"{int(cache.length)} committed tokens writes {need} rows, the cache has {cache.max_len}")
    feats, out = [], None
    for padded, n in padded_chunks(ids, chunk):
        out, cache, f, _ = target.prefill(cache, padded, num_valid=n, feature_layers=feature_layers, logits=logits)
        if f is not None:
            feats.append(f[:, :n])
    return out, cache, (jnp.concatenate(feats, axis=1) if feats else None)


def score(target: Target, token_ids) -> np.ndarray:
    """Logits [T, vocab] (fp32 numpy) of a full forward over `token_ids`."""
    ids = _ids(token_ids)
    _check_vocab(target, ids, "token_ids")
    size = min(PREFILL_CHUNK, _round_up(len(ids), 8))
    cache = target.init_cache(_round_up(len(ids), size) + size)
    rows = []
    for padded, n in padded_chunks(ids):
        logits, cache, _, _ = target.prefill(cache, padded, num_valid=n, logits="all")
        rows.append(np.asarray(logits[0, :n]))
    return np.concatenate(rows, axis=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "kernels"))
def _verify_jit(leaves, cache, tokens, parents, *, graphdef, treedef, kernels):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    lay = layout_lib.tree(cache.length, parents, model.cfg.linear_conv_kernel_dim, kernels=kernels)
    logits, _, _ = verify(model, cache, tokens, lay)
    return logits


def score_tree(target: Target, prefix_ids, tree_tokens, parents) -> np.ndarray:
    """Prefill `prefix_ids`, verify the tree (`tree_tokens[N]`, `parents[N]` with parents[0] = -1 and
    parents[i] < i; node 0 is the token right after the prefix), return every node's logits [N, vocab]."""
    prefix = _ids(prefix_ids, "prefix_ids")
    toks = _ids(tree_tokens, "tree_tokens")
    par = _ids(parents, "parents")
    if len(par) != len(toks):
        raise ValueError(f"parents has {len(par)} entries for {len(toks)} tree tokens")
    if par[0] != -1 or any(not (0 <= par[i] < i) for i in range(1, len(par))):
        raise ValueError("parents must have parents[0] = -1 and 0 <= parents[i] < i (topological order)")
    _check_vocab(target, prefix, "prefix_ids")
    _check_vocab(target, toks, "tree_tokens")
    size = min(PREFILL_CHUNK, _round_up(len(prefix), 8))
    cache = target.init_cache(_round_up(len(prefix), size) + size + len(toks))
    _, cache, _ = prefill_ids(target, cache, prefix, logits="none")
    logits = _verify_jit(target.leaves, cache, jnp.asarray(toks, jnp.int32)[None], jnp.asarray(par, jnp.int32),
                         graphdef=target.graphdef, treedef=target.treedef, kernels=target.kernels)
    return np.asarray(logits[0])
