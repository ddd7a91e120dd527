"""Projections: einsum in the activations' dtype with fp32 accumulation (exact fp32 when fp32), and the
elementwise helpers that reproduce transformers' (PyTorch's) roundings in low precision.

PyTorch runs every bf16 elementwise op as fp32 math with one rounding of its result (`silu`, `sigmoid`,
`a * b`, `a + b`, ...); a chain of them rounds after every op. XLA instead may expand a bf16 op into
several bf16 steps (jax.nn.silu / sigmoid: exp, add, div each rounded) or, inside a fusion, drop a
bf16 round-trip and keep the fp32 value (excess precision). So the low-precision paths compute in fp32
and round explicitly with `rounded`, whose `reduce_precision` XLA never elides. All of it is the
identity (plain fp32 math) for fp32 activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import ops
from jaxddtree.model.fp8 import Fp8Weight
# re-exported: the model rounds with these (they live with the kernels' references)
from kernels_pallas.numerics import f32, rms_norm_1p, rounded, sigmoid32, silu32  # noqa: F401


def dense(spec: str, x: jax.Array, w: jax.Array, kernels: str = "xla", *, norm=None, gate=None,
          residual=None, reduce: str | None = None) -> jax.Array:
    """einsum(spec, x, w) accumulated in fp32, rounded once to x's dtype (`ops.dense` picks the kernel).
    norm = (w_n, eps) / gate / residual: the RMSNorm of x, x's gate and the residual add around the projection
    (`ops.dense`; gate and residual folded into the GEMV on a decode step). `reduce`: a mesh axis (tensor
    parallelism) over which the partial products are summed before the rounding and the residual add (`reduced`).
    An FP8 weight (`fp8.Fp8Weight`) computes transformers' W8A8 block FP8 product (`ops.dense_w8a8`: x
    quantized per row and input block to e4m3, fp8 × fp8 per block, scaled by both scales, fp32 accumulation):
    on the Pallas kernel with kernels="pallas", on its jnp reference with "xla" (`ops.pick` decides, once);
    its norm / gate / residual run as separate ops."""
    parts = dict(norm=norm, gate=gate, residual=residual)
    if isinstance(w, Fp8Weight):
        if norm is not None:
            x = rms_norm_1p(x, *norm)
        if gate is not None:
            x = rounded(f32(x) * f32(gate), x.dtype)
        y = rounded(ops.dense_w8a8(spec, x, w.q, w.scale, w.tail, w.block_in, w.block_out, kernels), x.dtype)
        return y if residual is None else rounded(f32(residual) + f32(y), residual.dtype)
    if reduce is not None:  # tensor parallelism: the residual is added once, after the sum over the shards
        return reduced(ops.dense(spec, x, w, kernels, norm=norm, gate=gate), x.dtype, residual, reduce)
    return rounded(ops.dense(spec, x, w, kernels, **parts), x.dtype)


def reduced(y: jax.Array, dtype, residual: jax.Array | None, axis: str) -> jax.Array:
    """Tensor parallelism (model/sharding.py): a row-parallel projection's fp32 partial products `y` summed
    over mesh axis `axis` (`psum`: one all-reduce) before the one rounding, then the residual add (rounded),
    the same roundings as the unsharded projection."""
    y = rounded(jax.lax.psum(y, axis), dtype)
    return y if residual is None else rounded(f32(residual) + f32(y), residual.dtype)


def init_weight(rngs: nnx.Rngs, shape, fan_in: int, dtype, scale: float = 1.0) -> jax.Array:
    """Random init for built-in models (loading overwrites it); abstract under nnx.eval_shape."""
    std = scale / (fan_in ** 0.5)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
