"""The Qwen3.5/3.6 text decoder as Flax NNX modules with explicit caches.

Modules are built once (randomly for built-in models, abstractly then filled for checkpoints) and split
into a graph definition and parameter leaves (`target.Target`); hot paths are `jax.jit` pure functions
over the leaves and the cache pytree. Every mixer call is `(x, cache_entry, layout) -> (y, cache_entry,
stash)`; `stash` is None except on a tree pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree.model.attention import Attention
from jaxddtree.model.cache import ModelCache
from jaxddtree.model.config import ATTENTION, TextConfig
from jaxddtree.model.gated_deltanet import GatedDeltaNet
from jaxddtree.model.layout import TokenLayout
from jaxddtree.model.linear import dense, init_weight
from jaxddtree.model.mlp import MLP
from jaxddtree.model.norms import RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mixer = (Attention(cfg, dtype, rngs) if layer_type == ATTENTION
                      else GatedDeltaNet(cfg, dtype, rngs))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, reduce=cfg.tp_axis)

    def __call__(self, x, cache, layout: TokenLayout):
        # pre-norm residual blocks: each norm runs inside the block's first projection and each residual add
        # (in the activations' dtype, rounded: transformers' `residual + hidden_states`) inside its last one
        # (`linear.dense`: on a decode step with kernels="pallas", in the GEMV's prologue / epilogue)
        x, cache, stash = self.mixer(x, cache, layout, norm=self.input_norm.spec, residual=x)
        x = self.mlp(x, layout.kernels, norm=self.post_norm.spec, residual=x)
        return x, cache, stash


class Qwen35(nnx.Module):
    def __init__(self, cfg: TextConfig, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.embed = nnx.Param(init_weight(rngs, (cfg.vocab_size, cfg.hidden_size), 1, dtype))  # [V, D]
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype, rngs) for t in cfg.layer_types])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.lm_head = nnx.Param(init_weight(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size,
                                             dtype))  # [D, V]

    def __call__(self, tokens: jax.Array, cache: ModelCache, layout: TokenLayout,
                 feature_layers: tuple[int, ...] = (), logits: str = "all"):
        """tokens [B, T] -> (logits [B, T|1, V] fp32 or None, cache, features [B, T, nF*D] or None,
        stashes (per-layer tuple, tree pass only)).

        `logits`: "all" positions, "last" (position num_valid - 1 only) or "none".
        """
        x = self.embed[...][tokens]  # [B, T, D]
        entries, stashes, feats = [], [], {}
        for i, layer in enumerate(self.layers):
            x, c, s = layer(x, cache.layers[i], layout)
            entries.append(c)
            stashes.append(s)
            if i in feature_layers:
                feats[i] = x
        features = jnp.concatenate([feats[i] for i in feature_layers], axis=-1) if feature_layers else None
        length = cache.length if layout.is_tree else layout.start + layout.num_valid
        new_cache = ModelCache(layers=tuple(entries), length=length)
        out = None
        if logits != "none":
            if logits == "last":
                x = jax.lax.dynamic_slice_in_dim(x, layout.num_valid - 1, 1, axis=1)
            out = dense("btd,dv->btv", x, self.lm_head[...], layout.kernels,
                        norm=self.final_norm.spec).astype(jnp.float32)
        return out, new_cache, features, (tuple(stashes) if layout.is_tree else None)
