"""Weight-only FP8 GEMV / skinny GEMM as a Pallas-Triton kernel: y[M, N] = x[M, K] @ (q[K, N] ⊙ block scales).

q is float8_e4m3fn [K, N] (the model's layout: contracted axis first), scale is fp32 [ceil(K / block_in), N]:
one factor per input block of `block_in` rows and per output column (the checkpoint's [out/bo, in/bi] block
scales expanded along the output channels, so fused parameters keep each part's own grid). Dequantized
weight W[k, n] = q[k, n] · scale[k // block_in, n]. x is bf16; the result is x.dtype.

Design (the bf16 kernel `dense.py` with fp8 tiles; its design notes apply)
  * grid (cdiv(N, BN), S): program (j, s) owns the BN-column stripe j and the s-th of S contiguous K ranges
    (split-K), looping over BK-row chunks (`fori_loop`, static trip count: Triton pipelines the loads).
  * BK divides block_in (BK = block_in = 128 for the release), so every chunk lies inside one scale block:
    the chunk's fp8 tile is converted to bf16 in registers (exact: e4m3 ⊂ bf16), contracted with the bf16 x
    tile on the tensor cores in fp32, and the fp32 partial sum [Mp, BN] is multiplied by the block's scale
    row [BN] before it is added to the accumulator. The weight is never materialised in bf16 and the scale
    costs one [BN] fp32 load per chunk (4 B per column per 128 rows: 3 % of the fp8 bytes).
  * Numerics: Σ_blocks scale_b · (Σ_k x·q) in fp32 — not bit-equal to the dequantize-then-bf16-GEMM path
    (that rounds every q·scale to bf16 first); both are within bf16 rounding of the exact product, this one
    closer (`dense_fp8_reference` computes the same sum in jnp).
  * S > 1: fp32 partials [S·M, N], summed (+ cast) by one small XLA fusion after the kernel. Masks only where
    the shape needs them (rows ≥ M, K or N not a multiple of the block, the last K split), decided statically.
  * `default_config(M, K, N, block_in)`: BN 128; BK the largest power of two dividing block_in, at most 128
    (M ≤ 16) / 64; split-K up to ≥ 4 programs per SM — the bf16 kernel's rule until the fp8 sweep
    (benchmarks/bench_gemv.py --fp8) picks its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import dense
from kernels_pallas._common import is_pow2, pl, pltr

__all__ = ["dense_fp8", "dense_fp8_reference", "default_config", "dequantize", "max_block_k", "N_SM"]

N_SM = dense.N_SM
FP8 = jnp.float8_e4m3fn


def _cdiv(a, b):
    return -(-a // b)


def dequantize(q, scale, block_in: int, dtype=jnp.float32):
    """W [K, N] = q · scale[k // block_in] in fp32, cast to dtype."""
    K = q.shape[0]
    s = jnp.repeat(scale.astype(jnp.float32), block_in, axis=0)[:K]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dense_fp8_reference(x, q, scale, *, block_in: int = 128):
    """y = Σ_b scale[b] ⊙ (x[:, block b] @ q[block b]) with fp32 accumulation, in x.dtype. x [M, K] (any
    leading dims), q fp8 [K, N], scale [ceil(K / block_in), N]."""
    lead, K = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, K)
    M, N = x.shape[0], q.shape[1]
    nb = scale.shape[0]
    pad = nb * block_in - K
    xb = jnp.pad(x, ((0, 0), (0, pad))).reshape(M, nb, block_in)
    qb = jnp.pad(q.astype(x.dtype), ((0, pad), (0, 0))).reshape(nb, block_in, N)
    part = jnp.einsum("mbk,bkn->bmn", xb, qb, preferred_element_type=jnp.float32)  # [nb, M, N] per block
    y = jnp.einsum("bmn,bn->mn", part, scale.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype).reshape(*lead, N)


def max_block_k(block_in: int) -> int:
    """The largest power of two dividing block_in (a BK the kernel can use: ≥ 16 needed)."""
    return block_in & -block_in


def default_config(M: int, K: int, N: int, block_in: int = 128, *, block_n: int | None = None,
                   block_k: int | None = None, target_programs: int = 4 * N_SM) -> dict:
    """The bf16 GEMV's rule (`dense.default_config`) with K chunks that divide the scale block; past 16 rows
    BN = BK = 64 with 4 warps (H200 sweep, benchmarks/results/gemv_fp8_h200.json, 2026-11-30: at M = 65 the
    best variant on all five 27B shapes, 1.6-2.7x the bf16 rule; at M = 1 the bf16 rule stayed best, and the
    swapped (wᵀ @ xᵀ) and CUDA-core FMA forms, tried then removed, lost on every shape)."""
    if M > 16:
        block_n, block_k = block_n or 64, block_k or min(64, max_block_k(block_in))
    cfg = dense.default_config(M, K, N, block_n=block_n, block_k=block_k, target_programs=target_programs,
                               max_block_k=max_block_k(block_in))
    if M > 16:
        cfg["num_warps"] = 4
    return cfg


