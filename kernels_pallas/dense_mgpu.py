"""bf16 skinny GEMM on Hopper's wgmma (bf16 × bf16 → fp32), a Pallas Mosaic GPU kernel that reads one layer of a
stacked weight in place.

The same function as `kernels_pallas.dense.dense_reference` without gate / residual (`dense_mgpu_reference`):
y[M, N] = x[M, K] @ w[K, N], fp32 accumulation, rounded once to x's dtype (bf16). w as the model stores it
([K, N] row-major, N contiguous), or with `layer=` (an int32 scalar, traced) one layer of the stacked w [L, K, N]:
the kernel's weight copies address layer `layer` directly (issue 40: under a `lax.scan` over layers XLA copies the
dynamic slice of a stacked weight that feeds its own GEMM; here no slice is ever made).

Design ("swap AB", as `w8a8_mgpu`: the weight fills wgmma's 64-row M slot, the tokens its N slot, so 2..256 rows
cost n = 8..256, not a 64-row tile)
  * yᵀ[N, Mc] = W[K, N]ᵀ · xᵀ: a CTA owns `block_n` columns of w (a multiple of 64), a contiguous range of K
    (split-K: `split_k` ranges of whole `block_k` steps) and Mc ≤ 256 token rows (M rounded up to 8; longer
    passes run row tiles, the row tiles of one weight tile next to each other in the grid so that they share it
    through L2).
  * One warpgroup runs `plgpu.emit_pipeline` over its K steps: TMA copies of the weight tile [block_k, block_n]
    (bf16, (8, 64) tiles, 128-byte swizzle; the index map names the layer, read from a [1] int32 GMEM operand
    in the kernel) and of the token tile [Mc, block_k] into a `num_stages`-deep shared-memory ring. Per step one
    wgmma ACC[block_n, Mc] += w_sᵀ · x_sᵀ (both operands transposed views of their tiles: 16-bit wgmma reads
    either major order) into ONE fp32 accumulator that lives across the whole pipeline (no promotion: bf16
    products are exact in fp32). The wgmma is asynchronous: both BlockSpecs use `delay_release=1` and the step
    ends with `wgmma_wait(1)`, so step i's wgmma runs while the TMA refills the slot of step i - 1.
  * Epilogue: the accumulator, cast (bf16; fp32 partials [S, M, N] when split_k > 1, summed in order and rounded
    by one XLA fusion after the kernel, `numerics.sum_partials`), is stored transposed into a shared tile
    [Mc, block_n] (which reuses the ring's shared memory: the pipeline's scope has ended) and written to y by TMA
    stores of the real rows only (M split into powers of two): no padding row reaches global memory, no slice
    follows the kernel. x is passed with its rows padded to a multiple of 8 (one small XLA pad when M % 8: the
    TMA's (8, 64) tiles need whole 8-row groups in memory; none with `rows=` where the producer wrote them); the
    TMA zero-fills the rows of a tile past them and the K tail of both operands (K a multiple of 64, not of
    block_k), per dimension, so a K tail never reads the next layer.

Shapes: N a multiple of 64 (the TMA's (8, 64) tiles of w span the whole array: the 27B's fused w_in, 16480 =
257·64 + 32 columns, is refused as it is stored: pad it to 16512 or split off its 96 b|a columns), K a multiple of
64 (the tiles of x), any M ≥ 1.

`default_config(M, K, N)`: the H200 table (`CONFIGS`, "Mc{row tile}:K{K}:N{N}" -> Config) where it has the shape,
else a rule: block_k 128; block_n 128 up to 144 token rows (the fp32 accumulator is block_n·Mc/128 registers per
thread: ≤ 144), 64 beyond; the deepest ring ≤ 4 stages that fits; split-K (a divisor of the K steps leaving
≥ 4 per CTA, ≤ 16) chosen by a bytes model: the weight stream in waves of CTAs, a short last wave costing its
CTAs' own streaming time, plus the fp32 partials' write and read (`_split_cost`).

`swiglu_mgpu` (the MLP's gate|up projection, w [K, 2F]): the same GEMM with each CTA streaming block_n / 2 gate
columns and the matching up columns into two accumulators; its epilogue rounds both and writes silu(gate) · up
(`numerics.swiglu`) for every row of x, [R, F]: the down GEMM reads them with `rows=` (session 31, issue 41).

Interpret mode (CPU, `interpret=True`): the Mosaic GPU interpreter runs the same code (its wgmma is an exact fp32
dot, summed over the K steps in order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import mgpu_kernel_hash
from kernels_pallas._common import SMEM_LIMIT
from kernels_pallas.dense import dense_reference
from kernels_pallas.numerics import swiglu as swiglu_reference_ops
from kernels_pallas.swap_ab import MAX_ROW_TILE, launch, load_configs, rows_plan, store_rows, table_key
from kernels_pallas.swap_ab import cdiv, round_up, split_for

mgpu_kernel_hash.install()

__all__ = ["Config", "dense_mgpu", "dense_mgpu_reference", "swiglu_mgpu", "swiglu_mgpu_reference", "supports",
           "swiglu_supports", "default_config", "smem_bytes", "plan", "rows_plan", "table_key", "MAX_ROW_TILE",
           "CONFIGS"]

SMEM_PER_SM = 233472  # the H200's shared memory per SM (228 KiB): two CTAs of ≤ 114 KiB share one
N_SM = 132
SWIZZLE = 128  # bytes: 64 bf16, the (8, 64) tiles of both operands
_SMEM_FIXED = 1024  # Mosaic's own shared memory (barriers, alignment), an upper estimate


@dataclasses.dataclass(frozen=True)
class Config:
    """block_n: weight columns per CTA (a multiple of 64 dividing N, ≤ 256); block_k: K per pipeline step (a
    multiple of 64); split_k: K ranges (fp32 partials summed after the kernel when > 1; rounded down to a divisor
    of the step count); num_stages: the shared-memory ring's depth; row_tile: token rows per CTA (a multiple of 8,
    ≤ 256; None: all rows, padded to 8, in one tile up to 256 rows, tiles of 128 beyond)."""
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_stages: int = 4
    row_tile: int | None = None


def dense_mgpu_reference(x, w, *, layer=None, rows=None, partials: bool = False):
    """y = x @ w (or x @ w[layer]) with fp32 accumulation, in x.dtype: `dense.dense_reference` without gate /
    residual (the kernel's signature). rows: only x's first `rows` rows (x [R, K], rows ≤ R) -> [rows, N].
    partials: y as one partial, [1, ..., N] (their sum, `numerics.sum_partials`, is y)."""
    y = dense_reference(x if rows is None else x[:rows], w, layer=layer)
    return y[None] if partials else y


def supports(M: int, K: int, N: int, dtype=jnp.bfloat16, w_dtype=jnp.bfloat16) -> str | None:
    """None when the kernel takes the problem, else why not (one line)."""
    if jnp.dtype(dtype) != jnp.bfloat16 or jnp.dtype(w_dtype) != jnp.bfloat16:
        return f"dtypes x {jnp.dtype(dtype).name}, w {jnp.dtype(w_dtype).name} (the kernel's are bf16)"
    if N % 64:  # the TMA descriptor of w covers whole (8, 64) tiles of the whole array (Pallas exposes no rounding)
        return f"N = {N} not a multiple of 64"
    if K % 64:
        return f"K = {K} not a multiple of 64 (the TMA's (8, 64) tiles of x)"
    if M < 1:
        return "no rows"
    return None


def smem_bytes(Mc: int, cfg: Config, out_bytes: int) -> int:
    """Shared memory of one CTA: the larger of the ring (weight tile + token tile per stage, one barrier each) and
    the epilogue tile [Mc, block_n] (allocated after the pipeline's scope has ended), plus Mosaic's own."""
    ring = cfg.num_stages * (2 * cfg.block_k * cfg.block_n + 2 * Mc * cfg.block_k + 8)
    return max(ring, Mc * cfg.block_n * out_bytes) + _SMEM_FIXED


# "Mc{row tile}:K{K}:N{N}" -> Config: the H200 sweep's winners (benchmarks/bench_gemv.py --scan-mgpu --mgpu-sweep --table-out)
CONFIGS: dict = load_configs("dense_mgpu_configs.json", Config)


def _fits(cfg: Config, M: int, K: int, N: int) -> bool:
    Mc, _ = rows_plan(M, cfg.row_tile)
    return (cfg.block_n % 64 == 0 and cfg.block_n <= 256 and N % cfg.block_n == 0 and cfg.block_k % 64 == 0
            and smem_bytes(Mc, cfg, 4) <= SMEM_LIMIT)


SM_SHARE = 1.5  # a guess until measured: one SM streams at most SM_SHARE × its fair share (HBM / 132) of the weight


def _split_cost(M: int, K: int, N: int, tiles: int, split: int, per_sm: int) -> float:
    """Bytes model of one call at split-K `split` (in HBM-bandwidth bytes): waves of 132 SMs × `per_sm` CTAs; a
    wave streams its CTAs' weight bytes at the HBM bandwidth, but no faster than one CTA at SM_SHARE × an SM's
    share (a last wave of few CTAs costs their streaming time, not a whole wave); plus the fp32 partials
    written and read back by the sum."""
    ctas = tiles * split
    slots = N_SM * per_sm
    cta_bytes = K * N * 2 / ctas
    floor = cta_bytes * N_SM / SM_SHARE  # one CTA alone, in HBM-bandwidth bytes
    full, rem = divmod(ctas, slots)
    t = full * max(slots * cta_bytes, floor) + (max(rem * cta_bytes, floor) if rem else 0)
    return t + (2 * split * M * N * 4 if split > 1 else 0)


def default_config(M: int, K: int, N: int) -> Config:
    """The sweep's winner for (row tile, K, N) (`CONFIGS`) where it fits this call, else the rule (module
    docstring)."""
    c = CONFIGS.get(table_key(M, K, N))
    if c is not None and _fits(c, M, K, N):
        return c
    Mc, nr = rows_plan(M)
    bn = 128 if Mc <= 144 else 64
    while N % bn:
        bn //= 2
    bk = 128
    nsteps = cdiv(K, bk)
    st = 4
    while st > 2 and smem_bytes(Mc, Config(bn, bk, 1, st), 4) > SMEM_LIMIT:
        st -= 1
    per_sm = max(1, SMEM_PER_SM // smem_bytes(Mc, Config(bn, bk, 1, st), 4))
    tiles = (N // bn) * nr
    cands = sorted({split_for(nsteps, s) for s in range(1, min(16, nsteps // 4) + 1)} | {1})
    split = min(cands, key=lambda s: (_split_cost(M, K, N, tiles, s, per_sm), s))
    return Config(block_n=bn, block_k=bk, split_k=split, num_stages=st)


def plan(M: int, K: int, N: int, config: Config | None = None) -> dict:
    """The resolved launch of a call (for benchmarks / logs)."""
    cfg = config or default_config(M, K, N)
    Mc, nr = rows_plan(M, cfg.row_tile)
    nsteps = cdiv(K, cfg.block_k)
    split = split_for(nsteps, cfg.split_k)
    stages = max(1, min(cfg.num_stages, nsteps // split))
    return dict(block_n=cfg.block_n, block_k=cfg.block_k, split_k=split, num_stages=stages, Mc=Mc, row_tiles=nr,
                ctas=(N // cfg.block_n) * split * nr,
                smem=smem_bytes(Mc, dataclasses.replace(cfg, num_stages=stages), 4 if split > 1 else 2))


def _dense_wgmma(*refs, M: int, Mc: int, nr: int, bn: int, bk: int, n_per: int, split: int, stages: int,
                 has_layer: bool, out_dtype):
    if has_layer:
        l_ref, x_ref, w_ref, o_ref = refs
        lw = (l_ref[0],)  # the layer of the stacked weight, addressed in place by the weight's index map
    else:
        x_ref, w_ref, o_ref = refs
        lw = ()
    j = lax.axis_index("n")  # weight column tile
    s = lax.axis_index("s")  # split
    r = lax.axis_index("r")  # token row tile
    k0 = s * n_per
    tr = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    delay = 1 if stages > 1 else 0
    in_specs = [
        plgpu.BlockSpec((*(None,) * len(lw), bk, bn), lambda k: (*lw, k0 + k, j), transforms=tr,
                        delay_release=delay),
        plgpu.BlockSpec((Mc, bk), lambda k: (r, k0 + k), transforms=tr, delay_release=delay),
    ]

    def compute(acc):
        def step(_, w_s, x_s):
            plgpu.wgmma(acc, w_s.T, x_s.T)  # ACC[bn, Mc] += w_tileᵀ[bn, bk] · x_tileᵀ[bk, Mc]
            plgpu.wgmma_wait(delay)  # the previous step's wgmma done: its slot may be refilled

        plgpu.emit_pipeline(step, grid=(n_per,), in_specs=in_specs, max_concurrent_steps=stages)(w_ref, x_ref)
        return acc[...]

    y = pl.run_scoped(compute, plgpu.ACC((bn, Mc), jnp.float32)).astype(out_dtype)
    dst = o_ref if split == 1 else o_ref.at[s]

    store_rows(y, dst, j=j, r=r, bn=bn, M=M, Mc=Mc, nr=nr)


@functools.partial(jax.jit, static_argnames=("rows", "interpret", "config", "partials"))
def dense_mgpu(x, w, *, layer=None, rows=None, partials: bool = False, interpret=False,
               config: Config | None = None):
    """y = x @ w (or x @ w[layer], read in place) in x's dtype on bf16 wgmma (module docstring). x [..., K] bf16,
    w [K, N] bf16, or w [L, K, N] with layer an int32 scalar (traced). rows: x is [R, K] and only its first `rows`
    rows are the problem's -> [rows, N]; with R = rows rounded up to 8 (a producer that wrote whole 8-row groups,
    e.g. `rms_norm.rms_norm_rows`) no pad runs before the kernel (the rows past `rows` are never stored).
    partials: the split-K partial sums unsummed, [S, rows, N] (fp32; S = 1: y itself, [1, rows, N]), for a consumer
    that adds them up in order (`rms_norm.add_rms_norm_rows`): y = `numerics.sum_partials(parts, x.dtype)`."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if rows is not None:
        assert x.ndim == 2 and 0 < rows <= x2.shape[0], (x.shape, rows)
        lead = (rows,)
        x2 = x2[:round_up(rows, 8)]  # (a no-op slice when R is rows rounded up to 8)
    M = x2.shape[0] if rows is None else rows
    N = w.shape[-1]
    assert w.shape[-2] == K and w.ndim == (2 if layer is None else 3), (x.shape, w.shape, layer)
    why = supports(M, K, N, x.dtype, w.dtype)
    if why:
        raise ValueError(f"dense_mgpu: {why}")
    cfg = config or default_config(M, K, N)
    bn, bk = cfg.block_n, cfg.block_k
    if bn % 64 or bn > 256 or N % bn or bk % 64:
        raise ValueError(f"dense_mgpu: block_n {bn} must be a multiple of 64 (≤ 256) dividing N {N}, block_k "
                         f"{bk} a multiple of 64")
    Mc, nr = rows_plan(M, cfg.row_tile)
    nsteps = cdiv(K, bk)
    split = split_for(nsteps, cfg.split_k)
    n_per = nsteps // split
    stages = max(1, min(cfg.num_stages, n_per))
    out_dtype = x.dtype if split == 1 else jnp.float32
    need = smem_bytes(Mc, dataclasses.replace(cfg, num_stages=stages), jnp.dtype(out_dtype).itemsize)
    if need > SMEM_LIMIT:
        raise ValueError(f"dense_mgpu: {cfg} needs {need} bytes of shared memory > {SMEM_LIMIT}")
    kern = functools.partial(_dense_wgmma, M=M, Mc=Mc, nr=nr, bn=bn, bk=bk, n_per=n_per, split=split,
                             stages=stages, has_layer=layer is not None, out_dtype=out_dtype)
    if x2.shape[0] % 8:  # the TMA's (8, 64) tiles need whole 8-row groups of x in memory; rows past them are
        x2 = jnp.pad(x2, ((0, round_up(M, 8) - M), (0, 0)))  # zero-filled
    args = (x2, w) if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1), x2, w)
    y = launch(kern, args, M=M, N=N, bn=bn, nr=nr, split=split, out_dtype=x.dtype, interpret=interpret,
               partials=partials)
    return y.reshape(*y.shape[:-2], *lead, N)


