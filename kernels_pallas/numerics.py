"""Rounding helpers shared by the jnp references and the model: transformers' (PyTorch's) low-precision
semantics are fp32 math with one rounding per op, and `rounded`'s `reduce_precision` is never elided by XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rounded(x: jax.Array, dtype) -> jax.Array:
    """x (any float dtype) rounded once to `dtype`, returned as `dtype`; a plain cast for fp32."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32 or dtype == jnp.float64:
        return x.astype(dtype)
    fi = jnp.finfo(dtype)
    r = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return r.astype(dtype)


def f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)
