"""RMSNorms of the Qwen3.5/3.6 family.

- Zero-centred ("1 + w") for the decoder, final, q and k norms: fp32 math, one cast back.
- Plain-weight gated norm after the GDN core: normalise in fp32, cast, times w, times silu(z) in fp32,
  cast (the casts of transformers' `Qwen3_5RMSNormGated`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm_1p(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = w * y
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: identity at w = 0."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(0.1 * jax.random.normal(rngs.params(), (dim,), jnp.float32).astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_1p(x, self.weight[...], self.eps)
