"""Explicit per-layer-type caches of the target model (pytrees, passed in and returned, donated).

- `KVCache` (attention layers): post-norm, post-RoPE keys and values, preallocated to `max_len`.
- `GDNState` (Gated-DeltaNet layers): the last K-1 pre-conv inputs (channels [q|k|v]) and the fp32
  recurrent state `[Hv, dk, dv]` (k-major, as transformers keeps it).
- `ModelCache`: one entry per decoder layer (following `config.layer_types`) and the committed length.
Every array carries a leading batch axis (1 today).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxddtree.model.config import ATTENTION, TextConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, Hkv, S_max, hd]
    v: jax.Array  # [B, Hkv, S_max, hd]


@struct.dataclass
class GDNState:
    conv: jax.Array  # [B, K-1, conv_dim]   last K-1 pre-conv inputs, oldest first
    recurrent: jax.Array  # [B, Hv, dk, dv]  fp32


@struct.dataclass
class ModelCache:
    layers: tuple  # per decoder layer: KVCache | GDNState
    length: jax.Array  # int32 scalar: tokens committed so far

    @property
    def max_len(self) -> int:
        for c in self.layers:
            if isinstance(c, KVCache):
                return c.k.shape[2]
        return 1 << 30  # no attention layer: no length limit


def init_cache(cfg: TextConfig, max_len: int, dtype=jnp.bfloat16, batch: int = 1) -> ModelCache:
    """Zeroed caches for `max_len` positions (include slack for the widest verify/prefill block)."""
    layers = []
    for t in cfg.layer_types:
        if t == ATTENTION:
            shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
            layers.append(KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        else:
            layers.append(GDNState(
                conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
                recurrent=jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim), jnp.float32)))
    return ModelCache(layers=tuple(layers), length=jnp.zeros((), jnp.int32))
