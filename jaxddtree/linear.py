"""Projections: einsum in the activations' dtype with fp32 accumulation (exact fp32 when fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def dense(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.einsum(spec, x, w.astype(x.dtype), precision=prec,
                      preferred_element_type=jnp.float32).astype(x.dtype)


def init_weight(rngs: nnx.Rngs, shape, fan_in: int, dtype, scale: float = 1.0) -> jax.Array:
    """Random init for built-in models (loading overwrites it); abstract under nnx.eval_shape."""
    std = scale / (fan_in ** 0.5)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
