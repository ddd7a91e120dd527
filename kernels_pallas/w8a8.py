"""W8A8 block FP8 GEMM (transformers' fine-grained FP8, `activation_scheme: "dynamic"`): the plain-jnp reference
and a Pallas-Triton kernel. y[M, N] = x[M, K] @ Wᵀ, W = w[N, K] (float8_e4m3fn, the checkpoint's nn.Linear layout)
⊙ block scales. On Hopper the projections run on `kernels_pallas/w8a8_mgpu.py` (fp8 wgmma); the Triton kernel
here runs everywhere else (other GPUs, shapes the Mosaic kernel does not take; `ops.pick`): its fp8 dots are
emulated with f16 mma.sync on sm_90 (jax 0.11.2's Pallas-Triton lowering cannot reach fp8 wgmma, see
../shared/docs/fp8_w8a8_hopper.md §2), 0.6-3 TB/s on the H200.

The function (what transformers computes for an FP8 checkpoint; kernels-community `finegrained-fp8`,
`w8a8_block_dynamic_fp8_matmul_kernel` + `fp8_act_quant_inline`, which transformers' `FP8Linear` dispatches to):
  * activation quantization, per row m and per group b of `block_in` consecutive input features (the weight's
    input block; a partial last group covers the remaining features):
        s_x[m, b] = max_k |x[m, k]| / 448                    (fp32; x upcast from its dtype)
        x_q[m, k] = e4m3(x[m, k] / max(s_x[m, b], 1e-12))    (round to nearest even, |x/s| ≤ 448)
  * weight: w [N, K] fp8 with the scale grid s_w [ceil(N / block_out), ≥ ceil(K / block_in)] (the checkpoint's
    `weight_scale_inv` orientation; columns past the input blocks are padding, see w8a8_mgpu.scale_cols): row n
    of input block b has scale s_w[n // block_out, b] (jaxddtree/model/fp8.py: the fused-parameter rule);
  * acc = Σ_b (dot(x_q[:, b], w[:, b]ᵀ) · s_x[:, b]) · s_w[n // block_out, b], the dot of one input block exact
    (products of e4m3 values are exact in fp32) and accumulated in fp32, blocks added in order;
  * y = acc rounded once to x's dtype (bf16 in the release; the output dtype of transformers' FP8Linear is the
    input's).

Triton kernel (grid (cdiv(N, BN), S, cdiv(M, BM)))
  * `act_quant` (jnp, one XLA fusion before the kernel) gives x_q fp8 and s_x fp32, zero-padded to the row tile
    and to whole input blocks, so x loads need no mask.
  * program (j, s, r) owns the BN-row stripe j of w, the s-th of S equal ranges of input blocks (split-K) and the
    BM-row tile r of x. Per input block: the fp8 x tile [BM, BK] and the fp8 weight tile [BN, BK] go into
    `jnp.dot` (fp32 accumulation), block_in / BK dots summed, then · s_x[rows, b] · s_w[row block, b] (one scalar
    when BN divides block_out, else a [BN] gather), added to the fp32 accumulator.
  * S = 1: the result is stored in x's dtype; S > 1: fp32 partials [S·M, N], summed in order and rounded by
    one small XLA fusion after the kernel (`numerics.sum_partials`).
  * masks only where a shape needs them (N not a multiple of BN; K not a multiple of block_in: the last
    block's columns ≥ K are zeroed through an int8 bitcast, Triton has no fp8 `other`).
  * `default_config`: BN 128 (64 from 128-row tiles), BK the whole input block (≤ 128), split-K doubling while
    the grid is small, as many stages as fit shared memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas._common import compiler_params, is_pow2, next_pow2, pl, pltr
from kernels_pallas.numerics import rounded, sum_partials

__all__ = ["act_quant", "w8a8", "w8a8_reference", "dequantize", "default_config", "applies", "FP8", "FP8_MAX",
           "N_SM"]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
SCALE_EPS = 1e-12  # the floor of the divisor (an all-zero group quantizes to zeros, its scale stays 0)
N_SM = 132  # H200
SMEM_BYTES = 200 * 1024  # of the 227 KB per block, with room for Triton's own buffers
MAX_ROW_TILE = 256


def _cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------------ reference
def _div(a, b):
    """a / b, correctly rounded (IEEE, as PyTorch's): XLA rewrites a division by a broadcast into a multiply by
    the reciprocal (≤ 1 ulp off, which moves e4m3 roundings); b + 0·a is the same divisor (finite a) but no
    broadcast, and stays in the same elementwise fusion."""
    return a / (b + 0 * a)


def act_quant(x, block_in: int = 128, *, rows: int | None = None):
    """x [M, K] (bf16 / fp32) -> (x_q float8_e4m3fn [rows, nb·block_in], s_x fp32 [rows, nb]), nb =
    ceil(K / block_in): transformers' dynamic per-token, per-group quantization (module docstring). `rows` ≥ M
    pads with zero rows (scale 0); the features are zero-padded to whole groups (they add nothing)."""
    M, K = x.shape
    rows = M if rows is None else rows
    nb = _cdiv(K, block_in)
    xf = jnp.pad(x.astype(jnp.float32), ((0, rows - M), (0, nb * block_in - K))).reshape(rows, nb, block_in)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    s = _div(amax, jnp.full_like(amax, FP8_MAX))
    xq = _div(xf, jnp.broadcast_to(jnp.maximum(s, SCALE_EPS)[..., None], xf.shape)).astype(FP8)
    return xq.reshape(rows, nb * block_in), s


def dequantize(w, scale, block_in: int, block_out: int, dtype=jnp.float32):
    """W [N, K] = w · s_w[n // block_out, k // block_in], fp32 product cast to dtype."""
    N, K = w.shape
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block_out, axis=0), block_in, axis=1)[:N, :K]
    return (w.astype(jnp.float32) * s).astype(dtype)


