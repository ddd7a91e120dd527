"""SwiGLU MLP: down(silu(gate(x)) * up(x)), every product in the activations' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree.linear import dense, init_weight


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, dtype, rngs: nnx.Rngs):
        self.w_gate = nnx.Param(init_weight(rngs, (d, f), d, dtype))  # [D, F]
        self.w_up = nnx.Param(init_weight(rngs, (d, f), d, dtype))  # [D, F]
        self.w_down = nnx.Param(init_weight(rngs, (f, d), f, dtype))  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(dense("btd,df->btf", x, self.w_gate[...])) * dense("btd,df->btf", x, self.w_up[...])
        return dense("btf,fd->btd", h, self.w_down[...])
