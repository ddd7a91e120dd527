"""The epilogue the swap-AB Mosaic GPU GEMMs share (w8a8_mgpu.py, dense_mgpu.py): a CTA's transposed result
yᵀ [block_n, Mc] (the WGMMA layout) written to its output columns as [Mc, block_n] through shared memory, by TMA
stores of the real token rows only."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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
