"""What the swap-AB Mosaic GPU GEMMs share (w8a8_mgpu.py, dense_mgpu.py: the weight tile as wgmma's M rows, the
tokens as its N): the token rows' plan (Mc rows per CTA, row tiles), split-K divisors, and the epilogue — a CTA's
transposed result yᵀ [block_n, Mc] (the WGMMA layout) written to its output columns as [Mc, block_n] through shared
memory, by TMA stores of the real token rows only."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.numerics import sum_partials


MAX_ROW_TILE = 256  # wgmma n ≤ 256


def load_configs(name: str, config_cls) -> dict:
    """A kernel's config table kernels_pallas/<name> (the H200 sweep's winners), keyed `table_key`: {key: config}."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {key: config_cls(**c) for key, c in json.load(f).get("configs", {}).items()}


def table_key(M: int, K: int, N: int) -> str:
    """A config table's key: "Mc{the row tile}:K{K}:N{N}"."""
    return f"Mc{rows_plan(M)[0]}:K{K}:N{N}"


def cdiv(a, b):
    return -(-a // b)


def round_up(a, b):
    return cdiv(a, b) * b


def split_for(n: int, want: int) -> int:
    """The largest divisor of n that is ≤ want."""
    return max(d for d in range(1, min(n, max(1, want)) + 1) if n % d == 0)


def rows_plan(M: int, row_tile: int | None = None) -> tuple[int, int]:
    """(Mc, number of row tiles): Mc token rows per CTA (a multiple of 8; all M rows in one tile up to MAX_ROW_TILE,
    tiles of 128 beyond, unless `row_tile` says)."""
    if row_tile is None:
        if M <= MAX_ROW_TILE:
            return round_up(M, 8), 1
        row_tile = 128
    assert row_tile % 8 == 0 and 8 <= row_tile <= MAX_ROW_TILE, row_tile
    return row_tile, cdiv(M, row_tile)


def launch(kern, args, *, M: int, N: int, bn: int, nr: int, split: int, out_dtype, interpret, scratch_types=(),
           partials: bool = False):
    """kern over the (row tiles, N / bn, split) grid ("r", "n", "s") -> [M, N] in `out_dtype`, or with split > 1 the
    fp32 partials [split, M, N] summed in order and rounded to `out_dtype`'s activations (`sum_partials`; out_dtype
    is then the activations' dtype). partials: unsummed, [split, M, N] (fp32; split = 1: [1, M, N] in out_dtype)."""
    y = plgpu.kernel(
        kern,
        out_type=jax.ShapeDtypeStruct((M, N) if split == 1 else (split, M, N),
                                      out_dtype if split == 1 else jnp.float32),
        scratch_types=list(scratch_types),
        grid=(nr, N // bn, split),
        grid_names=("r", "n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )(*args)
    if partials:
        return y[None] if split == 1 else y
    return y if split == 1 else sum_partials(y, out_dtype)


def pow2_chunks(n: int) -> list[tuple[int, int]]:
    """[(offset, size)] covering [0, n) with decreasing powers of two (the TMA stores of n real rows)."""
    out, off = [], 0
    for b in reversed(range(n.bit_length())):
        if n >> b & 1:
            out.append((off, 1 << b))
            off += 1 << b
    return out


def store_rows(y, dst, *, j, r, bn: int, M: int, Mc: int, nr: int) -> None:
    """y [bn, Mc] (fp32 / bf16, WGMMA layout; its dtype is dst's) -> dst[rows of row tile r, columns j·bn ..]: the
    M real rows of nr row tiles of Mc (the last tile's real rows M - (nr - 1)·Mc), in a scoped [Mc, bn] buffer."""

    def epilogue(o_smem):
        o_smem.T[...] = plgpu.layout_cast(y, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        cols = pl.ds(j * bn, bn)
        if nr == 1:
            for off, size in pow2_chunks(M):
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(off, size)], dst.at[pl.ds(off, size), cols])
        else:
            last = M - (nr - 1) * Mc

            @pl.when(r < nr - 1)
            def _full():
                plgpu.copy_smem_to_gmem(o_smem, dst.at[pl.ds(r * Mc, Mc), cols])

            @pl.when(r == nr - 1)
            def _last():
                for off, size in pow2_chunks(last):
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(off, size)],
                                            dst.at[pl.ds((nr - 1) * Mc + off, size), cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((Mc, bn), y.dtype))
