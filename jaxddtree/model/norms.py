"""RMSNorms of the Qwen3.5/3.6 family.

- Zero-centred ("1 + w") for the decoder, final, q and k norms: fp32 math, one rounding back
  (transformers' `Qwen3_5RMSNorm`: `(x.float() * rsqrt(..) * (1 + w.float())).type_as(x)`).
- Plain-weight gated norm after the GDN core: normalise in fp32, round, times w (rounded: a product in
  the activations' dtype), times silu(z) in fp32, round (the casts of `Qwen3_5RMSNormGated.forward`:
  `self.weight * hidden_states.to(input_dtype)`, then `* silu(gate.to(torch.float32))`, `.to(input_dtype)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.gdn_reference import gated_rms_norm  # noqa: F401  (re-exported; the GDN kernels share it)
from kernels_pallas.numerics import rms_norm_1p  # noqa: F401  (re-exported; the fused GEMV prologue shares it)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: identity at w = 0."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(0.1 * jax.random.normal(rngs.params(), (dim,), jnp.float32).astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_1p(x, self.weight[...], self.eps)

    @property
    def spec(self) -> tuple:
        """(weight, eps): the norm as `ops.dense(..., norm=)` folds it into a projection."""
        return self.weight[...], self.eps