def _kernel(x_ref, q_ref, s_ref, o_ref, *, M, K, N, Mp, bn, bk, nk, split, block_in, mode):
    f32 = jnp.float32
    tl = dense.tile(M, K, N, Mp, bn, bk, nk, split)
    s, n0, kbase, mask_n, mask_k, cols, rows, n_ok, m_ok = tl

    def load_q(k0, dtype):  # [bk, bn] fp8 -> dtype (exact: e4m3 ⊂ bf16, f16)
        if not (mask_n or mask_k):
            t = q_ref[pl.ds(k0, bk), pl.ds(n0, bn)]
        else:
            kk = k0 + jnp.arange(bk, dtype=jnp.int32)
            msk = (kk < K)[:, None] & n_ok[None, :]
            # masked-off lanes are zeroed after the cast (Triton lowering has no fp8 `other` constant)
            t = pltr.load(q_ref.at[kk[:, None], cols[None, :]], mask=msk)
            return jnp.where(msk, t.astype(dtype), 0)
        return t.astype(dtype)

    def load_x(k0):  # [Mp, bk]; rows >= M (and k >= K) read as 0
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        if Mp == M and not mask_k:
            return x_ref[:, pl.ds(k0, bk)]
        msk = m_ok[:, None] & (kk < K)[None, :] if mask_k else jnp.broadcast_to(m_ok[:, None], (Mp, bk))
        return pltr.load(x_ref.at[rows[:, None], kk[None, :]], mask=msk, other=0)

    def load_scale(k0):  # [1, bn] fp32: the scale row of the block holding rows k0 .. k0 + bk
        b = k0 // block_in
        if not mask_n:
            return s_ref[pl.ds(b, 1), pl.ds(n0, bn)]
        return pltr.load(s_ref.at[b + jnp.zeros((1, 1), jnp.int32), cols[None, :]], mask=n_ok[None, :], other=0)

    # x tile [Mp, bk] @ weight tile [bk, bn] on the tensor cores, in bf16 ("mma") or f16 ("f16": e4m3 -> f16 is
    # one hardware cvt per pair; x must fit f16's range, tiny values lose bits — a timing probe, never the default)
    dt = jnp.float16 if mode == "f16" else x_ref.dtype

    def body(i, acc):
        k0 = pl.multiple_of(kbase + i * bk, bk)
        part = jnp.dot(load_x(k0).astype(dt), load_q(k0, dt), preferred_element_type=f32)  # [Mp, bn]
        return acc + part * load_scale(k0)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((Mp, bn), f32))
    dense.store_tile(o_ref, acc, tl, M, Mp, bn, split)


MODES = ("mma", "f16")


@functools.partial(jax.jit, static_argnames=("block_in", "interpret", "block_n", "block_k", "split_k",
                                             "num_warps", "num_stages", "target_programs", "mode"))
def dense_fp8(x, q, scale, *, block_in: int = 128, interpret: bool = False, block_n: int | None = None,
              block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, target_programs: int = 4 * N_SM, mode: str = "mma"):
    """y[M, N] = x[M, K] @ dequantized q[K, N] (fp32 accumulation, block scales on the partial sums), in
    x.dtype (bf16). Leading dims of x are flattened; M ≤ 256.

    block_n / block_k: powers of two ≥ 16, block_k dividing block_in; split_k: number of K ranges.
    mode: "mma" (x @ w on the tensor cores, bf16 tiles) or "f16" (both tiles in f16: a timing probe of the
    one-instruction e4m3 -> f16 conversion; x must fit f16's range)."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    x = x.reshape(-1, K)
    M = x.shape[0]
    K2, N = q.shape
    assert K2 == K, (x.shape, q.shape)
    assert q.dtype == FP8 and x.dtype == jnp.bfloat16, (x.dtype, q.dtype)
    assert scale.shape == (_cdiv(K, block_in), N), (scale.shape, K, N, block_in)
    cfg = default_config(M, K, N, block_in, block_n=block_n, block_k=block_k, target_programs=target_programs)
    bn, bk = cfg["block_n"], cfg["block_k"]
    assert is_pow2(bn) and is_pow2(bk) and bn >= 16 and bk >= 16 and block_in % bk == 0, (bn, bk, block_in)
    assert mode in MODES, mode
    nk, split, nw, ns, Mp = dense.resolve(cfg, M, K, split_k, num_warps, num_stages)
    out_dtype = x.dtype if split == 1 else jnp.float32
    kern = functools.partial(_kernel, M=M, K=K, N=N, Mp=Mp, bn=bn, bk=bk, nk=nk, split=split, block_in=block_in,
                             mode=mode)
    y = dense.launch(kern, (x, q, scale.astype(jnp.float32)), M=M, N=N, bn=bn, split=split, out_dtype=out_dtype,
                     num_warps=nw, num_stages=ns, interpret=interpret, name="dense_fp8_dot")
    if split > 1:
        y = y.reshape(split, M, N).sum(0).astype(x.dtype)
    return y.reshape(*lead, N)
