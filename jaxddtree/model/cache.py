"""Explicit per-layer-type caches of the target model (pytrees, passed in and returned, donated).

- `KVCache` (attention layers): post-norm, post-RoPE keys and values, preallocated to `max_len`.
- `GDNState` (Gated-DeltaNet layers): the last K-1 pre-conv inputs (channels [q|k|v]) and the fp32
  recurrent state `[Hv, dk, dv]` (k-major, as transformers keeps it).
- `ModelCache`: one entry per position of the layer group (`config.group_size`), each stacked over the groups
  (a leading [G] axis: layer g·p + j is `groups[j]` at index g, as the model's parameters; qwen35.py scans over
  g), and the committed length. Every array carries a batch axis after the group axis (1 per request).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxddtree.model.config import ATTENTION, TextConfig
from kernels_pallas.ops import Layer


def unstack(a) -> tuple[jax.Array, jax.Array | None]:
    """A cache field as the kernels take it: a layer's view (`ops.Layer`, inside the model's scan) -> (the whole
    stack, its layer index); a plain per-layer array -> (it, None)."""
    return (a.stacked, a.index) if isinstance(a, Layer) else (a, None)


def restack(a: jax.Array, index) -> jax.Array | Layer:
    """`unstack`'s inverse for an updated field (the whole stack, updated in place at `index`)."""
    return a if index is None else Layer(a, index)


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, Hkv, S_max, hd] (stacked in a ModelCache: [G, B, Hkv, S_max, hd])
    v: jax.Array  # [B, Hkv, S_max, hd]


@struct.dataclass
class GDNState:
    conv: jax.Array  # [B, K-1, conv_dim]   last K-1 pre-conv inputs, oldest first (stacked: [G, B, ...])
    recurrent: jax.Array  # [B, Hv, dk, dv]  fp32


@struct.dataclass
class ModelCache:
    groups: tuple  # per layer-group position j: KVCache | GDNState stacked over the G groups
    length: jax.Array  # int32 scalar: tokens committed so far

    @property
    def max_len(self) -> int:
        for c in self.groups:
            if isinstance(c, KVCache):
                return c.k.shape[-2]
        return 1 << 30  # no attention layer: no length limit

    @property
    def num_layers(self) -> int:
        return len(self.groups) * jax.tree.leaves(self.groups[0])[0].shape[0]

    @property
    def layers(self) -> tuple:
        """Per decoder layer, its entry (slices of the stacked arrays: copies; for tests and tools, not hot
        paths)."""
        p = len(self.groups)
        return tuple(jax.tree.map(lambda a: a[i // p], self.groups[i % p]) for i in range(self.num_layers))


def init_cache(cfg: TextConfig, max_len: int, dtype=jnp.bfloat16, batch: int = 1) -> ModelCache:
    """Zeroed caches for `max_len` positions (include slack for the widest verify/prefill block)."""
    G = cfg.num_groups
    groups = []
    for t in cfg.layer_types[:cfg.group_size]:
        if t == ATTENTION:
            shape = (G, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
            groups.append(KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        else:
            groups.append(GDNState(
                conv=jnp.zeros((G, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
                recurrent=jnp.zeros((G, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim), jnp.float32)))
    return ModelCache(groups=tuple(groups), length=jnp.zeros((), jnp.int32))
