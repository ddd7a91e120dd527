"""Exact tree verification on the hybrid model, and the commit of the accepted path.

`verify` runs the N = 1 + budget tree nodes through the target in one pass (attention: committed prefix
+ ancestor mask; GDN: tree conv + ancestor-masked WY form) without touching the cache, and returns each
node's logits, the drafter features of each node, and a stash. `commit` writes the accepted path into
the cache: attention K/V at `start .. start + depth`, the GDN recurrent state rebuilt for the accepted
leaf from the stash (no per-node states), the conv state from the path's pre-conv inputs.
See ../shared/docs/tree_verify.md for the math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import ops
from jaxddtree.model import sharding
from jaxddtree.model.attention import AttentionStash
from jaxddtree.model.cache import GDNState, KVCache, ModelCache
from jaxddtree.model.gated_deltanet import GDNStash
from jaxddtree.model.layout import TokenLayout


def verify(model, cache: ModelCache, tokens: jax.Array, layout: TokenLayout, feature_layers=()):
    """tokens [B, N] laid out by a tree layout -> (logits [B, N, V] fp32, features [B, N, F] | None,
    stashes). `model` is a merged `Qwen35` (call inside jit)."""
    assert layout.is_tree, "verify needs a tree layout (jaxddtree.model.layout.tree)"
    logits, _, features, stashes = model(tokens, cache, layout, feature_layers=feature_layers, logits="all")
    return logits, features, stashes


def commit(cache: ModelCache, stashes, path: jax.Array, path_len: jax.Array, kernels: str = "xla",
           mesh=None) -> ModelCache:
    """Commit the accepted root->leaf path (path [B, P] node indices in depth order, padded; path_len [B]
    tokens, root included; the same for every batch row today) into the cache. Fixed shapes. `stashes`: per
    layer-group position, stacked over the groups (`Qwen35`); each position's layers commit at once (the KV rows
    of every group in one write; the GDN states by `ops.gdn_commit` vmapped over the groups).
    `mesh`: a tensor-parallel target's (model/sharding.py): each device commits its own heads."""
    if mesh is not None:
        return sharding.commit_per_shard(functools.partial(commit, kernels=kernels), mesh, cache, stashes, path,
                                         path_len)
    start = cache.length
    n_acc = path_len[0]
    # the path's rows of a stash [G, B, N, ...] -> [G, B, P, ...], in depth order (a later row is deeper)
    take = lambda x: jnp.take_along_axis(x, path.reshape((1,) + path.shape + (1,) * (x.ndim - 3)), axis=2)
    entries = []
    for entry, stash in zip(cache.groups, stashes):  # per group position, every group at once
        if isinstance(entry, KVCache):
            assert isinstance(stash, AttentionStash)
            k = jnp.swapaxes(take(stash.k), 2, 3).astype(entry.k.dtype)  # [G, B, Hkv, P, hd]
            v = jnp.swapaxes(take(stash.v), 2, 3).astype(entry.v.dtype)
            entries.append(KVCache(k=jax.lax.dynamic_update_slice(entry.k, k, (0, 0, 0, start, 0)),
                                   v=jax.lax.dynamic_update_slice(entry.v, v, (0, 0, 0, start, 0))))
        else:
            assert isinstance(stash, GDNStash)
            state, conv = jax.vmap(lambda r, c, k, W, g, x: ops.gdn_commit(r, c, k, W, g, x, path, path_len,
                                                                            kernels=kernels))(
                entry.recurrent, entry.conv, stash.k, stash.W, stash.g, stash.x)
            entries.append(GDNState(conv=conv, recurrent=state))
    return ModelCache(groups=tuple(entries), length=start + n_acc)
