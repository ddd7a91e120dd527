"""Partial rotary embeddings (rotate-half convention) over the first `rotary_dim` dims of a head.

For text the three mRoPE streams carry the same position, so the interleaved recomposition is the
identity and this is plain 1-D RoPE. cos/sin are computed in fp32 and cast to the activations' dtype,
and the rotation rounds like transformers' `apply_rotary_pos_emb` in that dtype:
`(q_rot * cos) + (rotate_half(q_rot) * sin)`, each product and the sum rounded (no-ops in fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.attention_reference import apply_rope  # noqa: F401  (re-exported; the decode kernel shares it)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype):
    """positions [..., T] int -> cos, sin [..., T, rotary_dim] in `dtype`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
