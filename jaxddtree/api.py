"""Scoring API: `score` (logits of a sequence) and `score_tree` (logits of every node of a tree after a prefix)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxddtree.model import layout as layout_lib
from jaxddtree.model.prefill import check_ids, check_vocab, chunk_size, padded_chunks, prefill_ids, round_up
from jaxddtree.model.target import Target
from jaxddtree.speculative.verify import verify


def score(target: Target, token_ids) -> np.ndarray:
    """Logits [T, vocab] (fp32 numpy) of a full forward over `token_ids`."""
    ids = check_ids(token_ids)
    check_vocab(target, ids, "token_ids")
    size = chunk_size(len(ids))
    cache = target.init_cache(round_up(len(ids), size) + size)
    rows = []
    for padded, n in padded_chunks(ids, size):
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
    prefix = check_ids(prefix_ids, "prefix_ids")
    toks = check_ids(tree_tokens, "tree_tokens")
    par = check_ids(parents, "parents")
    if len(par) != len(toks):
        raise ValueError(f"parents has {len(par)} entries for {len(toks)} tree tokens")
    if par[0] != -1 or any(not (0 <= par[i] < i) for i in range(1, len(par))):
        raise ValueError("parents must have parents[0] = -1 and 0 <= parents[i] < i (topological order)")
    check_vocab(target, prefix, "prefix_ids")
    check_vocab(target, toks, "tree_tokens")
    size = chunk_size(len(prefix))
    cache = target.init_cache(round_up(len(prefix), size) + size + len(toks))
    _, cache, _ = prefill_ids(target, cache, prefix, logits="none")
    logits = _verify_jit(target.leaves, cache, jnp.asarray(toks, jnp.int32)[None], jnp.asarray(par, jnp.int32),
                         graphdef=target.graphdef, treedef=target.treedef, kernels=target.kernels)
    return np.asarray(logits[0])
