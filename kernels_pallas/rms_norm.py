"""A projection's input norm over rows, as ONE Pallas-Triton kernel that writes the rows the GEMM after it reads:
whole 8-row groups (the Mosaic GPU GEMM's TMA tiles, `dense_mgpu`), the norm weight read in place from its layer
stack. Two norms:

  * `rms_norm_rows`: the layers' input / post-attention RMSNorm (1 + w) (`numerics.rms_norm_1p`);
  * `gated_rms_norm_rows`: the GDN mixer's gated RMSNorm over each head's E values before its out projection
    (`gdn_reference.gated_rms_norm` of the core's output rounded to the activations' dtype);
  * `add_rms_norm_rows`: the residual add of the GEMM before it (its split-K partials summed in order and rounded,
    added to the residual stream and rounded, as `numerics.sum_partials` and `ops.dense`'s residual) and then the
    RMSNorm of the sum: it writes both the new residual stream and the normed rows (the add was an XLA fusion of
    its own between the two kernels, issue 41).

Same functions as `rms_norm_rows_reference` / `gated_rms_norm_rows_reference` (the model's ops, then the rows padded
with zeros). In XLA, inside the model's scan over layer groups, the same work was three kernels per projection (H100,
DDTree(64) round, 2026-12-06): the weight's dynamic slice (a fusion of its own: the norm's fusion takes no dynamic
slice of a loop operand), the norm and the pad to 72 rows.

rms_norm_rows: grid (rows_out,): program r normalises row r (fp32: the sum of squares over the row, rsqrt(sum / K +
eps), times (1 + w), one rounding to x's dtype) or, for r ≥ M, writes zeros. K need not be a power of two (the row is
loaded masked into the next power of two). gated_rms_norm_rows: grid (rows_out, H), program (r, h) one head's E
values (E a power of two). With `layer`, w is the stack [L, ...] of every layer and row `layer` is read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gated_rms_norm
from kernels_pallas.numerics import f32, rms_norm_1p, rounded, sum_partials
from kernels_pallas._common import SharedMemoryError, compiler_params, is_pow2, next_pow2, pl, pltr
from kernels_pallas._common import smem_limit as _limit
from kernels_pallas.swap_ab import round_up

__all__ = ["rms_norm_rows", "rms_norm_rows_reference", "gated_rms_norm_rows", "gated_rms_norm_rows_reference",
           "add_rms_norm_rows", "add_rms_norm_rows_reference", "rows_out", "smem_bytes"]


rows_out = round_up  # rows_out(M, rows_to): the rows written for M input rows


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


def _operands(layer, *arrays) -> tuple:
    """A call's operands: with a layer, a [1] int32 array of it first (read by `_layer_of`)."""
    return arrays if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1), *arrays)


def _layer_of(refs, has_layer: bool) -> tuple[tuple, tuple]:
    """(the index prefix of a stacked weight: (layer,) or (), the other refs)."""
    return ((refs[0][0],), refs[1:]) if has_layer else ((), refs)


def _kernel(*refs, M: int, K: int, eps: float, has_layer: bool, interpret: bool):
    wl, (x_ref, w_ref, o_ref) = _layer_of(refs, has_layer)
    f32 = jnp.float32
    r = pl.program_id(0)
    idx = jnp.arange(next_pow2(K), dtype=jnp.int32)
    cols = idx < K
    x = pltr.load(x_ref.at[jnp.minimum(r, M - 1), idx], mask=cols, other=0).astype(f32)
    _store_normed(x, w_ref, wl, o_ref, r, idx, cols, M=M, K=K, eps=eps, interpret=interpret)


def _store_normed(x, w_ref, wl, o_ref, r, idx, cols, *, M: int, K: int, eps: float, interpret: bool):
    """Row r of o: rms_norm_1p of the fp32 row x (its K columns `cols` of idx) with w (layer prefix wl), zeros for
    r ≥ M; one rounding to o's dtype."""
    inv = jax.lax.rsqrt(jnp.sum(x * x) / K + eps)
    w = pltr.load(w_ref.at[(*wl, idx)], mask=cols, other=0).astype(jnp.float32)
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
    return pl.pallas_call(
        kern,
        grid=(R,),
        out_shape=jax.ShapeDtypeStruct((R, K), x.dtype),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="rms_norm_rows",
    )(*_operands(layer, x, w))


