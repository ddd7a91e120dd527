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
    and summed (+ rounded) by one small XLA fusion after the kernel (S·M·N·4 bytes: ≪ the weight bytes).
  * Masks only where a shape needs them (rows ≥ M; K or N not a multiple of the block; the tail of the
    last K split), decided statically. No padded copy of w or x is ever made.
  * Optional prologue / epilogue, for the decode step (each one the same ops as the jnp reference, with the
    same roundings, so a fused call equals the unfused chain bit for bit):
    - `gate`: x is first rounded(x · gate) (attention's output gate before o_proj).
    - `residual` [M, N]: the result is rounded(residual + rounded(y)) (the decoder's residual add).
      S = 1: in the kernel's epilogue; S > 1: in the split-K reduction after the kernel, which sums the
      S partials in order with plain adds (one elementwise XLA loop fusion with the roundings and the
      residual, which XLA also fuses with the caller's elementwise consumers, e.g. the MLP's SwiGLU).
    An RMSNorm prologue and a SwiGLU prologue (summing an MLP's gate|up partials) lost on the H200 and were
    removed (git history; kernels_pallas/ops.py says why).
  * `default_config(M, K, N)`: BN 128, BK 128 (M ≤ 16) / 64, split-K up to ≥ 4 programs per SM (132 SMs): the best
    single rule of the H200 sweep (benchmarks/results/gemv_h200.json, 2026-11-29).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas._common import compiler_params, first_fit, is_pow2, next_pow2, pipeline_buffers, pl, pltr, tile_bytes
from kernels_pallas.numerics import f32, rounded, sum_partials

__all__ = ["dense", "dense_reference", "default_config", "fit_config", "smem_bytes", "N_SM"]

N_SM = 132  # H200


def dense_reference(x, w, gate=None, residual=None, *, layer=None):
    """y = x @ w with fp32 accumulation, in x.dtype. x [M, K], w [K, N] (or, with `layer`, one layer's weight of
    the stacked w [L, K, N]: w[layer], an int32 scalar; the kernel reads it in place, no slice copied).

    gate [M, K]: x -> rounded(x · gate) first; residual [M, N]: y -> rounded(residual + y) (residual's dtype)."""
    if layer is not None:
        w = w[layer]
    if gate is not None:
        x = rounded(f32(x) * f32(gate), x.dtype)
    y = rounded(jnp.dot(x, w, preferred_element_type=jnp.float32), x.dtype)
    if residual is not None:
        y = rounded(f32(residual) + f32(y), residual.dtype)
    return y


def _cdiv(a, b):
    return -(-a // b)


def default_config(M: int, K: int, N: int, *, block_n: int | None = None, block_k: int | None = None,
                   target_programs: int = 4 * N_SM, max_block_k: int = 128) -> dict:
    """Block sizes / split-K / warps / stages used when the caller leaves them None (max_block_k: a bound on
    the K chunk, e.g. the fp8 scale block)."""
    small = M <= 16
    bn = block_n or min(128, max(16, next_pow2(N)))
    bk = block_k or min(128 if small else 64, max_block_k, max(16, next_pow2(K)))
    nb, nkb = _cdiv(N, bn), _cdiv(K, bk)
    # fp32 partials (split·M·N·4 bytes) must stay small next to the weights (K·N·2 bytes)
    max_split = max(1, K // (16 * M))
    split = 1
    while nb * split < target_programs and split * 2 <= min(nkb, max_split):
        split *= 2
    return dict(block_n=bn, block_k=bk, split_k=split,
                num_warps=4 if small else 8, num_stages=3)


def smem_bytes(M: int, K: int, bk: int, bn: int, x_dtype, w_dtype, num_stages: int, *,
               has_gate: bool = False) -> int:
    """Shared memory (bytes, an upper estimate) of a `dense` program: per K chunk the [bk, bn] weight tile and the
    [Mp, bk] x tile (a gate: its tile too), kept `pipeline_buffers` times (wgmma, asynchronous from 64 rows).
    bf16, M = 1, 128 x 128: 73728 (Triton's own allocation, the same); fp32 at 129 rows, 3 stages: 294912."""
    Mp = max(16, next_pow2(M))
    bufs = pipeline_buffers(num_stages, async_mma=Mp >= 64)
    per = tile_bytes((bk, bn), w_dtype) + tile_bytes((Mp, bk), x_dtype)
    if has_gate:
        per += tile_bytes((Mp, bk), x_dtype)
    return bufs * per


def fit_config(cfg: dict, M: int, K: int, x_dtype, w_dtype, num_stages: int | None = None, *,
               has_gate: bool = False, limit: int | None = None) -> dict:
    """`cfg` (a `default_config`) with block_k / num_stages (num_stages: the caller's, else cfg's) lowered where the
    tiles do not fit the shared memory for these dtypes (`smem_bytes`): fewer stages first (down to 1), then half
    the K chunk (down to 16); SharedMemoryError when none fits. bf16 at 27B widths: unchanged; fp32 from 65 rows:
    2 stages."""
    ns = num_stages or cfg["num_stages"]
    bks = [cfg["block_k"]]
    while bks[-1] > 16:
        bks.append(bks[-1] // 2)
    est = lambda c: smem_bytes(M, K, c[0], cfg["block_n"], x_dtype, w_dtype, c[1], has_gate=has_gate)
    bk, st = first_fit([(b, n) for b in bks for n in range(ns, 0, -1)], est, limit, what="dense")
    return dict(cfg, block_k=bk, num_stages=st, smem=est((bk, st)))


def split_plan(K: int, bk: int, split: int) -> tuple[int, int]:
    """(K chunks per program, K ranges) for `split` requested ranges of bk-row chunks: no empty range."""
    nkb = _cdiv(K, bk)
    nk = _cdiv(nkb, max(1, min(split, nkb)))
    return nk, _cdiv(nkb, nk)


def resolve(cfg: dict, M: int, K: int, split_k, num_warps, num_stages) -> tuple[int, int, int, int, int]:
    """(nk, split, num_warps, num_stages, Mp) of a call: the caller's overrides over `cfg`, the K plan, the
    padded row count (≥ 16, ≤ 256)."""
    nk, split = split_plan(K, cfg["block_k"], cfg["split_k"] if split_k is None else split_k)
    Mp = max(16, next_pow2(M))
    assert Mp <= 256, f"M={M}: up to 256 rows per call"
    return nk, split, num_warps or cfg["num_warps"], num_stages or cfg["num_stages"], Mp


def launch(kern, args, *, M: int, N: int, bn: int, split: int, out_dtype, num_warps: int, num_stages: int,
           interpret: bool, name: str):
    """The (cdiv(N, bn), split) grid of a GEMV kernel over args -> [split·M, N] of out_dtype."""
    return pl.pallas_call(
        kern,
        grid=(_cdiv(N, bn), split),
        out_shape=jax.ShapeDtypeStruct((split * M, N), out_dtype),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*args)


class Tile(NamedTuple):
    """Program (j, s) of a (cdiv(N, bn), split) GEMV grid: its output columns and K range, and the masks."""
    s: jax.Array  # K range index
    n0: jax.Array  # first output column
    kbase: jax.Array  # first K row
    mask_n: bool  # N not a multiple of bn (static)
    mask_k: bool  # the K ranges overrun K (static)
    cols: jax.Array  # [bn] output columns
    rows: jax.Array  # [Mp] x rows
    n_ok: jax.Array  # [bn]
    m_ok: jax.Array  # [Mp]


def tile(M: int, K: int, N: int, Mp: int, bn: int, bk: int, nk: int, split: int) -> Tile:
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.multiple_of(j * bn, bn) + jnp.arange(bn, dtype=jnp.int32)
    rows = jnp.arange(Mp, dtype=jnp.int32)
    return Tile(s=s, n0=pl.multiple_of(j * bn, bn), kbase=s * (nk * bk), mask_n=N % bn != 0,
                mask_k=nk * bk * split != K, cols=cols, rows=rows, n_ok=cols < N, m_ok=rows < M)


def store_tile(o_ref, acc, t: Tile, M: int, Mp: int, bn: int, split: int):
    """Store the program's [Mp, bn] result: rows s·M + m of the fp32 partials (split > 1) or of the output."""
    if Mp == M and not t.mask_n:
        if split > 1:
            o_ref[pl.ds(pl.multiple_of(t.s * M, M), M), pl.ds(t.n0, bn)] = acc.astype(o_ref.dtype)
        else:
            o_ref[:, pl.ds(t.n0, bn)] = acc.astype(o_ref.dtype)
    else:
        out_rows = t.s * M + t.rows if split > 1 else t.rows
        pltr.store(o_ref.at[out_rows[:, None], t.cols[None, :]], acc.astype(o_ref.dtype),
                   mask=t.m_ok[:, None] & t.n_ok[None, :])


def _kernel(*refs, M, K, N, Mp, bn, bk, nk, split, has_layer, has_gate, has_res, act, interpret):
    it = iter(refs)
    l_ref = next(it) if has_layer else None
    x_ref, w_ref = next(it), next(it)
    lw = (l_ref[0],) if has_layer else ()  # one layer of the stacked weight, addressed in place
    g_ref = next(it) if has_gate else None
    r_ref = next(it) if has_res else None
    o_ref = next(it)
    f32_ = jnp.float32
    tl = tile(M, K, N, Mp, bn, bk, nk, split)
    s, n0, kbase, mask_n, mask_k, cols, rows, n_ok, m_ok = tl

    def rnd(v):  # fp32 v rounded once to the activations' dtype, as fp32 (see numerics.rounded)
        if jnp.dtype(act) == jnp.float32:
            return v
        return (rounded(v, act) if interpret else v.astype(act)).astype(f32_)

    def load_w(k0):
        if not (mask_n or mask_k):
            return w_ref[(*lw, pl.ds(k0, bk), pl.ds(n0, bn))]
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        msk = (kk < K)[:, None] & n_ok[None, :]
        return pltr.load(w_ref.at[(*lw, kk[:, None], cols[None, :])], mask=msk, other=0)

    def load_rows(ref, k0, kmask):  # [Mp, bk] of an [M, K] operand; rows >= M (and k >= K) read as 0
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        if Mp == M and not kmask:
            return ref[:, pl.ds(k0, bk)]
        msk = m_ok[:, None] & (kk < K)[None, :] if kmask else jnp.broadcast_to(m_ok[:, None], (Mp, bk))
        return pltr.load(ref.at[rows[:, None], kk[None, :]], mask=msk, other=0)

    def load_x(k0):  # the dot's x tile, after the prologue
        xt = load_rows(x_ref, k0, mask_k)
        if not has_gate:
            return xt
        return rnd(xt.astype(f32_) * load_rows(g_ref, k0, mask_k).astype(f32_)).astype(xt.dtype)

    def k_at(i):
        k0 = kbase + i * bk
        return pl.multiple_of(k0, bk)

    def body(i, acc):
        k0 = k_at(i)
        return acc + jnp.dot(load_x(k0), load_w(k0), preferred_element_type=f32_)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((Mp, bn), f32_))
    if split == 1:
        acc = rnd(acc)
        if has_res:  # rounded(residual + rounded(y))
            if Mp == M and not mask_n:
                r = r_ref[:, pl.ds(n0, bn)]
            else:
                r = pltr.load(r_ref.at[rows[:, None], cols[None, :]], mask=m_ok[:, None] & n_ok[None, :],
                              other=0)
            acc = rnd(r.astype(f32_) + acc)

    store_tile(o_ref, acc, tl, M, Mp, bn, split)


@functools.partial(jax.jit, static_argnames=("reduce", "interpret", "block_n", "block_k", "split_k", "num_warps",
                                             "num_stages", "target_programs", "smem_limit"))
def dense(x, w, gate=None, residual=None, *, layer=None,
          reduce: bool = True, interpret: bool = False, block_n: int | None = None, block_k: int | None = None,
          split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
          target_programs: int = 4 * N_SM, smem_limit: int | None = None):
    """y[M, N] = x[M, K] @ w[K, N], fp32 accumulation, in x.dtype. Any leading dims of x (and of gate /
    residual, which have x's / y's shape) are flattened. gate / residual / layer: see `dense_reference` (layer:
    the kernel reads layer `layer` of the stacked w [L, K, N] in place, so that a `lax.scan` over layers passes
    the whole stack and no weight slice is copied).

    reduce=False: return the split-K partials [S, M, N] unsummed (fp32; S = 1: [1, M, N] in x's dtype, already
    rounded) for a consumer kernel that sums them (`ops.decode_row`): no XLA kernel after this one.
    block_n / block_k: powers of two; split_k: number of K ranges (fp32 partials summed after the kernel).
    block_k / num_stages are lowered where the tiles would not fit `smem_limit` (default `_common.SMEM_LIMIT`) for
    the dtypes (`fit_config`)."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    x = x.reshape(-1, K)
    M = x.shape[0]
    act = x.dtype
    assert reduce or residual is None
    K2, N = w.shape[-2:]
    assert K2 == K and w.ndim == (2 if layer is None else 3), (x.shape, w.shape, layer)
    cfg = default_config(M, K, N, block_n=block_n, block_k=block_k, target_programs=target_programs)
    cfg = fit_config(cfg, M, K, x.dtype, w.dtype, num_stages, has_gate=gate is not None, limit=smem_limit)
    bn, bk = cfg["block_n"], cfg["block_k"]
    assert is_pow2(bn) and is_pow2(bk) and bn >= 16 and bk >= 16, (bn, bk)
    nk, split, nw, ns, Mp = resolve(cfg, M, K, split_k, num_warps, None)
    out_dtype = act if split == 1 else jnp.float32
    args = [x, w] if layer is None else [jnp.asarray(layer, jnp.int32).reshape(1), x, w]
    if gate is not None:
        args.append(gate.reshape(M, K))
    if residual is not None:
        assert residual.dtype == act, (residual.dtype, act)
        residual = residual.reshape(M, N)
        if split == 1:
            args.append(residual)
    kern = functools.partial(_kernel, M=M, K=K, N=N, Mp=Mp, bn=bn, bk=bk, nk=nk, split=split,
                             has_layer=layer is not None, has_gate=gate is not None,
                             has_res=residual is not None and split == 1, act=act, interpret=interpret)
    y = launch(kern, args, M=M, N=N, bn=bn, split=split, out_dtype=out_dtype, num_warps=nw, num_stages=ns,
               interpret=interpret, name="dense_dot")
    if not reduce:
        return y.reshape(split, M, N)
    if split > 1:  # the partials in order, plain adds: one elementwise fusion with the roundings + residual
        y = sum_partials(y.reshape(split, M, N), act)
        if residual is not None:
            y = rounded(f32(residual) + f32(y), residual.dtype)
    return y.reshape(*lead, N)
