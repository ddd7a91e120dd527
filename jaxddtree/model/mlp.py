"""SwiGLU MLP: down(silu(gate(x)) * up(x)), rounded like transformers' `Qwen3_5MLP` in the activations'
dtype: silu computed in fp32 and rounded, the product rounded (no-ops in fp32). gate and up are one fused
projection `w_gate_up [D, 2, F]` (gate = [:, 0], up = [:, 1]; the explicit F axis can be sharded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import ops
from kernels_pallas.numerics import swiglu
from jaxddtree.model.fp8 import Fp8Weight
from jaxddtree.model.linear import dense, init_weight, reduced, rounded


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, dtype, rngs: nnx.Rngs, reduce: str | None = None):
        self.reduce = reduce  # tensor parallelism: the mesh axis that w_down's partial sums add over
        self.w_gate_up = nnx.Param(init_weight(rngs, (d, 2, f), d, dtype))  # [D, gate|up, F]
        self.w_down = nnx.Param(init_weight(rngs, (f, d), f, dtype))  # [F, D]

    def __call__(self, x: jax.Array, kernels: str = "xla", norm=None, residual=None) -> jax.Array:
        """norm = (w, eps): the pre-MLP RMSNorm, applied to x inside the gate|up projection; residual: added
        to the output inside the down projection (`linear.dense`). A decode step on the Pallas GEMVs runs
        gate|up → SwiGLU → down as two kernels (`ops.mlp_decode`, the same values)."""
        w_gu, w_down = self.w_gate_up[...], self.w_down[...]
        if not isinstance(w_gu, Fp8Weight) and not isinstance(w_down, Fp8Weight):
            y = ops.mlp_decode(x, w_gu, w_down, kernels, norm=norm, residual=None if self.reduce else residual)
            if y is not None:
                return rounded(y, x.dtype) if self.reduce is None else reduced(y, x.dtype, residual, self.reduce)
        gu = dense("btd,dgf->btgf", x, w_gu, kernels, norm=norm)  # [B,T,2,F], one GEMM / GEMV
        h = swiglu(gu[..., 0, :], gu[..., 1, :], x.dtype)
        return dense("btf,fd->btd", h, w_down, kernels, residual=residual, reduce=self.reduce)
