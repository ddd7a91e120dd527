"""Rounding helpers shared by the jnp references and the model: transformers' (PyTorch's) low-precision
semantics are fp32 math with one rounding per op, and `rounded`'s `reduce_precision` is never elided by XLA.
`silu32` / `sigmoid32` are the fp32 formulas of PyTorch's kernels (round their result with `rounded`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rounded(x: jax.Array, dtype) -> jax.Array:
    """x (any float dtype) rounded once to `dtype`, returned as `dtype`; a plain cast for fp32."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32 or dtype == jnp.float64 or x.dtype == dtype:  # (already in dtype: nothing to round)
        return x.astype(dtype)
    fi = jnp.finfo(dtype)
    r = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return r.astype(dtype)


def f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def silu32(x: jax.Array) -> jax.Array:
    """SiLU in fp32 as PyTorch's CPU kernel computes it: x / (1 + exp(-x))."""
    x = f32(x)
    return x / (1.0 + jnp.exp(-x))


def sigmoid32(x: jax.Array) -> jax.Array:
    """Sigmoid in fp32 as PyTorch's CPU kernel computes it: 1 / (1 + exp(-x))."""
    return 1.0 / (1.0 + jnp.exp(-f32(x)))


def rms_norm_1p(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred ("1 + w") RMSNorm over the last axis, fp32 math, one rounding back to x's dtype
    (transformers' `Qwen3_5RMSNorm`: `(x.float() * rsqrt(mean(x²) + eps) * (1 + w.float())).type_as(x)`)."""
    xf = f32(x)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return rounded(y * (1.0 + f32(w)), x.dtype)


def swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """transformers' `act_fn(gate_proj(x)) * up_proj(x)` in `dtype`: silu in fp32 rounded, the product rounded."""
    act = rounded(silu32(gate), dtype)
    return rounded(f32(act) * f32(up), dtype)


def sum_partials(parts: jax.Array, dtype) -> jax.Array:
    """parts [S, ...] (split-K partial sums of one projection, any float dtype) -> their sum in order
    (parts[0] + parts[1] + ...) in fp32, rounded once to `dtype`: how the Pallas GEMV's reduction and every
    kernel that consumes unsummed partials (`dense(..., reduce=False)`) add them up."""
    acc = f32(parts[0])
    for i in range(1, parts.shape[0]):
        acc = acc + f32(parts[i])
    return rounded(acc, dtype)
