"""W8A8 block FP8 projection on Hopper's fp8 tensor cores (wgmma e4m3 × e4m3 → fp32), a Pallas Mosaic GPU kernel.

The same function as `kernels_pallas.w8a8.w8a8_reference` (transformers' fine-grained FP8 with dynamic per-token
activation quantization): y[M, N] = Σ_b (x_q[:, b] · w_q[:, b]ᵀ · s_x[:, b]) · s_w[n // block_out, b], one fp32
sum per 128-wide input block b, blocks added in order, rounded once to x's dtype. Arguments as the reference:
x [..., K] (bf16 / fp32), w [N, K] float8_e4m3fn (the checkpoint's nn.Linear layout: K-major, what fp8 wgmma
reads), scale fp32 [ceil(N / block_out), ceil(K / block_in)] (the checkpoint's `weight_scale_inv` grid).

Design ("swap AB": the weight fills wgmma's 64-row M slot, the tokens its N slot, so 1..136 rows cost n = 8..136,
not a 64-row tile)
  * yᵀ[N, Mc] = W[N, K] · x_qᵀ: a CTA owns `block_n` weight rows (a multiple of 64, dividing block_out so that
    one weight scale covers its rows in a block) and a contiguous range of input blocks (split-K: `split_k`
    ranges of whole blocks), and Mc ≤ 256 token rows (a multiple of 8; longer passes run row tiles, the row tiles
    of one weight tile next to each other in the grid so that they share it through L2).
  * One warpgroup runs `plgpu.emit_pipeline` over its blocks: TMA copies of the weight tile [block_n, 128] and
    the token tile [Mc, 128] (both fp8, 128-byte swizzle: one swizzle atom = one scale block) and of the block's
    activation scales s_x [1, Mc] into a `num_stages`-deep shared-memory ring. Per block: the wgmmas of its
    128-deep K into a fresh fp32 accumulator (`pl.run_scoped` ACC), then on the CUDA cores the promotion
    run += (part · s_x[b, cols]) · s_w[b] (the reference's product order) into the running fp32 sum (the
    pipeline's carry, in registers). The weight scales of the CTA's row block are copied into shared memory
    once, before the pipeline (one TMA of the whole scale row).
  * Epilogue: the running sum, cast (x's dtype; fp32 partials [S, M, N] when split_k > 1, summed in order and
    rounded by one XLA fusion after the kernel, `numerics.sum_partials`), is stored transposed into a shared
    tile [Mc, block_n] and written to y by TMA stores of the real rows only (M split into powers of two), so no
    padding row reaches global memory and no slice follows the kernel.
  * Activation quantization (`w8a8.act_quant`, one XLA fusion) writes x_q [Mp, Kp] (rows padded to the row tile,
    features to whole blocks) and s_xᵀ [nb, Mp]. The K tail of w (K not a multiple of 128) is zero-filled by
    the TMA.
  * `layer` (a `lax.scan` over stacked layers): w and scale are the whole stacks [L, N, K] / [L, Nb, C]; the
    kernel reads the int32 layer from GMEM and its TMA copies (weight tiles, the scale row) address that layer,
    so no weight slice is copied before the kernel (XLA copies a dynamic slice that feeds a custom call).

Interpret mode (CPU, `interpret=True`): the Mosaic GPU interpreter runs the same code (its wgmma is an exact fp32
dot; on the GPU the fp8 tensor cores accumulate one block's products with reduced precision, as transformers'
own Triton kernel does on Hopper — so the GPU agrees with the reference to the last bits of the fp32 sums).
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
from kernels_pallas.swap_ab import MAX_ROW_TILE, launch, load_configs, rows_plan, store_rows, table_key
from kernels_pallas.swap_ab import cdiv, round_up, split_for

mgpu_kernel_hash.install()

__all__ = ["Config", "w8a8_mgpu", "supports", "default_config", "smem_bytes", "plan", "table_key", "pad_scale",
           "scale_cols", "BLOCK_IN", "MAX_ROW_TILE", "CONFIGS"]

FP8 = jnp.float8_e4m3fn
BLOCK_IN = 128  # the kernel's input block: one 128-byte swizzle atom of fp8 (the checkpoints' block)
SMEM_LIMIT = 232448  # the H200's opt-in shared memory per block (227 KiB)
N_SM = 132


@dataclasses.dataclass(frozen=True)
class Config:
    """block_n: weight rows per CTA (64 / 128 / 256, dividing block_out and N); split_k: input-block ranges
    (fp32 partials summed after the kernel when > 1; rounded to a divisor of the block count); num_stages: the
    shared-memory ring's depth; row_tile: token rows per CTA (a multiple of 8, ≤ 256; None: all rows, padded
    to 8, in one tile up to 256); k_per_step: input blocks per pipeline step (one TMA copy of each operand and
    one barrier per step carry k_per_step · 128 of K; their wgmmas run into separate accumulators, promoted in
    block order; rounded down to a divisor of the CTA's block count)."""
    block_n: int = 128
    split_k: int = 1
    num_stages: int = 6
    row_tile: int | None = None
    k_per_step: int = 1


def supports(M: int, K: int, N: int, block_in: int, block_out: int) -> str | None:
    """None when the kernel takes the problem, else why not (one line)."""
    if block_in != BLOCK_IN:
        return f"input block {block_in} (the kernel's is {BLOCK_IN})"
    if block_out % 64:
        return f"output block {block_out} not a multiple of 64"
    if N % 64:
        return f"N = {N} not a multiple of 64"
    if K % 16:
        return f"K = {K} not a multiple of 16 (TMA row stride)"
    if M < 1:
        return "no rows"
    return None


def smem_bytes(Mc: int, cfg: Config, nbp: int, out_bytes: int) -> int:
    """Shared memory of one CTA: the ring (weight tile, token tile, activation-scale row per stage), the
    weight-scale row, the epilogue tile, barriers."""
    ring = cfg.num_stages * cfg.k_per_step * (cfg.block_n * BLOCK_IN + Mc * BLOCK_IN + 4 * sx_width(Mc))
    return ring + round_up(nbp * 4, 128) + Mc * cfg.block_n * out_bytes + 1024 + 16 * cfg.num_stages


# "Mc{row tile}:K{K}:N{N}" -> Config: the H200 sweep's winners (benchmarks/bench_gemv_fp8.py --table-out)
CONFIGS: dict = load_configs("w8a8_mgpu_configs.json", Config)


def default_config(M: int, K: int, N: int, block_out: int = 128) -> Config:
    """The sweep's winner for (row tile, K, N) (`CONFIGS`) where it fits this call, else a rule: block_n 128 up
    to 64 token rows (64 beyond: two fp32 [block_n, Mc] register tiles per thread), split-K until the grid has
    ≥ 1.5 waves of 132 CTAs, 4 stages (fewer where 2 CTAs per SM would not fit)."""
    c = CONFIGS.get(table_key(M, K, N))
    if c is not None and block_out % c.block_n == 0 and N % c.block_n == 0:
        return c
    Mc, nr = rows_plan(M)
    bn = 128 if Mc <= 64 else 64
    while bn > 64 and (block_out % bn or N % bn):
        bn //= 2
    nkb = cdiv(K, BLOCK_IN)
    tiles = (N // bn) * nr
    want = 1
    while tiles * want < 1.5 * N_SM and want * 2 <= nkb // 4:
        want *= 2
    split = split_for(nkb, want)
    out_bytes = 4
    nbp = scale_cols(nkb)
    st = 4  # the H200 sweep (2026-12-03): 4 stages beat 5-12 at 65 rows (more CTAs per SM), tied at 1
    while st > 2 and 2 * smem_bytes(Mc, Config(bn, split, st), nbp, out_bytes) > SMEM_LIMIT:
        st -= 1
    return Config(block_n=bn, split_k=split, num_stages=st)


def plan(M: int, K: int, N: int, block_out: int = 128, config: Config | None = None) -> dict:
    """The resolved launch of a call (for benchmarks / logs)."""
    cfg = config or default_config(M, K, N, block_out)
    Mc, nr = rows_plan(M, cfg.row_tile)
    nkb = cdiv(K, BLOCK_IN)
    split = split_for(nkb, cfg.split_k)
    return dict(block_n=cfg.block_n, split_k=split, num_stages=cfg.num_stages, Mc=Mc, row_tiles=nr,
                k_per_step=split_for(nkb // split, cfg.k_per_step),
                ctas=(N // cfg.block_n) * split * nr,
                smem=smem_bytes(Mc, cfg, scale_cols(nkb), 4 if split > 1 else 2))


def _w8a8_fp8_wgmma(*refs, M: int, Mc: int, nr: int, bn: int, nb_per: int, kb: int, split: int, stages: int,
                    block_out: int, out_dtype, has_layer: bool):
    l_ref, xq_ref, sxt_ref, w_ref, sw_ref, o_ref, sw_smem, sw_bar = refs if has_layer else (None, *refs)
    lw = (l_ref[0],) if has_layer else ()  # one layer of the stacked weight and scales, addressed in place (GMEM)
    f32 = jnp.float32
    j = lax.axis_index("n")  # weight row tile
    s = lax.axis_index("s")  # split
    r = lax.axis_index("r")  # token row tile
    k0 = s * nb_per
    tr = (plgpu.TilingTransform((8, BLOCK_IN)), plgpu.SwizzleTransform(128))

    # this CTA's weight scales (one row of the scale grid) into SMEM, once
    plgpu.copy_gmem_to_smem(sw_ref.at[(*lw, pl.ds(lax.div(j * bn, jnp.int32(block_out)), 1))], sw_smem, sw_bar)
    plgpu.barrier_wait(sw_bar)

    in_specs = [
        plgpu.BlockSpec((None,) * len(lw) + (bn, BLOCK_IN), lambda k: (*lw, j, k0 + k), transforms=tr),
        plgpu.BlockSpec((Mc, BLOCK_IN), lambda k: (r, k0 + k), transforms=tr),
        plgpu.BlockSpec((1, sx_width(Mc)), lambda k: (k0 + k, r)),
    ]
    col_l = plgpu.Layout.WGMMA.reduce(0)

    def step(idx, w_s, x_s, sx_s, run):
        (k,) = idx

        def mm(acc):
            plgpu.wgmma(acc, w_s, x_s.T)
            return acc[...]

        part = pl.run_scoped(mm, plgpu.ACC((bn, Mc), f32))
        sx = plgpu.load(sx_s.at[0, pl.ds(0, Mc)], layout=col_l)
        sw = sw_smem[0, k0 + k]
        sx = plgpu.layout_cast(lax.broadcast_in_dim(sx, (bn, Mc), (1,)), plgpu.Layout.WGMMA)
        return run + (part * sx) * sw

    run0 = plgpu.layout_cast(jnp.zeros((bn, Mc), f32), plgpu.Layout.WGMMA)
    run = plgpu.emit_pipeline(step, grid=(nb_per,), in_specs=in_specs, max_concurrent_steps=stages,
                              init_carry=run0)(w_ref, xq_ref, sxt_ref)

    dst = o_ref if split == 1 else o_ref.at[s]
    y = run.astype(out_dtype)

    store_rows(y, dst, j=j, r=r, bn=bn, M=M, Mc=Mc, nr=nr)


SCALE_ALIGN = 32  # scale-row floats per 128 bytes: a TMA copy into shared memory moves a multiple of 128 bytes


def scale_cols(nkb: int) -> int:
    """Columns of a weight-scale grid as the kernel reads it: the input blocks, padded to 128-byte rows."""
    return round_up(nkb, SCALE_ALIGN)


def pad_scale(scale):
    """scale [..., Nb, ≥ nb] fp32 -> [..., Nb, scale_cols(...)] (zero columns appended; none, and no copy, when
    already padded, as the model stores its FP8 weights: a stacked scale [L, Nb, C] is then read in place)."""
    sw = scale.astype(jnp.float32)
    cols = round_up(sw.shape[-1], SCALE_ALIGN)
    return sw if cols == sw.shape[-1] else jnp.pad(sw, ((0, 0),) * (sw.ndim - 1) + ((0, cols - sw.shape[-1]),))


def sx_width(Mc: int) -> int:
    """Floats per row tile in the transposed activation scales: Mc padded to 128 bytes (a TMA copy's unit)."""
    return round_up(Mc, SCALE_ALIGN)


def act_quant_t(x, Mc: int, nr: int):
    """x [M, K] -> (x_q fp8 [nr·Mc, nb·128], s_xᵀ fp32 [nb, nr·W]): `w8a8.act_quant` (rows zero-padded to nr
    tiles of Mc), its scales transposed, row tile r's at columns [r·W, r·W + Mc) (W = `sx_width(Mc)`); one XLA
    fusion."""
    from kernels_pallas.w8a8 import act_quant
    xq, sx = act_quant(x, BLOCK_IN, rows=nr * Mc)
    nb = sx.shape[1]
    W = sx_width(Mc)
    sx = jnp.pad(sx.reshape(nr, Mc, nb), ((0, 0), (0, W - Mc), (0, 0)))
    return xq, sx.transpose(2, 0, 1).reshape(nb, nr * W)


@functools.partial(jax.jit, static_argnames=("block_in", "block_out", "interpret", "config"))
def w8a8_mgpu(x, w, scale, *, layer=None, block_in: int = 128, block_out: int = 128, interpret=False,
              config: Config | None = None):
    """W8A8 block FP8 y = x @ Wᵀ in x's dtype on fp8 wgmma (module docstring). x [..., K] bf16 / fp32,
    w [N, K] float8_e4m3fn, scale fp32 [ceil(N / block_out), ≥ ceil(K / block_in)]. layer (an int32 scalar):
    y = x @ W[layer]ᵀ of the stacked w [L, N, K] and scale [L, ...], read in place (the scalar from GMEM; the
    weight tiles' TMA copies and the scale row's address layer `layer`), so that a `lax.scan` over layers passes
    the whole stacks and no weight slice is copied (scale columns already padded to `scale_cols`, as the model
    stores them, else `pad_scale` copies the stack)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    N = w.shape[-2]
    nd = 2 if layer is None else 3
    assert w.shape[-1] == K and w.dtype == FP8 and w.ndim == scale.ndim == nd, (x.shape, w.shape, w.dtype,
                                                                                 scale.shape, layer)
    assert x.dtype in (jnp.bfloat16, jnp.float32), x.dtype
    nkb = cdiv(K, block_in)
    assert scale.shape[-2] == cdiv(N, block_out) and scale.shape[-1] >= nkb, (scale.shape, N, K, block_in,
                                                                                 block_out)
    why = supports(M, K, N, block_in, block_out)
    if why:
        raise ValueError(f"w8a8_mgpu: {why}")
    cfg = config or default_config(M, K, N, block_out)
    bn = cfg.block_n
    if bn % 64 or bn > 256 or block_out % bn or N % bn:
        raise ValueError(f"w8a8_mgpu: block_n {bn} must be a multiple of 64 (≤ 256) dividing block_out "
                         f"{block_out} and N {N}")
    Mc, nr = rows_plan(M, cfg.row_tile)
    split = split_for(nkb, cfg.split_k)
    nb_per = nkb // split
    kb = split_for(nb_per, cfg.k_per_step)
    stages = max(1, min(cfg.num_stages, nb_per // kb))
    out_dtype = x.dtype if split == 1 else jnp.float32
    sw = pad_scale(scale)
    nbp = sw.shape[-1]
    xq, sxt = act_quant_t(x2, Mc, nr)
    need = smem_bytes(Mc, dataclasses.replace(cfg, num_stages=stages, k_per_step=kb), nbp,
                      jnp.dtype(out_dtype).itemsize)
    if need > SMEM_LIMIT:
        raise ValueError(f"w8a8_mgpu: {cfg} needs {need} bytes of shared memory > {SMEM_LIMIT}")
    kern = functools.partial(_w8a8_fp8_wgmma, M=M, Mc=Mc, nr=nr, bn=bn, nb_per=nb_per, kb=kb, split=split,
                             stages=stages, block_out=block_out, out_dtype=out_dtype, has_layer=layer is not None)
    args = (xq, sxt, w, sw)
    if layer is not None:
        args = (jnp.asarray(layer, jnp.int32).reshape(1), *args)
    y = launch(kern, args, M=M, N=N, bn=bn, nr=nr, split=split, out_dtype=x.dtype, interpret=interpret,
               scratch_types=[plgpu.SMEM((1, nbp), jnp.float32), plgpu.Barrier()])
    return y.reshape(*lead, N)
