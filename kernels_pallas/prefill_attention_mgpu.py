"""Causal prefill attention as the Mosaic GPU kernel of `tree_attention_mgpu` in its causal mode.

Same function as `kernels_pallas.prefill_attention.prefill_attention_reference` (and the Pallas-Triton
`prefill_attention`): the T queries of a chunk at positions [start, start + T) attend to the committed cache
rows [0, start) and, causally, to the chunk's own new rows (query t sees new rows j <= t). The kernel body is
`tree_attention_mgpu`'s (GQA-folded rows, TMA-fed K/V ring, two ping-ponged wgmma warpgroups, run-time start):
in its causal mode a CTA visits the new-row blocks up to its last token only, masks from iotas (no mask
operand) and only the blocks that reach past a warpgroup's first token, and the late (heavy) row blocks launch
first. bf16 / fp16 only.
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas.prefill_attention import prefill_attention_reference, prefill_flops
from kernels_pallas import tree_attention_mgpu as _tm

__all__ = ["prefill_attention", "prefill_attention_reference", "prefill_flops", "supports"]

supports = _tm.supports


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "num_stages", "n_split", "pingpong",
                                             "target_ctas"))
def prefill_attention(q, k_cache, v_cache, start, k_new, v_new, *, layer=None, interpret: bool = False,
                      block_k: int = 64, num_stages: int = 2, n_split: int | None = None, pingpong: bool = True,
                      target_ctas: int = 132):
    """q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar or [B]; k/v_new [B,T,Hkv,hd] -> [B,T,H,hd]
    (q.dtype). Same as `prefill_attention_reference` (layer: the caches are the stacked [L,B,Hkv,S,hd] of every
    layer, layer `layer` read in place). n_split: splits of each row block's keys (default: as many as fit one
    wave of target_ctas CTAs; 1 once the row blocks fill the GPU); the other options as
    `tree_attention_mgpu.tree_attention`."""
    return _tm.attention(q, k_cache, v_cache, start, k_new, v_new, None, causal=True, layer=layer,
                         interpret=interpret, block_k=block_k, num_stages=num_stages, n_split=n_split,
                         pingpong=pingpong, target_ctas=target_ctas)