def gated_rms_norm_rows_reference(x, z, w, *, eps: float, layer=None, rows_to: int = 8, z_offset: int = 0,
                                  interpret: bool = False):
    """x [M, H·E] (the GDN core's output, any float dtype) rounded to z's dtype, then per head of E values
    `gated_rms_norm(x, z, w, eps)` -> [rows_out(M, rows_to), H·E] in z's dtype, rows ≥ M zero. z [M, H·E], or with
    z_offset the wider rows [M, ≥ z_offset + H·E] whose columns from z_offset on are z (the GDN's fused input
    projection, read in place: no slice of it before the kernel); w [E], or with layer (an int32 scalar, traced) the
    stack [L, E] read at row layer."""
    del interpret
    M, C = x.shape
    E = w.shape[-1]
    z = z[:, z_offset:z_offset + C]
    wl = w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    xr = rounded(x, z.dtype).reshape(M, C // E, E)
    y = gated_rms_norm(xr, z.reshape(M, C // E, E), wl, eps).reshape(M, C)
    return jnp.pad(y, ((0, rows_out(M, rows_to) - M), (0, 0)))


def _gated_kernel(*refs, M: int, E: int, eps: float, has_layer: bool, wprod, z_offset: int, interpret: bool):
    wl, (x_ref, z_ref, w_ref, o_ref) = _layer_of(refs, has_layer)
    f32, act = jnp.float32, o_ref.dtype
    r, h = pl.program_id(0), pl.program_id(1)

    def rnd(v, dt):  # fp32 v rounded once to dt, as fp32
        if jnp.dtype(dt) == jnp.float32:
            return v
        return rounded(v, dt).astype(f32) if interpret else v.astype(dt).astype(f32)

    row = jnp.minimum(r, M - 1)
    idx = h * E + jnp.arange(E, dtype=jnp.int32)
    x = rnd(pltr.load(x_ref.at[row, idx]).astype(f32), act)
    z = pltr.load(z_ref.at[row, z_offset + idx]).astype(f32)
    w = pltr.load(w_ref.at[(*wl, jnp.arange(E, dtype=jnp.int32))]).astype(f32)
    inv = jax.lax.rsqrt(jnp.sum(x * x) / E + eps)
    y = rnd(x * inv, act)
    y = rnd(w * y, wprod)
    y = rnd(y * (z / (1.0 + jnp.exp(-z))), act)
    pltr.store(o_ref.at[r, idx], jnp.where(r < M, y, 0.0).astype(act))


@functools.partial(jax.jit, static_argnames=("eps", "rows_to", "z_offset", "interpret", "num_warps", "smem_limit"))
def gated_rms_norm_rows(x, z, w, *, eps: float, layer=None, rows_to: int = 8, z_offset: int = 0,
                        interpret: bool = False, num_warps: int = 4, smem_limit: int | None = None):
    """`gated_rms_norm_rows_reference` as one kernel (module docstring)."""
    M, C = x.shape
    E = w.shape[-1]
    assert z.shape[0] == M and z.shape[1] >= z_offset + C and C % E == 0 and is_pow2(E), (x.shape, z.shape, w.shape,
                                                                                          z_offset)
    assert w.ndim == (1 if layer is None else 2), (w.shape, layer)
    if smem_bytes(num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"gated_rms_norm_rows: {smem_bytes(num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    R = rows_out(M, rows_to)
    kern = functools.partial(_gated_kernel, M=M, E=E, eps=float(eps), has_layer=layer is not None,
                             wprod=jnp.promote_types(w.dtype, z.dtype), z_offset=z_offset, interpret=interpret)
    return pl.pallas_call(
        kern,
        grid=(R, C // E),
        out_shape=jax.ShapeDtypeStruct((R, C), z.dtype),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="gated_rms_norm_rows",
    )(*_operands(layer, x, z, w))


def add_rms_norm_rows_reference(parts, base, w, *, eps: float, layer=None, rows_to: int = 8,
                                interpret: bool = False):
    """parts [S, M, K] (a GEMM's split-K partial sums, fp32, or S = 1 rows already in base's dtype), base [M, K] (the
    residual stream) -> (x, normed): x = rounded(base + sum_partials(parts)) [M, K] in base's dtype, the new residual
    stream, and normed = `rms_norm_rows_reference(x, w, ...)` [rows_out(M, rows_to), K] (rows ≥ M zero)."""
    del interpret
    x = rounded(f32(base) + f32(sum_partials(parts, base.dtype)), base.dtype)
    return x, rms_norm_rows_reference(x, w, eps=eps, layer=layer, rows_to=rows_to)


def _add_kernel(*refs, M: int, K: int, S: int, eps: float, has_layer: bool, interpret: bool):
    wl, (p_ref, b_ref, w_ref, x_ref, o_ref) = _layer_of(refs, has_layer)
    f32_, act = jnp.float32, x_ref.dtype

    def rnd(v):  # fp32 v rounded once to the activations' dtype, as fp32
        return rounded(v, act).astype(f32_) if interpret else v.astype(act).astype(f32_)

    r = pl.program_id(0)
    row = jnp.minimum(r, M - 1)
    idx = jnp.arange(next_pow2(K), dtype=jnp.int32)
    cols = idx < K
    acc = pltr.load(p_ref.at[0, row, idx], mask=cols, other=0).astype(f32_)
    for s in range(1, S):  # the partials in order (`numerics.sum_partials`)
        acc = acc + pltr.load(p_ref.at[s, row, idx], mask=cols, other=0).astype(f32_)
    x = rnd(pltr.load(b_ref.at[row, idx], mask=cols, other=0).astype(f32_) + rnd(acc))
    pltr.store(x_ref.at[row, idx], x.astype(act), mask=cols & (r < M))
    _store_normed(x, w_ref, wl, o_ref, r, idx, cols, M=M, K=K, eps=eps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "rows_to", "interpret", "num_warps", "smem_limit"))
def add_rms_norm_rows(parts, base, w, *, eps: float, layer=None, rows_to: int = 8, interpret: bool = False,
                      num_warps: int = 4, smem_limit: int | None = None):
    """`add_rms_norm_rows_reference` as one kernel (module docstring): grid (rows_out,), program r sums row r's
    partials, adds the residual, writes the new residual row (r < M) and the normed row (zeros for r ≥ M)."""
    S, M, K = parts.shape
    assert base.shape == (M, K) and w.shape[-1] == K and w.ndim == (1 if layer is None else 2), (
        parts.shape, base.shape, w.shape, layer)
    if smem_bytes(num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"add_rms_norm_rows: {smem_bytes(num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    R = rows_out(M, rows_to)
    kern = functools.partial(_add_kernel, M=M, K=K, S=S, eps=float(eps), has_layer=layer is not None,
                             interpret=interpret)
    return pl.pallas_call(
        kern,
        grid=(R,),
        out_shape=(jax.ShapeDtypeStruct((M, K), base.dtype), jax.ShapeDtypeStruct((R, K), base.dtype)),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="add_rms_norm_rows",
    )(*_operands(layer, parts, base, w))
