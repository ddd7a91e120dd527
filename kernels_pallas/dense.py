"""Weight-streaming GEMV / skinny GEMM as a Pallas-Triton kernel: y[M, N] = x[M, K] @ w[K, N].

Same function as `dense_reference` (bf16 in, fp32 accumulation, output in x.dtype). Built for the decode
step (M = 1) and the verify pass (M ≤ 128: 17, 65, 129 → padded inside to a power of two ≥ 16), where the
time is the time to stream w ([K, N] row-major, as the model stores it) from HBM once.

Design
  * grid (cdiv(N, BN), S): program (j, s) owns the BN-column stripe j and the s-th of S contiguous K
    ranges (split-K). It loops over its range in BK-row chunks (`fori_loop` with a static trip count →
    scf.for, which Triton software-pipelines with `num_stages` cp.async stages): each chunk is one
    [BK, BN] tile of w (BN·2 contiguous bytes per row) and one [Mp, BK] tile of x (tiny, from L2).
  * fp32 += x_tile[Mp, BK] @ w_tile[BK, BN] on the tensor cores (x rows ≥ M masked to 0, Mp ≥ 16). A
    CUDA-core FMA variant for M = 1 (a [BK, BN] fp32 accumulator, reduced after the loop) ran at 0.5-0.6x
    of this on every H200 shape (gemv_h200.json): removed.
  * S = 1: the program stores its [M, BN] result in x.dtype. S > 1: fp32 partial sums [S·M, N] are stored
    and summed (+ cast) by one small XLA fusion after the kernel (S·M·N·4 bytes: ≪ the weight bytes).
  * Masks only where a shape needs them (rows ≥ M; K or N not a multiple of the block; the tail of the
    last K split), decided statically. No padded copy of w or x is ever made.
  * `default_config(M, K, N)`: BN 128, BK 128 (M ≤ 16) / 64, split-K up to ≥ 4 programs per SM (132 SMs): the best
    single rule of the H200 sweep (benchmarks/results/gemv_h200.json, 2026-11-29).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas._common import compiler_params, is_pow2, next_pow2, pl, pltr

__all__ = ["dense", "dense_reference", "default_config", "N_SM"]

N_SM = 132  # H200


def dense_reference(x, w):
    """y = x @ w with fp32 accumulation, in x.dtype. x [M, K], w [K, N]."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _cdiv(a, b):
    return -(-a // b)


def default_config(M: int, K: int, N: int, *, block_n: int | None = None, block_k: int | None = None,
                   target_programs: int = 4 * N_SM) -> dict:
    """Block sizes / split-K / warps / stages used when the caller leaves them None."""
    small = M <= 16
    bn = block_n or min(128, max(16, next_pow2(N)))
    bk = block_k or min(128 if small else 64, max(16, next_pow2(K)))
    nb, nkb = _cdiv(N, bn), _cdiv(K, bk)
    # fp32 partials (split·M·N·4 bytes) must stay small next to the weights (K·N·2 bytes)
    max_split = max(1, K // (16 * M))
    split = 1
    while nb * split < target_programs and split * 2 <= min(nkb, max_split):
        split *= 2
    return dict(block_n=bn, block_k=bk, split_k=split,
                num_warps=4 if small else 8, num_stages=3)


def _kernel(x_ref, w_ref, o_ref, *, M, K, N, Mp, bn, bk, nk, split):
    f32 = jnp.float32
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    kbase = s * (nk * bk)
    mask_n = N % bn != 0
    mask_k = nk * bk * split != K
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    rows = jnp.arange(Mp, dtype=jnp.int32)
    n_ok = cols < N
    m_ok = rows < M

    def load_w(k0):
        if not (mask_n or mask_k):
            return w_ref[pl.ds(k0, bk), pl.ds(n0, bn)]
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        msk = (kk < K)[:, None] & n_ok[None, :]
        return pltr.load(w_ref.at[kk[:, None], cols[None, :]], mask=msk, other=0)

    def load_x(k0):  # [Mp, bk]; rows >= M (and k >= K) read as 0
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        if Mp == M and not mask_k:
            return x_ref[:, pl.ds(k0, bk)]
        msk = m_ok[:, None] & (kk < K)[None, :] if mask_k else jnp.broadcast_to(m_ok[:, None], (Mp, bk))
        return pltr.load(x_ref.at[rows[:, None], kk[None, :]], mask=msk, other=0)

    def k_at(i):
        k0 = kbase + i * bk
        return pl.multiple_of(k0, bk)

    def body(i, acc):
        k0 = k_at(i)
        return acc + jnp.dot(load_x(k0), load_w(k0), preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((Mp, bn), f32))

    out_rows = s * M + rows if split > 1 else rows
    if Mp == M and not mask_n:
        if split > 1:
            o_ref[pl.ds(pl.multiple_of(s * M, M), M), pl.ds(n0, bn)] = acc.astype(o_ref.dtype)
        else:
            o_ref[:, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)
    else:
        pltr.store(o_ref.at[out_rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=m_ok[:, None] & n_ok[None, :])


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k", "split_k", "num_warps",
                                             "num_stages", "target_programs"))
def dense(x, w, *, interpret: bool = False, block_n: int | None = None,
          block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
          num_stages: int | None = None, target_programs: int = 4 * N_SM):
    """y[M, N] = x[M, K] @ w[K, N], fp32 accumulation, in x.dtype. Any leading dims of x are flattened.

    block_n / block_k: powers of two; split_k: number of K ranges (fp32 partials summed after the kernel)."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    x = x.reshape(-1, K)
    M = x.shape[0]
    K2, N = w.shape
    assert K2 == K, (x.shape, w.shape)
    cfg = default_config(M, K, N, block_n=block_n, block_k=block_k, target_programs=target_programs)
    bn, bk = cfg["block_n"], cfg["block_k"]
    assert is_pow2(bn) and is_pow2(bk) and bn >= 16 and bk >= 16, (bn, bk)
    split = cfg["split_k"] if split_k is None else split_k
    nw = num_warps or cfg["num_warps"]
    ns = num_stages or cfg["num_stages"]
    nkb = _cdiv(K, bk)
    split = max(1, min(split, nkb))
    nk = _cdiv(nkb, split)
    split = _cdiv(nkb, nk)  # no program with an empty K range
    Mp = max(16, next_pow2(M))
    assert Mp <= 256, f"M={M}: up to 256 rows per call"
    out_dtype = x.dtype if split == 1 else jnp.float32
    kern = functools.partial(_kernel, M=M, K=K, N=N, Mp=Mp, bn=bn, bk=bk, nk=nk, split=split)
    y = pl.pallas_call(
        kern,
        grid=(_cdiv(N, bn), split),
        out_shape=jax.ShapeDtypeStruct((split * M, N), out_dtype),
        compiler_params=compiler_params(nw, ns),
        interpret=interpret,
        name="dense_dot",
    )(x, w)
    if split > 1:
        y = y.reshape(split, M, N).sum(0).astype(x.dtype)
    return y.reshape(*lead, N)