def _row_scales(scale, block_out: int, N: int, nb: int):
    """[ceil(N / block_out), ≥ nb] -> [nb, N]: each output row's scale per input block."""
    return jnp.repeat(scale[:, :nb].astype(jnp.float32), block_out, axis=0)[:N].T


def w8a8_reference(x, w, scale, *, layer=None, block_in: int = 128, block_out: int = 128):
    """y = W8A8(x, w, scale) in x's dtype (module docstring), in plain jnp: x [..., K], w fp8 [N, K], scale
    fp32 [ceil(N / block_out), ≥ ceil(K / block_in)] (or, with `layer`, an int32 scalar, one layer's weight of
    the stacked w [L, N, K] and scale [L, ...]: w[layer], scale[layer]; the kernels read it in place, no slice
    copied). The input blocks are a sequential loop (fp32 accumulator [M, N]: no [blocks, M, N] intermediate at
    prefill sizes); each block's dot runs on exactly converted bf16 operands (e4m3 ⊂ bf16) with fp32
    accumulation."""
    if layer is not None:
        w, scale = w[layer], scale[layer]
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], w.shape[0]
    nb = _cdiv(K, block_in)
    assert w.shape[1] == K and scale.shape[0] == _cdiv(N, block_out) and scale.shape[1] >= nb, (
        x.shape, w.shape, scale.shape)
    xq, sx = act_quant(x2, block_in)
    xb = xq.reshape(M, nb, block_in).transpose(1, 0, 2).astype(jnp.bfloat16)  # [nb, M, bi]
    wp = w if nb * block_in == K else jnp.pad(w, ((0, 0), (0, nb * block_in - K)))
    wb = wp.reshape(N, nb, block_in).transpose(1, 0, 2)  # [nb, N, bi]
    sw = _row_scales(scale, block_out, N, nb)  # [nb, N]

    def body(acc, blk):
        xt, wt, sxt, swt = blk
        part = jnp.einsum("mk,nk->mn", xt, wt.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return acc + (part * sxt[:, None]) * swt[None, :], None

    acc, _ = jax.lax.scan(body, jnp.zeros((M, N), jnp.float32), (xb, wb, sx.T, sw))
    return rounded(acc, x.dtype).reshape(*lead, N)


# ------------------------------------------------------------------------------------------------ configs
def row_tile(M: int) -> int:
    """Rows per program: the row count padded to a power of two ≥ 16 (the MMA tile), at most 256; longer
    passes (prefill) run several row tiles of 128."""
    return max(16, next_pow2(M)) if M <= MAX_ROW_TILE else 128


def max_block_k(block_in: int) -> int:
    """The largest power of two dividing block_in, at most 128 (the K chunk of one dot)."""
    return min(block_in & -block_in, 128)


def applies(block_in: int) -> bool:
    """Whether the kernel can run a weight with this input block: some power-of-two K chunk ≥ 16 divides it."""
    return max_block_k(block_in) >= 16


def _smem(bm, bn, bk, stages):
    return stages * (bm * bk + bk * bn)


def _split_for(nkb: int, want: int) -> int:
    """The largest divisor of nkb that is ≤ want (split-K ranges of equal whole blocks)."""
    return max(d for d in range(1, min(nkb, max(1, want)) + 1) if nkb % d == 0)


def default_config(M: int, K: int, N: int, block_in: int = 128, block_out: int = 128, *,
                   target_programs: int = 2 * N_SM) -> dict:
    """Block sizes / split-K / warps / stages for a call (the caller's arguments override each).

    Rule: BN 128 (64 from 128-row tiles: the fp32 accumulator stays ≤ 64
    registers per thread), BK the whole input block (≤ 128), split-K doubling while the grid has fewer than
    `target_programs` programs and the fp32 partials stay ≤ 1/4 of the weight bytes, 4 warps up to 32 rows
    (8 beyond), as many pipeline stages (≤ 4) as fit shared memory."""
    bm = row_tile(M)
    bn = 128 if bm <= 64 else 64
    bn = min(bn, max(16, next_pow2(N)))
    bk = max_block_k(block_in)
    nkb = _cdiv(K, block_in)
    grid = _cdiv(N, bn) * _cdiv(M, bm)
    max_split = max(1, K // (16 * M))  # split·M·N·4 ≤ K·N / 4
    want = 1
    while grid * want < target_programs and want * 2 <= min(nkb, max_split):
        want *= 2
    split = _split_for(nkb, want)
    stages = 4
    while stages > 2 and _smem(bm, bn, bk, stages) > SMEM_BYTES:
        stages -= 1
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4 if bm <= 32 else 8,
                num_stages=stages)


# ------------------------------------------------------------------------------------------------ kernel
CONFIG_KEYS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")


def _kernel(*refs, M, K, N, bm, bn, bk, block_in, block_out, nb_per, split, has_layer):
    l_ref, xq_ref, sx_ref, w_ref, sw_ref, o_ref = refs if has_layer else (None, *refs)
    lw = (l_ref[0],) if has_layer else ()  # one layer of the stacked weight and scales, addressed in place
    f32 = jnp.float32
    j, s, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0 = pl.multiple_of(j * bn, bn)
    m0 = pl.multiple_of(r * bm, bm)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ok = cols < N
    mask_n = N % bn != 0
    mask_k = K % block_in != 0  # only the last block has columns ≥ K
    sub = block_in // bk

    def load_w(k0):  # [bn, bk] fp8
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)
        if not (mask_n or mask_k):
            return w_ref[(*lw, pl.ds(n0, bn), pl.ds(k0, bk))]
        msk = n_ok[:, None] & (kk < K)[None, :]
        t = pltr.load(w_ref.at[(*lw, cols[:, None], kk[None, :])], mask=msk)
        if mask_k:  # columns past K must be 0, not stale bytes (a NaN pattern would survive x_q = 0)
            t = jax.lax.bitcast_convert_type(
                jnp.where(msk, jax.lax.bitcast_convert_type(t, jnp.int8), jnp.int8(0)), FP8)
        return t

    def load_sw(b):  # [1, 1] or [1, bn]
        if block_out % bn == 0:
            return sw_ref[(*lw, pl.ds(n0 // block_out, 1), pl.ds(b, 1))]
        idx = cols // block_out
        bb = b + jnp.zeros((1, bn), jnp.int32)
        if mask_n:
            return pltr.load(sw_ref.at[(*lw, idx[None, :], bb)], mask=n_ok[None, :], other=0.0)
        return pltr.load(sw_ref.at[(*lw, idx[None, :], bb)])

    def body(i, acc):
        b = s * nb_per + i
        part = None
        for t in range(sub):
            k0 = pl.multiple_of(b * block_in + t * bk, bk)
            xt = xq_ref[pl.ds(m0, bm), pl.ds(k0, bk)]
            d = jnp.dot(xt, load_w(k0).T, preferred_element_type=f32)
            part = d if part is None else part + d
        sx = sx_ref[pl.ds(m0, bm), pl.ds(b, 1)]  # [bm, 1]
        return acc + (part * sx) * load_sw(b)

    acc = jax.lax.fori_loop(0, nb_per, body, jnp.zeros((bm, bn), f32))
    rows = m0 + jnp.arange(bm, dtype=jnp.int32)
    out_rows = s * M + rows if split > 1 else rows
    val = acc.astype(o_ref.dtype)
    if M % bm == 0 and not mask_n:
        o_ref[pl.ds(pl.multiple_of(s * M + m0, bm) if split > 1 else m0, bm), pl.ds(n0, bn)] = val
    else:
        pltr.store(o_ref.at[out_rows[:, None], cols[None, :]], val, mask=(rows < M)[:, None] & n_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_in", "block_out", "interpret", "block_n", "block_k", "split_k",
                                             "num_warps", "num_stages", "target_programs"))
def w8a8(x, w, scale, *, layer=None, block_in: int = 128, block_out: int = 128, interpret: bool = False,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None, target_programs: int = 2 * N_SM):
    """W8A8 block FP8 y = x @ Wᵀ in x's dtype (`w8a8_reference`'s function), on the Pallas-Triton kernel. x [..., K]
    (bf16 / fp32; leading dims flattened, any row count), w fp8 [N, K], scale fp32 [ceil(N / block_out),
    ≥ ceil(K / block_in)]. layer: see `w8a8_reference` (the kernel reads layer `layer` of the stacked w [L, N, K]
    and scale [L, ...] in place, so that a `lax.scan` over layers passes the whole stacks and no weight slice is
    copied). block_n / block_k: powers of two ≥ 16, block_k dividing block_in; split_k: K ranges (rounded down to
    a divisor of the block count)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    N = w.shape[-2]
    nd = 2 if layer is None else 3
    assert w.shape[-1] == K and w.ndim == scale.ndim == nd, (x.shape, w.shape, scale.shape, layer)
    assert w.dtype == FP8 and x.dtype in (jnp.bfloat16, jnp.float32), (x.dtype, w.dtype)
    nkb = _cdiv(K, block_in)
    assert scale.shape[-2] == _cdiv(N, block_out) and scale.shape[-1] >= nkb, (scale.shape, K, N, block_in,
                                                                                 block_out)
    assert M > 0 and K > 0 and N > 0 and block_out >= 1, (x.shape, w.shape, block_out)
    assert applies(block_in), f"no power-of-two K chunk >= 16 divides block_in={block_in}"
    cfg = default_config(M, K, N, block_in, block_out, target_programs=target_programs)
    bm = cfg["block_m"]
    bn = block_n or cfg["block_n"]
    bk = block_k or cfg["block_k"]
    assert is_pow2(bn) and is_pow2(bk) and bn >= 16 and bk >= 16 and block_in % bk == 0, (bn, bk, block_in)
    split = _split_for(nkb, split_k or cfg["split_k"])
    nw, ns = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    nr = _cdiv(M, bm)
    xq, sx = act_quant(x2, block_in, rows=nr * bm)
    out_dtype = x.dtype if split == 1 else jnp.float32
    kern = functools.partial(_kernel, M=M, K=K, N=N, bm=bm, bn=bn, bk=bk, block_in=block_in, block_out=block_out,
                             nb_per=nkb // split, split=split, has_layer=layer is not None)
    args = (xq, sx, w, scale.astype(jnp.float32))
    if layer is not None:
        args = (jnp.asarray(layer, jnp.int32).reshape(1), *args)
    y = pl.pallas_call(
        kern,
        grid=(_cdiv(N, bn), split, nr),
        out_shape=jax.ShapeDtypeStruct((split * M, N), out_dtype),
        compiler_params=compiler_params(nw, ns),
        interpret=interpret,
        name="w8a8_fp8_dot",
    )(*args)
    if split > 1:
        y = sum_partials(y.reshape(split, M, N), x.dtype)
    return y.reshape(*lead, N)


def plan(M: int, K: int, N: int, block_in: int = 128, block_out: int = 128, **overrides) -> dict:
    """The resolved launch of a call (config + overrides, split rounded to a divisor): for benchmarks / logs."""
    cfg = default_config(M, K, N, block_in, block_out)
    cfg.update({k: v for k, v in overrides.items() if v is not None and k in CONFIG_KEYS})
    cfg["split_k"] = _split_for(_cdiv(K, block_in), cfg["split_k"])
    cfg["smem_bytes"] = _smem(cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["num_stages"])
    cfg["programs"] = _cdiv(N, cfg["block_n"]) * cfg["split_k"] * _cdiv(M, cfg["block_m"])
    return cfg