# ------------------------------------------------------------------ the MLP's gate|up GEMM with its SwiGLU epilogue
SWIGLU_MAX_ROWS = 144  # two fp32 accumulators [64, Mc]: Mc registers per thread (the dense rule's bound)


def swiglu_mgpu_reference(x, w, *, layer=None):
    """h = swiglu(y[:, :F], y[:, F:]) with y = x @ w (or x @ w[layer]) rounded to x's dtype, F = w's columns / 2
    (the MLP's fused gate | up weight; `numerics.swiglu`: silu in fp32 rounded, the product rounded): x [R, K],
    w [K, 2F] or [L, K, 2F] -> [R, F], every row of x (a caller whose rows past its own are zero gets zeros)."""
    y = dense_reference(x, w, layer=layer)
    F = y.shape[-1] // 2
    return swiglu_reference_ops(y[..., :F], y[..., F:], x.dtype)


def swiglu_supports(R: int, K: int, N: int) -> str | None:
    """None when `swiglu_mgpu` runs the SwiGLU in its epilogue for x [R, K] and w [K, N], else why not (then it
    computes the same as dense_mgpu followed by XLA's SwiGLU)."""
    why = supports(R, K, N)
    if why:
        return why
    if R % 8 or R > SWIGLU_MAX_ROWS:
        return f"{R} rows (the epilogue takes whole 8-row groups up to {SWIGLU_MAX_ROWS})"
    if (N // 2) % 64:
        return f"F = {N // 2} not a multiple of 64"
    return None


def swiglu_config(R: int, K: int, N: int) -> Config:
    """The dense GEMM's config for (R, K, N) with each CTA's block_n columns split between gate and up (64 each at
    least), its ring made shallower where two weight tiles per step do not fit."""
    cfg = default_config(R, K, N)
    bh = max(64, cfg.block_n // 2)
    while (N // 2) % bh:
        bh //= 2
    cfg = dataclasses.replace(cfg, block_n=2 * bh)
    while cfg.num_stages > 2 and _swiglu_smem(R, cfg) > SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def _swiglu_smem(Mc: int, cfg: Config) -> int:
    """Shared memory of one CTA of the SwiGLU GEMM: block_n weight columns (gate and up halves) and the token tile
    per stage, or the epilogue tile [Mc, block_n / 2]."""
    return smem_bytes(Mc, cfg, 2)


def _swiglu_wgmma(*refs, Mc: int, bh: int, bk: int, n_per: int, stages: int, up: int, has_layer: bool,
                  out_dtype):
    if has_layer:
        l_ref, x_ref, w_ref, o_ref = refs
        lw = (l_ref[0],)
    else:
        x_ref, w_ref, o_ref = refs
        lw = ()
    j = lax.axis_index("n")  # gate column tile j, up column tile j + up
    tr = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    delay = 1 if stages > 1 else 0
    in_specs = [
        plgpu.BlockSpec((*(None,) * len(lw), bk, bh), lambda k: (*lw, k, j), transforms=tr, delay_release=delay),
        plgpu.BlockSpec((*(None,) * len(lw), bk, bh), lambda k: (*lw, k, j + up), transforms=tr,
                        delay_release=delay),
        plgpu.BlockSpec((Mc, bk), lambda k: (0, k), transforms=tr, delay_release=delay),
    ]

    def compute(acc_g, acc_u):
        def step(_, g_s, u_s, x_s):
            plgpu.wgmma(acc_g, g_s.T, x_s.T)  # ACC[bh, Mc] += w_gateᵀ · xᵀ
            plgpu.wgmma(acc_u, u_s.T, x_s.T)  # ACC[bh, Mc] += w_upᵀ · xᵀ
            plgpu.wgmma_wait(2 * delay)  # (one commit group per wgmma) the previous step's done: its slots refill

        plgpu.emit_pipeline(step, grid=(n_per,), in_specs=in_specs, max_concurrent_steps=stages)(w_ref, w_ref,
                                                                                                 x_ref)
        return acc_g[...], acc_u[...]

    g, u = pl.run_scoped(compute, plgpu.ACC((bh, Mc), jnp.float32), plgpu.ACC((bh, Mc), jnp.float32))
    f32 = jnp.float32
    g = g.astype(out_dtype).astype(f32)  # the projection's rounding, then numerics.swiglu
    act = (g / (1.0 + jnp.exp(-g))).astype(out_dtype).astype(f32)
    h = (act * u.astype(out_dtype).astype(f32)).astype(out_dtype)
    store_rows(h, o_ref, j=j, r=0, bn=bh, M=Mc, Mc=Mc, nr=1)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def swiglu_mgpu(x, w, *, layer=None, interpret=False, config: Config | None = None):
    """`swiglu_mgpu_reference` on bf16 wgmma: x [R, K] bf16 (R a multiple of 8, e.g. `rms_norm.rms_norm_rows`'
    rows; every row is computed and written), w [K, 2F] or the stack [L, K, 2F] with layer an int32 scalar (read
    in place) -> [R, F]. Each CTA streams block_n / 2 gate columns and the matching up columns (two weight
    copies and two accumulators per K step), rounds both and writes silu(gate) · up: the MLP's down GEMM
    (`dense_mgpu(h, w_down, rows=M)`) reads the rows as they are (no SwiGLU, pad or slice between the GEMMs).
    Where the epilogue does not apply (`swiglu_supports`; a split-K config) dense_mgpu runs and XLA's SwiGLU
    follows: the same values."""
    R, K = x.shape
    N = w.shape[-1]
    F = N // 2
    cfg = config or swiglu_config(R, K, N)
    nsteps = cdiv(K, cfg.block_k)
    if swiglu_supports(R, K, N) or split_for(nsteps, cfg.split_k) > 1:
        y = dense_mgpu(x, w, layer=layer, interpret=interpret, config=config)
        return swiglu_reference_ops(y[:, :F], y[:, F:], x.dtype)
    bh, bk = cfg.block_n // 2, cfg.block_k
    if bh % 64 or F % bh or bk % 64:
        raise ValueError(f"swiglu_mgpu: block_n {cfg.block_n} must be twice a multiple of 64 dividing F {F}, "
                         f"block_k {bk} a multiple of 64")
    stages = max(1, min(cfg.num_stages, nsteps))
    need = _swiglu_smem(R, dataclasses.replace(cfg, num_stages=stages))
    if need > SMEM_LIMIT:
        raise ValueError(f"swiglu_mgpu: {cfg} needs {need} bytes of shared memory > {SMEM_LIMIT}")
    kern = functools.partial(_swiglu_wgmma, Mc=R, bh=bh, bk=bk, n_per=nsteps, stages=stages, up=F // bh,
                             has_layer=layer is not None, out_dtype=x.dtype)
    args = (x, w) if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1), x, w)
    return launch(kern, args, M=R, N=F, bn=bh, nr=1, split=1, out_dtype=x.dtype, interpret=interpret)
