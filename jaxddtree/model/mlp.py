"""SwiGLU MLP: down(silu(gate(x)) * up(x)), rounded like transformers' `Qwen3_5MLP` in the activations'
dtype: silu computed in fp32 and rounded, the product rounded (no-ops in fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree.model.linear import dense, f32, init_weight, rounded, silu32


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, dtype, rngs: nnx.Rngs):
        self.w_gate = nnx.Param(init_weight(rngs, (d, f), d, dtype))  # [D, F]
        self.w_up = nnx.Param(init_weight(rngs, (d, f), d, dtype))  # [D, F]
        self.w_down = nnx.Param(init_weight(rngs, (f, d), f, dtype))  # [F, D]

    def __call__(self, x: jax.Array, kernels: str = "xla") -> jax.Array:
        act = rounded(silu32(dense("btd,df->btf", x, self.w_gate[...], kernels)), x.dtype)
        h = rounded(f32(act) * f32(dense("btd,df->btf", x, self.w_up[...], kernels)), x.dtype)
        return dense("btf,fd->btd", h, self.w_down[...], kernels)
