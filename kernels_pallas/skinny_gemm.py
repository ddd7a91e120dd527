"""Skinny GEMM for 16 < M ≤ 256 (up to 512) rows on Hopper: y[M, N] = x[M, K] @ w[K, N], a Pallas Mosaic GPU kernel.

For the tree verify (17/33/65/129/257 nodes), the chain verify (16) and small prefill chunks, where the
time is the time to stream w ([K, N] row-major, as the model stores it) from HBM once. bf16 in, fp32
accumulation on the tensor cores, bf16 out (one rounding of the fp32 sum). `skinny_gemm_reference` is the
same function in plain jnp.

Design ("swap AB": the weight is the wgmma A operand, so M is the cheap dimension)
  * y^T[N, M] = w^T[N, K] @ x^T[K, M]. A wgmma is m64·nX·k16 with m a multiple of 64 and n any multiple of 8
    up to 256: with w^T as A, a CTA's `block_n` columns of w fill the 64-row side and the M rows of x only
    round up to a multiple of 8 (65 -> 72, not 128), so the tensor-core work stays ≪ the weight stream. Both
    operands are read from SMEM as stored: the w tile [block_k, block_n] (N contiguous) is A transposed
    (MN-major, allowed for 16-bit types), the x tile [Mc, block_k] (K contiguous) is B transposed.
  * grid (cdiv(N, block_n), split_k): CTA (j, s) owns the block_n-column stripe j of w and the s-th of
    split_k contiguous K ranges. One warpgroup runs `plgpu.emit_pipeline` over the range in block_k-row steps:
    TMA copies of the w tile and the x tile(s) into a `stages`-deep SMEM ring (mbarrier per slot), one
    async wgmma per step into the fp32 accumulator in registers (`wgmma_wait(1)`: the previous step's
    wgmma has finished before its slot is refilled, `delay_release=1`).
  * warp_specialized=True (`plgpu.emit_pipeline_warp_specialized`, as jax's hopper_matmul_mgpu): a producer
    warpgroup issues the TMA copies, `wgs` compute warpgroups each own block_n columns of a wgs·block_n CTA
    stripe (sharing the x tiles: less x per w byte), and `cluster` CTAs along N receive the x tiles by TMA
    multicast (x read from L2 once per cluster). grid (cdiv(stripes, cluster), split_k) clusters.
  * x is re-read from L2 by every CTA: Mp/(CTA columns) bytes per w byte (0.28 at M = 65 with 256 columns,
    1.1 at M = 129 with 128), which is why the CTA stripe is as wide as the registers allow.
  * M > 256 (a wgmma's n ≤ 256): the rows are cut into m_chunks equal chunks of Mc ≤ 256 rows, one
    accumulator and one wgmma per chunk per step; w is still read once. At M ≈ 257 the tensor cores, not the
    weight stream, set the floor (2·M·K·N flops at ~790 TFLOP/s > K·N·2 bytes at 4.5 TB/s).
  * Epilogue: the accumulator [block_n, Mc] is cast (bf16, or fp32 partials when split_k > 1), relaid out to
    the transposed WGMMA layout (one shuffle), stored transposed into an SMEM tile [Mc, block_n] and written to
    y[rows, cols] by one TMA store (clipped by the hardware at N). split_k > 1: fp32 partials [S, Mp, N]
    summed (+ cast, + the row slice) by one XLA fusion after the kernel. epilogue="yT" (fallback): the kernel
    writes y^T [N, Mp] from an SMEM tile as laid out, and XLA transposes.
  * Shapes: K % 8 == 0, N % 16 == 0 (TMA tiling of w's rows; the swizzle is the widest that N allows: 128 B
    when N % 64 == 0, else 64 B / 32 B), M ≤ 512. x is padded (rows to Mp = m_chunks·Mc, columns to the
    swizzle span) by a tiny XLA pad (which XLA can fuse into x's producer in a model); w is never copied: the K
    and N tails of both come from the TMA's zero fill.
  * `config=SkinnyConfig(backend="triton", ...)` runs the Pallas-Triton kernel of kernels_pallas.dense
    instead (the fallback; dense kwargs in `triton`), so one benchmark compares both.

`default_config(M, K, N)` is a first guess (not yet measured on the H200: benchmarks/bench_skinny.py sweeps
the alternatives); `supports(M, K, N)` says whether the Mosaic kernel takes a shape.

Status (2026-11-30): exact vs the reference in the Mosaic GPU interpreter (tests/kernels/test_skinny_gemm.py) and
lowers for CUDA against an abstract H200 at every 27B shape; NOT yet compiled (ptxas) or run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["SkinnyConfig", "skinny_gemm", "skinny_gemm_reference", "default_config", "supports", "candidates",
           "estimate_cost", "best_split", "max_stages", "smem_bytes", "widest_swizzle", "N_SM", "SMEM_BYTES",
           "MAX_ROWS"]

N_SM = 132  # H200
SMEM_BYTES = 232448  # per block on the H200 (sm_90: 227 KiB)
MAX_ROWS = 512
_MAX_CHUNK = 256  # wgmma n ≤ 256
_ACC_ELEMS = 128 * 144  # fp32 accumulator elements per warpgroup (≤ 144 registers per thread)


def skinny_gemm_reference(x, w, config=None):
    """y = x @ w with fp32 accumulation, rounded once to x.dtype. x [..., K], w [K, N]."""
    del config
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """block_n: columns of w per warpgroup (multiple of 64: the wgmma m side; ≤ 256: one TMA box);
    block_k: rows of w per pipeline step (multiple of 16 and of swizzle/2); stages: SMEM ring depth
    (max_concurrent_steps); split_k: K ranges (fp32 partials summed by XLA when > 1); swizzle: bytes
    (128/64/32) or None = the widest N allows; backend: "mosaic" or "triton" (kernels_pallas.dense with
    the kwargs in `triton`). warp_specialized: one producer warpgroup + `wgs` compute warpgroups (each its own
    block_n columns of a wgs·block_n CTA stripe, sharing the x tiles), and `cluster` CTAs along N that
    multicast the x tiles (x is read from L2 once per cluster instead of once per CTA). epilogue "yT": the
    accumulator goes to SMEM as laid out and the kernel writes y^T [N, Mp]; the transpose back is one XLA fusion
    (with split-K's reduce) — the fallback if the in-kernel transposed store ("t") misbehaves on a GPU."""
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    split_k: int = 1
    swizzle: int | None = None
    backend: str = "mosaic"
    warp_specialized: bool = False  # a producer warpgroup issues the TMA copies (emit_pipeline_warp_specialized)
    wgs: int = 1  # compute warpgroups per CTA (warp_specialized only): CTA columns = wgs * block_n
    cluster: int = 1  # CTAs per cluster along N sharing (multicasting) the x tiles (warp_specialized only)
    epilogue: str = "t"  # "t": y [M, N] stored transposed by the kernel; "yT": the kernel writes y^T, XLA transposes
    triton: tuple = ()  # (("block_n", 128), ...) for backend="triton"

    def replace(self, **kw) -> "SkinnyConfig":
        return dataclasses.replace(self, **kw)


def _cdiv(a, b):
    return -(-a // b)


def _round_up(a, b):
    return _cdiv(a, b) * b


def _rows(M: int, cluster: int = 1):
    """(m_chunks, Mc): M rows as m_chunks equal chunks of Mc ≤ 256 rows, Mc a multiple of 8 (of 8·cluster with a
    cluster: a multicast TMA copy is split between the CTAs along the x tile's rows of 8)."""
    chunks = _cdiv(M, _MAX_CHUNK)
    return chunks, _round_up(_cdiv(M, chunks), 8 * cluster)


def widest_swizzle(N: int) -> int | None:
    for sw in (128, 64, 32):
        if N % (sw // 2) == 0:
            return sw
    return None


def supports(M: int, K: int, N: int) -> bool:
    """Shapes the Mosaic kernel takes (bf16): K % 8 == 0, N % 16 == 0, 1 ≤ M ≤ 512."""
    return 1 <= M <= MAX_ROWS and K % 8 == 0 and K >= 16 and N % 16 == 0 and N >= 64


def _k_plan(K: int, bk: int, split: int):
    """(split, steps per split, padded K): split ranges of `steps` block_k steps each cover K."""
    nkb = _cdiv(K, bk)
    split = max(1, min(split, nkb))
    steps = _cdiv(nkb, split)
    split = _cdiv(nkb, steps)  # no split with an empty range
    return split, steps, split * steps * bk


def smem_bytes(M: int, cfg: SkinnyConfig, out_bytes: int = 2) -> int:
    """SMEM of one CTA. Plain pipeline: the ring (w tile + x tiles per stage) or the epilogue tile, whichever is
    larger (sequential scopes). Warp-specialized: the ring plus one [Mc, 64] epilogue tile per compute warpgroup."""
    chunks, Mc = _rows(M, cfg.cluster if cfg.warp_specialized else 1)
    wgs = cfg.wgs if cfg.warp_specialized else 1
    ring = cfg.stages * cfg.block_k * (wgs * cfg.block_n + chunks * Mc) * 2
    if cfg.warp_specialized:
        return ring + wgs * Mc * 64 * out_bytes + 1024
    return max(ring, Mc * cfg.block_n * out_bytes) + 1024


def max_stages(M: int, cfg: SkinnyConfig, ctas_per_sm: int = 1, out_bytes: int = 4) -> int:
    """The deepest ring (≤ 12 stages) with which `ctas_per_sm` CTAs of cfg fit in one SM's SMEM."""
    st = 2
    while st < 12 and ctas_per_sm * smem_bytes(M, cfg.replace(stages=st + 1), out_bytes) <= SMEM_BYTES:
        st += 1
    return st


def estimate_cost(M: int, K: int, N: int, cfg: SkinnyConfig) -> float:
    """A rough relative time of the Mosaic kernel (lower is better; a model, NOT a measurement, only used to
    rank the candidates of `default_config`). Bytes: w once, x re-read from L2 by every CTA (weighted 0.3,
    ÷ cluster with multicast), fp32 partials written + read back when split (+ the reduce kernel's launch).
    Rate: CTAs run in waves of `slots` (CTAs per SM by SMEM × 132); an active SM pulls its fair share of HBM
    bandwidth when ≥ 96 KiB of w are in flight on it, proportionally less below, at most 2.5x its share."""
    cl = cfg.cluster if cfg.warp_specialized else 1
    wgs = cfg.wgs if cfg.warp_specialized else 1
    chunks, Mc = _rows(M, cl)
    Mp = chunks * Mc
    cbn = wgs * cfg.block_n
    split, steps, _ = _k_plan(K, cfg.block_k, cfg.split_k)
    W = K * N * 2
    n_cta = _cdiv(N, cbn) * split
    per_cta = W * (1 + 0.3 * Mp / (cbn * cl)) / n_cta
    out_bytes = 4 if split > 1 else 2
    occ = max(1, SMEM_BYTES // smem_bytes(M, cfg, out_bytes))
    slots = occ * N_SM
    stage_w = max(min(cfg.stages, steps) - 1, 0.5) * cfg.block_k * cbn * 2
    t, left = 0.0, n_cta
    while left > 0:
        wave = min(left, slots)
        left -= wave
        active = min(N_SM, wave)
        rate = active / N_SM * min(2.5, (wave / active) * stage_w / (96 << 10))
        t += wave * per_cta / min(1.0, rate)
    t += Mp * N * out_bytes  # the kernel's output
    if split > 1:
        t += split * Mp * N * 4 + M * N * 2 + 2e6
    # tensor cores: m64·n(Mc)·k16 wgmmas at ~600 TFLOP/s, in bytes at 4.5 TB/s (M ≈ 257 is compute-bound)
    t_tc = 2 * Mp * K * _round_up(N, cbn) / 600e12 * 4.5e12
    return max(t, t_tc)


def best_split(M: int, K: int, N: int, cfg: SkinnyConfig, splits=(1, 2, 3, 4, 6, 8)) -> SkinnyConfig:
    """cfg with the split_k of the lowest `estimate_cost` (≥ 4 block_k steps per split; ring still fits)."""
    best, best_cost = cfg.replace(split_k=1), estimate_cost(M, K, N, cfg.replace(split_k=1))
    for split in splits[1:]:
        if split * 4 > _cdiv(K, cfg.block_k):
            continue
        c = cfg.replace(split_k=split)
        if smem_bytes(M, c, 4) > SMEM_BYTES:
            continue
        cost = estimate_cost(M, K, N, c)
        if cost < best_cost * 0.98:  # prefer fewer splits on a near tie
            best, best_cost = c, cost
    return best


def candidates(M: int, K: int, N: int, warp_specialized: bool = False) -> list[SkinnyConfig]:
    """Plain-pipeline (or warp-specialized) configs worth trying: block_n by the register budget, a ring as deep
    as fits 1 or 2 CTAs per SM (1 when warp-specialized), the best split for each; warp-specialized tries
    (wgs, cluster) in (1, 2), (1, 4), (2, 1), (2, 2)."""
    sw = widest_swizzle(N) or 128
    bk = max(64, sw // 2)
    out = []
    for wgs, cl in ([(1, 1)] if not warp_specialized else [(1, 2), (1, 4), (2, 1), (2, 2)]):
        chunks, Mc = _rows(M, cl)
        Mp = chunks * Mc
        for bn in (256, 128, 64):
            if (bn * Mp > _ACC_ELEMS and bn > 64) or bn % (sw // 2) or wgs * bn > 256:
                continue
            if bn > 64 and wgs * bn > _round_up(N, 64):
                continue
            # warp-specialized: setmaxnreg hands the register file to one CTA, so one CTA per SM
            for occ in ((1, 2) if not warp_specialized else (1,)):
                base = SkinnyConfig(block_n=bn, block_k=bk, stages=2, warp_specialized=warp_specialized,
                                    wgs=wgs, cluster=cl)
                st = max_stages(M, base, occ, out_bytes=2)
                cfg = base.replace(stages=st)
                if occ * smem_bytes(M, cfg) > SMEM_BYTES:
                    continue
                cfg = best_split(M, K, N, cfg)
                if occ * smem_bytes(M, cfg, 4 if cfg.split_k > 1 else 2) > SMEM_BYTES:
                    cfg = cfg.replace(split_k=1)
                if cfg not in out:
                    out.append(cfg)
    return out


def default_config(M: int, K: int, N: int) -> SkinnyConfig:
    """First guess, NOT yet measured on the H200 (benchmarks/bench_skinny.py sweeps the alternatives): of the
    plain-pipeline `candidates` (block_n 64/128/256 whose fp32 accumulator fits ≤ 144 registers per thread,
    block_k 64 or the swizzle span, a ring as deep as fits 1 or 2 CTAs per SM, split-K 1-8), the one with the
    lowest `estimate_cost`."""
    cands = candidates(M, K, N)
    if not cands:
        sw = widest_swizzle(N) or 128
        return SkinnyConfig(block_n=64, block_k=max(64, sw // 2), stages=2)
    return min(cands, key=lambda c: estimate_cost(M, K, N, c))


def _check(M, K, N, cfg: SkinnyConfig):
    if not supports(M, K, N):
        raise ValueError(f"skinny_gemm (mosaic): unsupported shape M={M} K={K} N={N} "
                         f"(need 1 <= M <= {MAX_ROWS}, K % 8 == 0, N % 16 == 0)")
    sw = cfg.swizzle or widest_swizzle(N)
    swe = sw // 2  # bf16 elements per swizzle span
    bn, bk = cfg.block_n, cfg.block_k
    if N % swe:
        raise ValueError(f"swizzle {sw} needs N % {swe} == 0 (N={N})")
    if bn % 64 or bn > 256 or bn % swe:
        raise ValueError(f"block_n={bn}: a multiple of 64 (and of {swe}), at most 256")
    if bk % 16 or bk % swe:
        raise ValueError(f"block_k={bk}: a multiple of 16 and of {swe}")
    if not cfg.warp_specialized and (cfg.wgs != 1 or cfg.cluster != 1):
        raise ValueError("wgs > 1 and cluster > 1 need warp_specialized=True")
    if cfg.wgs not in (1, 2, 3) or cfg.cluster not in (1, 2, 4):
        raise ValueError(f"wgs={cfg.wgs} (1..3), cluster={cfg.cluster} (1, 2, 4)")
    if cfg.epilogue not in ("t", "yT"):
        raise ValueError(f"epilogue={cfg.epilogue!r}: 't' or 'yT'")
    if cfg.wgs * bn > 256:
        raise ValueError(f"wgs * block_n = {cfg.wgs * bn} > 256 (one TMA box per w tile)")
    return sw, swe


def _mosaic(x, w, cfg: SkinnyConfig, interpret: bool):
    M, K = x.shape
    N = w.shape[1]
    sw, swe = _check(M, K, N, cfg)
    bn, bk = cfg.block_n, cfg.block_k
    ws = cfg.warp_specialized
    wgs = cfg.wgs if ws else 1
    cl = cfg.cluster if ws else 1
    cbn = wgs * bn  # columns per CTA
    chunks, Mc = _rows(M, cl)
    Mp = chunks * Mc
    split, steps, _ = _k_plan(K, bk, cfg.split_k)
    stages = max(1, min(cfg.stages, steps))
    delay = 1 if stages > 1 else 0  # a single-step range: no ring, wait for the wgmma at once
    nn = _cdiv(N, cbn)
    ncl = _cdiv(nn, cl)  # clusters along N (a CTA past the last stripe reads zeros and stores nothing)
    out_dtype = x.dtype if split == 1 else jnp.float32
    need = smem_bytes(M, cfg.replace(stages=stages), jnp.dtype(out_dtype).itemsize)
    if need > SMEM_BYTES:
        raise ValueError(f"config {cfg} needs {need} bytes of SMEM > {SMEM_BYTES}")
    # x's rows to Mp and columns to the swizzle span (TMA tiling); the K tail of the last split is zero-filled
    # by the TMA like w's (no copy of w, and no x copy at all when M % 8 == 0)
    Kx = _round_up(K, swe)
    xp = jnp.pad(x, ((0, Mp - M), (0, Kx - K))) if (Mp, Kx) != (M, K) else x
    tr = (plgpu.TilingTransform((8, swe)), plgpu.SwizzleTransform(sw))
    f32 = jnp.float32

    def specs(j, k0):
        w_spec = plgpu.BlockSpec((bk, cbn), lambda k: (k0 + k, j), transforms=tr, delay_release=delay)
        x_specs = [plgpu.BlockSpec((Mc, bk), functools.partial(lambda c, k: (c, k0 + k), c), transforms=tr,
                                   delay_release=delay, collective_axes=("cluster",) if cl > 1 else ())
                   for c in range(chunks)]
        return [w_spec, *x_specs]

    yT = cfg.epilogue == "yT"

    def store_tile(o_smem, y, dst, rows, cols):
        """y [cols, Mc] (WGMMA layout, out dtype) -> o_smem [Mc, cols] transposed (or [cols, Mc] as is, "yT")
        -> dst[rows, cols] (or dst[cols, rows]) by one TMA store."""
        if yT:
            o_smem[...] = y
            dst = dst.at[cols, rows]
        else:
            o_smem.T[...] = plgpu.layout_cast(y, plgpu.Layout.WGMMA_TRANSPOSED)
            dst = dst.at[rows, cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, dst)

    def body(x_gmem, w_gmem, o_gmem):
        j = lax.axis_index("n")
        s = lax.axis_index("s")
        k0 = s * steps
        dst = o_gmem if split == 1 else o_gmem.at[s]

        def run(*accs):
            def step(_, w_smem, *x_smems):
                for acc, xs in zip(accs, x_smems):
                    plgpu.wgmma(acc, w_smem.T, xs.T)
                plgpu.wgmma_wait(delay)

            plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs(j, k0),
                                max_concurrent_steps=stages)(w_gmem, *([x_gmem] * chunks))
            return tuple(a[...] for a in accs)

        accs = pl.run_scoped(run, *[plgpu.ACC((bn, Mc), f32) for _ in range(chunks)])
        if not isinstance(accs, (tuple, list)):
            accs = (accs,)

        def epilogue(o_smem):
            for c, acc in enumerate(accs):
                if c:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                store_tile(o_smem, acc.astype(out_dtype), dst, pl.ds(c * Mc, Mc), pl.ds(j * bn, bn))
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(epilogue, plgpu.SMEM((bn, Mc) if yT else (Mc, bn), out_dtype))

    def body_ws(x_gmem, w_gmem, o_gmem):
        j = lax.axis_index("n") * cl + (lax.axis_index("cluster") if cl > 1 else 0)
        s = lax.axis_index("s")
        wg = lax.axis_index("wg")
        k0 = s * steps
        dst = o_gmem if split == 1 else o_gmem.at[s]

        def pipeline(step_fn, ctx):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn, grid=(steps,), memory_registers=40, in_specs=specs(j, k0), wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=ctx)

        ignore = lambda *_, **__: None  # noqa: E731

        def scope(allocs, o_smem):
            def step(_, w_smem, *rest):
                *x_smems, accs = rest
                w_wg = w_smem.at[:, pl.ds(wg * bn, bn)] if wgs > 1 else w_smem
                for acc, xs in zip(accs, x_smems):
                    plgpu.wgmma(acc, w_wg.T, xs.T)
                plgpu.wgmma_wait(delay)
                return accs

            def compute_context(eval_pipeline):
                def acc_scope(*accs):
                    eval_pipeline(tuple(accs))
                    col0 = j * cbn + wg * bn
                    first = True
                    for c, acc_ref in enumerate(accs):
                        acc = acc_ref[...].astype(out_dtype)
                        for t in range(bn // 64):
                            if not first:
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            first = False
                            store_tile(o_smem.at[wg], acc[t * 64:(t + 1) * 64], dst,
                                       pl.ds(c * Mc, Mc), pl.ds(col0 + t * 64, 64))
                    plgpu.wait_smem_to_gmem(0)

                pl.run_scoped(acc_scope, *[plgpu.ACC((bn, Mc), f32) for _ in range(chunks)])

            pipeline(step, compute_context)(w_gmem, *([x_gmem] * chunks), allocations=allocs)

        pl.run_scoped(scope, allocs=pipeline(ignore, ignore).get_allocations(w_gmem, *([x_gmem] * chunks)),
                      o_smem=plgpu.SMEM((wgs, 64, Mc) if yT else (wgs, Mc, 64), out_dtype), collective_axes="wg")

    out_shape = (N, Mp) if yT else (Mp, N)
    out_shape = out_shape if split == 1 else (split, *out_shape)
    kw = dict(grid=(nn, split), grid_names=("n", "s"))
    if ws:
        kw = dict(grid=(ncl, split), grid_names=("n", "s"), num_threads=wgs + 1, thread_name="wg")
        if cl > 1:
            kw.update(cluster=(cl,), cluster_names=("cluster",))
    f = plgpu.kernel(
        body_ws if ws else body,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **kw,
    )
    y = f(xp, w)
    if split > 1:
        y = y.sum(0)
    if yT:
        y = y.T
    return y[:M].astype(x.dtype)


def _triton(x, w, cfg: SkinnyConfig, interpret: bool):
    from kernels_pallas import dense
    return dense.dense(x, w, interpret=interpret, **dict(cfg.triton))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def skinny_gemm(x, w, config: SkinnyConfig | None = None, *, interpret: bool = False):
    """y[..., N] = x[..., K] @ w[K, N], fp32 accumulation, one rounding to x.dtype (bf16). Leading dims of x
    are flattened into M (≤ 512 rows). config: None = default_config(M, K, N)."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    K2, N = w.shape
    if K2 != K:
        raise ValueError(f"shapes {x.shape} @ {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"bf16 operands only (got {x.dtype}, {w.dtype})")
    cfg = config or default_config(M, K, N)
    if cfg.backend == "triton":
        y = _triton(x2, w, cfg, interpret)
    elif cfg.backend == "mosaic":
        y = _mosaic(x2, w, cfg, interpret)
    else:
        raise ValueError(f"unknown backend {cfg.backend!r}")
    return y.reshape(*lead, N)
