"""A projection's input RMSNorm (1 + w) over rows, as ONE Pallas-Triton kernel that writes the rows the GEMM after it
reads: whole 8-row groups (the Mosaic GPU GEMM's TMA tiles, `dense_mgpu`), the norm weight read in place from its
layer stack.

Same function as `rms_norm_rows_reference` (the model's `numerics.rms_norm_1p`, then the rows padded with zeros). In
XLA, inside the model's scan over layer groups, the same work was three kernels per projection (H100, DDTree(64)
round, 2026-12-06, 128 per round): the weight's dynamic slice (a fusion of its own: the norm's fusion takes no
dynamic slice of a loop operand), the norm and the pad to 72 rows.

Grid (rows_out,): program r normalises row r (fp32: the sum of squares over the row, rsqrt(sum / K + eps), times
(1 + w), one rounding to x's dtype) or, for r ≥ M, writes zeros. K need not be a power of two (the row is loaded
masked into the next power of two). With `layer`, w is the stack [L, K] of every layer and row `layer` is read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.numerics import rms_norm_1p, rounded
from kernels_pallas._common import SharedMemoryError, compiler_params, next_pow2, pl, pltr
from kernels_pallas._common import smem_limit as _limit

__all__ = ["rms_norm_rows", "rms_norm_rows_reference", "rows_out", "smem_bytes"]


def rows_out(M: int, rows_to: int) -> int:
    """The rows written for M input rows: M rounded up to a multiple of rows_to."""
    return -(-M // rows_to) * rows_to


def smem_bytes(num_warps: int) -> int:
    """Shared memory (bytes, an upper estimate) of a program: no tile is staged, only the sum of squares' cross-warp
    exchange."""
    return 4 * num_warps


def rms_norm_rows_reference(x, w, *, eps: float, layer=None, rows_to: int = 8, interpret: bool = False):
    """x [M, K] -> rms_norm_1p(x, w, eps) [rows_out(M, rows_to), K] in x's dtype, rows ≥ M zero. w [K], or with
    layer (an int32 scalar, traced) the stack [L, K] read at row layer."""
    del interpret
    wl = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    y = rms_norm_1p(x, wl, eps)
    return jnp.pad(y, ((0, rows_out(x.shape[0], rows_to) - x.shape[0]), (0, 0)))


def _kernel(*refs, M: int, K: int, eps: float, has_layer: bool, interpret: bool):
    if has_layer:
        lay_ref, x_ref, w_ref, o_ref = refs
        wl = (lay_ref[0],)
    else:
        x_ref, w_ref, o_ref = refs
        wl = ()
    f32 = jnp.float32
    r = pl.program_id(0)
    idx = jnp.arange(next_pow2(K), dtype=jnp.int32)
    cols = idx < K
    x = pltr.load(x_ref.at[jnp.minimum(r, M - 1), idx], mask=cols, other=0).astype(f32)
    inv = jax.lax.rsqrt(jnp.sum(x * x) / K + eps)
    w = pltr.load(w_ref.at[(*wl, idx)], mask=cols, other=0).astype(f32)
    y = (x * inv) * (1.0 + w)
    y = rounded(y, o_ref.dtype) if interpret else y  # (on the GPU the store's cast is the one rounding)
    pltr.store(o_ref.at[r, idx], jnp.where(r < M, y, 0.0).astype(o_ref.dtype), mask=cols)


@functools.partial(jax.jit, static_argnames=("eps", "rows_to", "interpret", "num_warps", "smem_limit"))
def rms_norm_rows(x, w, *, eps: float, layer=None, rows_to: int = 8, interpret: bool = False, num_warps: int = 4,
                  smem_limit: int | None = None):
    """`rms_norm_rows_reference` as one kernel (module docstring)."""
    M, K = x.shape
    assert w.shape[-1] == K and w.ndim == (1 if layer is None else 2), (x.shape, w.shape, layer)
    if smem_bytes(num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"rms_norm_rows: {smem_bytes(num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    R = rows_out(M, rows_to)
    kern = functools.partial(_kernel, M=M, K=K, eps=float(eps), has_layer=layer is not None, interpret=interpret)
    args = (x, w) if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1), x, w)
    return pl.pallas_call(
        kern,
        grid=(R,),
        out_shape=jax.ShapeDtypeStruct((R, K), x.dtype),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="rms_norm_rows",
    )(*args)
