"""The attention layer's decode-step prologue (T = 1) as ONE Pallas-Triton kernel: q/k RMSNorm (1 + w), partial
RoPE, the output gate's sigmoid and the KV-cache write, from the layer's fused projection row to the inputs of
the attention kernel and of o_proj.

Same function as `kernels_pallas.attention_reference.decode_attention_prep` (re-exported here as
`decode_attention_prep_reference`), which composes the model's own ops; in XLA these are ~10 small fusions per
attention layer (the norms' reductions, the rotations and their concatenations, the sigmoid, two cache
updates).

Grid (B, H + Hkv): program (b, p) owns query head p (p < H) or kv head p - H. A query program loads its query
and gate halves of the row; a kv program its k and v slices. The norm's sum of squares is over the head's hd
values (fp32); rotate-half needs each value's partner dim, so the program loads the row a second time in
partner order (dims i ± rd/2 below rd) and normalises both copies with the same scale — elementwise the same
values, no register shuffle. Then, as the reference: x·rsqrt(mean(x²) + eps)·(1 + w) rounded; the rotated
dims rounded(rounded(x·cos) + rounded(rot·sin)); sgate = rounded(1 / (1 + exp(-gate))). A kv program writes
k / v to its outputs and to row `start` of the caches, which alias the cache inputs (`input_output_aliases`:
in place under a jit that donates the cache; the attention kernel then reads rows [0, start) of the same
buffers). With `layer` the caches are the stacked [L, B, Hkv, S, hd] of every layer (a `lax.scan` over layers
passes the whole stack: a slice fed to a kernel is copied) and the row is written into layer `layer`, the
stacks aliased whole; q_norm / k_norm may then be the stacked [L, hd] of every layer too (each read at row
`layer` in the kernel: a slice fed to a custom call is a copy kernel of its own). cos / sin come from outside
(one XLA fusion per step, shared by every attention layer).

The projection row may come as its GEMV's unsummed split-K partials [S, B, C] (`dense(..., reduce=False)`):
the kernel then sums each value's S partials in order and rounds (`numerics.sum_partials`), so no XLA
reduction runs between the GEMV and this kernel.

Roundings: every `rounded(…, dtype)` is a cast to the activations' dtype and back (interpret mode: the
`reduce_precision` of `numerics.rounded`); fp32 activations make them the identity. hd must be a power of two
(256 at 27B), rd even and ≤ hd.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention_reference import decode_attention_prep as decode_attention_prep_reference
from kernels_pallas.numerics import rounded
from kernels_pallas.tree_attention import pos_operand
from kernels_pallas._common import SharedMemoryError, compiler_params, is_pow2, pl, pltr
from kernels_pallas._common import smem_limit as _limit

__all__ = ["decode_attention_prep", "decode_attention_prep_reference", "smem_bytes"]


def smem_bytes(num_warps: int) -> int:
    """Shared memory (bytes, an upper estimate) of a program: no tile is staged (no dot), only the cross-warp
    exchanges of its two norms' sums of squares. 27B widths, 4 warps: 32 (Triton's allocation: 16), any dtype."""
    return 2 * 4 * num_warps


def _kernel(pos_ref, qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, kc_ref, vc_ref,
            q_ref, sg_ref, k_ref, v_ref, kco_ref, vco_ref, *, h: int, hkv: int, hd: int, rd: int, eps: float,
            nparts: int, has_layer: bool, norms_stacked: tuple[bool, bool], act, interpret: bool):
    """pos_ref: (start,), or (start, layer) with stacked caches; norms_stacked: whether qn_ref / kn_ref are
    [L, hd] (read at row `layer`) rather than [hd]."""
    del kc_ref, vc_ref  # aliased by kco_ref / vco_ref: only row `start` (of layer `layer`) is written
    f32 = jnp.float32
    b, p = pl.program_id(0), pl.program_id(1)
    half = rd // 2
    idx = jnp.arange(hd, dtype=jnp.int32)
    in_rot = idx < rd
    partner = jnp.where(in_rot, jnp.where(idx < half, idx + half, idx - half), idx)  # rotate-half source dim

    def rnd(x):  # fp32 x rounded once to the activations' dtype, as fp32
        if jnp.dtype(act) == jnp.float32:
            return x
        return (rounded(x, act) if interpret else x.astype(act)).astype(f32)

    def ld(ref_at):
        return pltr.load(ref_at).astype(f32)

    def ldq(cols):  # the projection row at cols (fp32); partials [S, B, C]: summed in order, rounded
        if not nparts:
            return ld(qkv_ref.at[b, cols])
        acc = ld(qkv_ref.at[jnp.int32(0), b, cols])
        for p_ in range(1, nparts):
            acc = acc + ld(qkv_ref.at[jnp.int32(p_), b, cols])
        return rnd(acc)

    def norm_rope(off, w_ref, stacked: bool):
        """The head's hd values at row offset `off`: (1 + w) RMSNorm, rounded, then RoPE on dims < rd; w_ref [hd],
        or stacked [L, hd] read at row `layer`."""
        wl = (pos_ref[1],) if stacked else ()
        x = ldq(off + idx)
        xp = ldq(off + partner)  # the same values in partner order
        inv = jax.lax.rsqrt(jnp.sum(x * x) / hd + eps)
        xn = rnd((x * inv) * (1.0 + ld(w_ref.at[(*wl, idx)])))
        xnp = rnd((xp * inv) * (1.0 + ld(w_ref.at[(*wl, partner)])))
        c = pltr.load(cos_ref.at[b, idx], mask=in_rot, other=0).astype(f32)
        s = pltr.load(sin_ref.at[b, idx], mask=in_rot, other=0).astype(f32)
        rot = jnp.where(idx < half, -xnp, xnp)
        return jnp.where(in_rot, rnd(rnd(xn * c) + rnd(rot * s)), xn)

    @pl.when(p < h)
    def _():
        off = p * (2 * hd)
        pltr.store(q_ref.at[b, p, idx], norm_rope(off, qn_ref, norms_stacked[0]).astype(q_ref.dtype))
        g = ldq(off + hd + idx)
        pltr.store(sg_ref.at[b, p, idx], rnd(1.0 / (1.0 + jnp.exp(-g))).astype(sg_ref.dtype))

    @pl.when(p >= h)
    def _():
        j = p - h
        start = pos_ref[0]
        lw = (pos_ref[1],) if has_layer else ()  # one layer of the stacked caches, written in place
        k = norm_rope(h * 2 * hd + j * hd, kn_ref, norms_stacked[1])
        v = ldq((2 * h + hkv) * hd + j * hd + idx)
        pltr.store(k_ref.at[b, j, idx], k.astype(k_ref.dtype))
        pltr.store(v_ref.at[b, j, idx], v.astype(v_ref.dtype))
        pltr.store(kco_ref.at[(*lw, b, j, start, idx)], k.astype(kco_ref.dtype))
        pltr.store(vco_ref.at[(*lw, b, j, start, idx)], v.astype(vco_ref.dtype))


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "head_dim", "eps", "interpret",
                                             "num_warps", "smem_limit"))
def decode_attention_prep(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start, *, num_heads: int,
                          num_kv_heads: int, head_dim: int, eps: float, layer=None, interpret: bool = False,
                          num_warps: int = 4, smem_limit: int | None = None):
    """One token's attention prologue (see `decode_attention_prep_reference` for the arguments and results; layer:
    the caches are the stacked [L, B, Hkv, S, hd], row `start` of layer `layer` written in place, the stacks
    returned whole; q_norm / k_norm each [hd], or with layer the stacked [L, hd] read at row `layer` in here)."""
    h, hkv, hd = num_heads, num_kv_heads, head_dim
    nparts = qkv.shape[0] if qkv.ndim == 3 else 0  # split-K partials of the projection: summed in here
    B, C = qkv.shape[-2:]
    rd = cos.shape[-1]
    assert C == (2 * h + 2 * hkv) * hd, (qkv.shape, h, hkv, hd)
    assert is_pow2(hd) and hd >= 16 and rd % 2 == 0 and 0 < rd <= hd, (hd, rd)
    lead = () if layer is None else k_cache.shape[:1]  # (L,) of stacked caches
    norms_stacked = (q_norm.ndim == 2, k_norm.ndim == 2)  # [L, hd]: read at row `layer` in the kernel
    assert cos.shape == sin.shape == (B, rd), (cos.shape, sin.shape, B, rd)
    for w, st in zip((q_norm, k_norm), norms_stacked):
        assert w.shape[-1:] == (hd,) and w.ndim in (1, 2) and (not st or layer is not None), (w.shape, layer)
    S = k_cache.shape[-2]
    assert k_cache.shape == v_cache.shape == (*lead, B, hkv, S, hd), (k_cache.shape, v_cache.shape, layer)
    if smem_bytes(num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"decode_attention_prep: {smem_bytes(num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    act = k_cache.dtype if nparts else qkv.dtype
    kern = functools.partial(_kernel, h=h, hkv=hkv, hd=hd, rd=rd, eps=float(eps), nparts=nparts,
                             has_layer=layer is not None, norms_stacked=norms_stacked, act=act, interpret=interpret)
    return pl.pallas_call(
        kern,
        grid=(B, h + hkv),
        out_shape=[
            jax.ShapeDtypeStruct((B, h, hd), act),
            jax.ShapeDtypeStruct((B, h, hd), act),
            jax.ShapeDtypeStruct((B, hkv, hd), act),
            jax.ShapeDtypeStruct((B, hkv, hd), act),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={6: 4, 7: 5},
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="decode_attention_prep",
    )(pos_operand(start, layer), qkv, q_norm, k_norm, cos, sin, k_cache, v_cache)
