"""Kernel dispatch: the model calls these with `kernels="xla"` (plain jnp references, the spec) or
`kernels="pallas"` (the GPU kernels in `kernels_pallas/`, same signatures, same results)."""

from __future__ import annotations

from jaxddtree import gdn_math

KERNELS = ("xla", "pallas")


def _check(kernels: str):
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels '{kernels}' (choose one of {KERNELS})")


def tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask, kernels="xla"):
    """q [B,T,H,hd] attends to cache rows [0, start) and to new rows j with mask[b,i,j] -> [B,T,H,hd]."""
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import tree_attention as ta
        return ta.tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask)
    from jaxddtree.attention import tree_attention_reference
    return tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask)


def gdn_step(q, k, v, g, beta, state, kernels="xla"):
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import gdn_decode
        return gdn_decode.gdn_step(q, k, v, g, beta, state)
    return gdn_math.gdn_step(q, k, v, g, beta, state)


def gdn_chunked(q, k, v, g, beta, state, kernels="xla"):
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import gdn_prefill
        return gdn_prefill.gdn_chunked(q, k, v, g, beta, state)
    return gdn_math.gdn_chunked(q, k, v, g, beta, state)


def gdn_masked_block(q, k, v, g, beta, mask, state, kernels="xla", max_depth: int | None = None):
    """max_depth (optional, static): no root path of `mask` has more nodes (DDTree: the drafter's block
    size); the Pallas kernel uses it only to bound its solve loop. The result does not depend on it."""
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import gdn_tree
        return gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, max_depth=max_depth)
    return gdn_math.gdn_masked_block(q, k, v, g, beta, mask, state)
