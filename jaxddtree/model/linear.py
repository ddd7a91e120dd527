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


def dense(spec: str, x: jax.Array, w, kernels: str = "xla", *, norm=None, gate=None, residual=None,
          reduce: str | None = None, gated_norm=None, normed=None, then_norm=None):
    """einsum(spec, x, w) accumulated in fp32, rounded once to x's dtype, on the kernel `ops.pick` chooses for
    (weight format, rows, output width, kernels) (`ops.dense`). norm = (w_n, eps) / gate / residual: the RMSNorm
    of x, x's gate and the residual add around the projection (gate and residual inside the GEMV on a decode
    step); gated_norm = (z, w_n, eps): the GDN mixer's gated RMSNorm of x with z (`ops.dense`). `reduce`: a mesh
    axis (tensor parallelism) over which the partial products are summed before the rounding and the residual add.
    An FP8 weight (`fp8.Fp8Weight`) computes transformers' W8A8 block FP8 product (x quantized per row and input
    block to e4m3, fp8 × fp8 per block, scaled by both scales, fp32 accumulation). then_norm = (w_n, eps): returns
    (y, the next projection's input rows normed), for its `normed=` (`ops.dense`: one kernel adds the residual and
    norms on a Mosaic GPU GEMM)."""
    w, fp8 = _operands(w)
    return ops.dense(spec, x, w, kernels, norm=norm, gate=gate, residual=residual, reduce=reduce, fp8=fp8,
                     gated_norm=gated_norm, normed=normed, then_norm=then_norm)


def decode_row(x: jax.Array, w, kernels: str = "xla", *, norm=None) -> jax.Array:
    """A decode step's (T = 1) first projection x [B, 1, D] @ w [D, C] for the layer's fused decode op: the rows
    [B, C], or the Pallas GEMV's unsummed split-K partials [S, B, C] where `ops.pick` chooses them
    (`ops.decode_row`)."""
    w, fp8 = _operands(w)
    return ops.decode_row(x, w, kernels, norm=norm, fp8=fp8)


def _operands(w) -> tuple[jax.Array | ops.Layer, ops.Fp8 | None]:
    """A weight as `ops.dense` takes it: the array (or `ops.Layer`: one layer of a stack, in a scan over layers),
    or an FP8 weight's e4m3 values and the rest (`ops.Fp8`). An Fp8Weight whose q is a Layer holds one layer of
    stacked FP8 weights: its scale and tail are Layers too, or the plain stacks [L, ...], taken at q's index."""
    if isinstance(w, Fp8Weight):
        q, scale, tail = w.q, w.scale, w.tail
        if isinstance(q, ops.Layer):
            scale, tail = (a if a is None or isinstance(a, ops.Layer) else ops.Layer(a, q.index) for a in (scale, tail))
        return q, ops.Fp8(scale, tail, w.block_in, w.block_out, w.shape)
    return w, None


def init_weight(rngs: nnx.Rngs, shape, fan_in: int, dtype, scale: float = 1.0) -> jax.Array:
    """Random init for built-in models (loading overwrites it); abstract under nnx.eval_shape."""
    std = scale / (fan_in ** 0.5)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
