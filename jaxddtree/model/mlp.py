"""SwiGLU MLP: down(silu(gate(x)) * up(x)), rounded like transformers' `Qwen3_5MLP` in the activations'
dtype: silu computed in fp32 and rounded, the product rounded (no-ops in fp32). gate and up are one fused
projection `w_gate_up [D, 2, F]` (gate = [:, 0], up = [:, 1]; the explicit F axis can be sharded). On the Pallas
path of a Hopper GPU the verify's MLP runs as `ops.mlp` (the SwiGLU in the gate|up GEMM's epilogue)."""

from __future__ import annotations

import jax
from flax import nnx

from kernels_pallas import ops
from kernels_pallas.numerics import swiglu
from jaxddtree.model.linear import dense, init_weight


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, dtype, rngs: nnx.Rngs, reduce: str | None = None):
        self.reduce = reduce  # tensor parallelism: the mesh axis that w_down's partial sums add over
        self.w_gate_up = nnx.Param(init_weight(rngs, (d, 2, f), d, dtype))  # [D, gate|up, F]
        self.w_down = nnx.Param(init_weight(rngs, (f, d), f, dtype))  # [F, D]

    def __call__(self, x: jax.Array, kernels: str = "xla", norm=None, residual=None, normed=None, then_norm=None):
        """norm = (w, eps): the pre-MLP RMSNorm of x before the gate|up projection; residual: added to the output
        inside the down projection (`linear.dense`); normed / then_norm: `linear.dense`'s (with then_norm: (y, h))."""
        w_gate_up, w_down = self.w_gate_up[...], self.w_down[...]
        if self.reduce is None and ops.swiglu_fuses(x, w_gate_up, w_down, kernels):  # SwiGLU in the GEMM
            return ops.mlp(x, w_gate_up, w_down, kernels, norm=norm, residual=residual, normed=normed,
                           then_norm=then_norm)
        gu = dense("btd,dgf->btgf", x, w_gate_up, kernels, norm=norm, normed=normed)  # [B,T,2,F], one GEMM / GEMV
        h = swiglu(gu[..., 0, :], gu[..., 1, :], x.dtype)
        return dense("btf,fd->btd", h, w_down, kernels, residual=residual, reduce=self.reduce, then_norm=then_norm)
