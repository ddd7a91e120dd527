"""One gated-delta-rule decode step as a Pallas-Triton kernel (state read once, written once, in place).

Same function as `kernels_pallas.gdn_reference.gdn_step` (re-exported as `gdn_step_reference`). One program per
(batch, value head, dv tile); the [dk, BV] state tile stays in registers:
    S ← e^g S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq.
The state output aliases the state input (`input_output_aliases`): under a jit that donates the state
the update is in place. This is pure bandwidth: 48 heads × 128 × 128 × 4 B = 3 MiB read + 3 MiB written
per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gdn_step as gdn_step_reference
from kernels_pallas._common import compiler_params, feature_pad, is_pow2, pad_axis, pl

__all__ = ["gdn_step", "gdn_step_reference"]


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, so_ref):
    f32 = jnp.float32
    s = s_ref[...].astype(f32)  # [dk, BV]
    q = q_ref[...].astype(f32)  # [dk]
    k = k_ref[...].astype(f32)
    v = v_ref[...].astype(f32)  # [BV]
    g = g_ref[...].astype(f32)  # [1]
    beta = b_ref[...].astype(f32)  # [1]
    s = s * jnp.exp(g)[:, None]
    pred = jnp.sum(s * k[:, None], axis=0)  # Sᵀk [BV]
    delta = beta * (v - pred)
    s = s + k[:, None] * delta[None, :]
    o_ref[...] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    so_ref[...] = s.astype(so_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps", "num_stages"))
def gdn_step(q, k, v, g, beta, state, *, interpret: bool = False, block_v: int | None = None,
             num_warps: int = 4, num_stages: int = 1):
    """One token. q,k [B,Hk,dk], v [B,Hv,dv], g,beta [B,Hv], state [B,Hv,dk,dv] -> (o [B,Hv,dv], state)."""
    B, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    r = Hv // Hk
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    sdt = state.dtype
    if dkp != dk:  # tiny test shapes only
        q, k, state = pad_axis(q, 2, dkp), pad_axis(k, 2, dkp), pad_axis(state, 2, dkp)
    if dvp != dv:
        v, state = pad_axis(v, 2, dvp), pad_axis(state, 3, dvp)
    bv = min(block_v or 32, dvp)
    assert is_pow2(bv) and dvp % bv == 0
    # [B,Hv] scalars as [B,Hv,1] so that each program loads a (power-of-two) block of one element
    g3, b3 = g.astype(jnp.float32)[..., None], beta.astype(jnp.float32)[..., None]
    o, state_new = pl.pallas_call(
        _kernel,
        grid=(B, Hv, dvp // bv),
        in_specs=[
            pl.BlockSpec((None, None, dkp), lambda b, h, t: (b, h // r, 0)),  # q
            pl.BlockSpec((None, None, dkp), lambda b, h, t: (b, h // r, 0)),  # k
            pl.BlockSpec((None, None, bv), lambda b, h, t: (b, h, t)),  # v
            pl.BlockSpec((None, None, 1), lambda b, h, t: (b, h, 0)),  # g
            pl.BlockSpec((None, None, 1), lambda b, h, t: (b, h, 0)),  # beta
            pl.BlockSpec((None, None, dkp, bv), lambda b, h, t: (b, h, 0, t)),  # state
        ],
        out_specs=[
            pl.BlockSpec((None, None, bv), lambda b, h, t: (b, h, t)),
            pl.BlockSpec((None, None, dkp, bv), lambda b, h, t: (b, h, 0, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hv, dvp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hv, dkp, dvp), sdt),
        ],
        input_output_aliases={5: 1},
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_decode_step",
    )(q, k, v, g3, b3, state)
    if dkp != dk or dvp != dv:
        o, state_new = o[..., :dv], state_new[:, :, :dk, :dv]
    return o, state_new
