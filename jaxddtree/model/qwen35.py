"""The Qwen3.5/3.6 text decoder as Flax NNX modules with explicit caches.

Modules are built once (randomly for built-in models, abstractly then filled for checkpoints) and split
into a graph definition and parameter leaves (`target.Target`); hot paths are `jax.jit` pure functions
over the leaves and the cache pytree. The layers are stacked per layer-group position and scanned
(`Qwen35`). Every mixer call is `(x, cache_entry, layout) -> (y, cache_entry,
stash)`; `stash` is None except on a tree pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxddtree.model.attention import Attention
from jaxddtree.model.cache import ModelCache
from jaxddtree.model.config import ATTENTION, TextConfig
from jaxddtree.model.gated_deltanet import GatedDeltaNet
from jaxddtree.model.layout import TokenLayout
from jaxddtree.model.linear import dense, init_weight
from jaxddtree.model.mlp import MLP
from jaxddtree.model.norms import RMSNorm
from kernels_pallas import ops
from kernels_pallas.ops import Layer, scan_unroll


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mixer = (Attention(cfg, dtype, rngs) if layer_type == ATTENTION
                      else GatedDeltaNet(cfg, dtype, rngs))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, reduce=cfg.tp_axis)

    def __call__(self, x, cache, layout: TokenLayout, normed=None, then_norm=None):
        """-> (x, cache, stash, h). Pre-norm residual blocks: each norm runs inside the block's first projection and
        each residual add (in the activations' dtype, rounded: transformers' `residual + hidden_states`) inside its
        last one (`linear.dense`: on a decode step with kernels="pallas", in the GEMV's prologue / epilogue). In a
        tree pass where `ops.add_norm_fuses` (the Pallas path), a block's last projection also writes the next
        block's normed input rows (`then_norm`; one kernel adds the residual and norms): the mixer's for the MLP,
        and with then_norm (the next layer's input norm) the MLP's, returned as h for that layer's `normed`."""
        if not (layout.is_tree and self.mlp.reduce is None and ops.add_norm_fuses(layout.kernels)):
            x, cache, stash = self.mixer(x, cache, layout, norm=self.input_norm.spec, residual=x)
            return self.mlp(x, layout.kernels, norm=self.post_norm.spec, residual=x), cache, stash, None
        (x, h), cache, stash = self.mixer(x, cache, layout, norm=self.input_norm.spec, residual=x, normed=normed,
                                          then_norm=self.post_norm.spec)
        out = self.mlp(x, layout.kernels, norm=self.post_norm.spec, residual=x, normed=h, then_norm=then_norm)
        return (out, cache, stash, None) if then_norm is None else (out[0], cache, stash, out[1])


class Qwen35(nnx.Module):
    """The decoder. Its layers are held as one stacked `DecoderLayer` per position of the layer group
    (`config.group_size` p; Qwen3.6-27B: 3 GDN + 1 attention): `groups[j]`'s parameters carry a leading [G] axis,
    layer g·p + j at index g. A forward pass is one `lax.scan` over the G groups (XLA compiles one group, not
    every layer); the caches are stacked the same way (cache.py)."""

    def __init__(self, cfg: TextConfig, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.embed = nnx.Param(init_weight(rngs, (cfg.vocab_size, cfg.hidden_size), 1, dtype))  # [V, D]
        layers = [DecoderLayer(cfg, t, dtype, rngs) for t in cfg.layer_types]  # the random init's order
        p, groups = cfg.group_size, []
        for j in range(p):
            groups.append(stack_modules(layers[j::p]))
            layers[j::p] = [None] * len(layers[j::p])  # each layer's arrays freed once stacked
        self.groups = nnx.List(groups)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.lm_head = nnx.Param(init_weight(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size,
                                             dtype))  # [D, V]

    @property
    def layers(self) -> list[DecoderLayer]:
        """Each decoder layer as its own module (slices of the stacked parameters: copies; for tests and tools)."""
        p = len(self.groups)
        out = []
        for i in range(self.cfg.num_hidden_layers):
            graphdef, state = nnx.split(self.groups[i % p])
            out.append(nnx.merge(graphdef, jax.tree.map(lambda a: a[i // p], state)))
        return out

    def __call__(self, tokens: jax.Array, cache: ModelCache, layout: TokenLayout,
                 feature_layers: tuple[int, ...] = (), logits: str = "all"):
        """tokens [B, T] -> (logits [B, T|1, V] fp32 or None, cache, features [B, T, nF*D] or None,
        stashes (tree pass only: per group position, stacked over the groups [G, ...])).

        `logits`: "all" positions, "last" (position num_valid - 1 only) or "none"."""
        x = self.embed[...][tokens]  # [B, T, D]
        p, G = len(self.groups), self.cfg.num_groups
        parts = [nnx.split(grp) for grp in self.groups]
        # feature taps: after layer l = g·p + j, x goes to slot f of a buffer (slot nF: the discard slot)
        nF = len(feature_layers)
        slots = {}
        for f, l in enumerate(feature_layers):
            slots.setdefault(l % p, np.full(G, nF, np.int32))[l // p] = f
        feats0 = jnp.zeros((nF + 1,) + x.shape, x.dtype) if nF else None

        def body(carry, g):
            x, caches, feats = carry
            out, stashes, h = [], [], None
            layers = [nnx.merge(graphdef, layer_view(state, g)) for graphdef, state in parts]
            for j, layer in enumerate(layers):
                entry = jax.tree.map(lambda a: Layer(a, g), caches[j])  # the kernels update the stacks in place
                # (a tree pass on the Pallas path: the MLP's residual add in the next layer's input-norm kernel)
                then = layers[j + 1].input_norm.spec if j + 1 < p else None
                x, c, s, h = layer(x, entry, layout, normed=h, then_norm=then)
                out.append(caches[j] if c is entry else
                           jax.tree.map(lambda n: n.stacked, c, is_leaf=lambda n: isinstance(n, Layer)))
                stashes.append(s)
                if j in slots:  # (a group without a tap at j writes the discard slot: a lax.cond lost on the H200)
                    feats = jax.lax.dynamic_update_index_in_dim(feats, x, jnp.asarray(slots[j])[g], 0)
            return (x, tuple(out), feats), (tuple(stashes) if layout.is_tree else None)

        (x, groups, feats), stashes = jax.lax.scan(body, (x, cache.groups, feats0), jnp.arange(G, dtype=jnp.int32),
                                                   unroll=scan_unroll(layout.kernels, layout.is_tree))
        features = jnp.concatenate(list(feats[:nF]), axis=-1) if nF else None
        length = cache.length if layout.is_tree else layout.start + layout.num_valid
        new_cache = ModelCache(groups=groups, length=length)
        out = None
        if logits != "none":
            if logits == "last":
                x = jax.lax.dynamic_slice_in_dim(x, layout.num_valid - 1, 1, axis=1)
            out = dense("btd,dv->btv", x, self.lm_head[...], layout.kernels,
                        norm=self.final_norm.spec).astype(jnp.float32)
        return out, new_cache, features, stashes


# the projection weights: their kernels read one layer of the stack in place (`ops.Layer`); every other parameter
# (norms, conv taps, gates: a few KB) is sliced, except the small parameters a kernel reads from the stack at the
# layer too (KERNEL_SMALL: XLA materialises a slice feeding a custom call, one copy kernel each; XLA's fusions take
# the slice, `ops.plain`)
PROJECTIONS = ("w_in", "w_out", "w_qkv", "wo", "w_gate_up", "w_down")
KERNEL_SMALL = (("q_norm",), ("k_norm",),  # attention_decode_prep
                ("conv",), ("A_log",), ("dt_bias",), ("mixer", "norm"),  # gdn_decode_fused (not the RMSNorms' weight)
                ("input_norm", "weight"), ("post_norm", "weight"))  # rms_norm_rows (the Mosaic GPU GEMMs' input)


def layer_view(state, g):
    """A stacked group position's parameters as layer g's: `ops.Layer` views of the projection weights (and of an
    FP8 weight's arrays), slices of the rest. XLA copies a dynamic slice that feeds a kernel or a GEMM (measured on
    the H200: the whole weight, every layer), so the projections' kernels take the stack and the index."""
    def view(path, a):
        keys = tuple(k.key for k in path if hasattr(k, "key"))  # (the Variables' trailing .value: no key)
        big = any(k in PROJECTIONS for k in keys) or any(keys[-len(t):] == t for t in KERNEL_SMALL)
        return Layer(a, g) if big else jax.lax.dynamic_index_in_dim(a, g, keepdims=False)
    return jax.tree_util.tree_map_with_path(view, state)


def per_layer_pure(cfg: TextConfig, pure: dict) -> dict:
    """A Qwen35 pure dict (`nnx.to_pure_dict`; "groups" stacked) with its layers as {"layers": {i: ...}} (the
    checkpoints' per-layer layout: slices, and a bf16 w_in without its padding columns), for exports and tools."""
    from jaxddtree.model.gated_deltanet import in_proj_width
    out = {k: v for k, v in pure.items() if k != "groups"}
    p, width = cfg.group_size, in_proj_width(cfg)

    def one(path, a):
        a = a[i // p]
        if getattr(path[-1], "key", None) == "w_in" and getattr(a, "ndim", 0) == 2:
            a = a[:, :width]
        return a
    out["layers"] = {}
    for i in range(cfg.num_hidden_layers):
        out["layers"][i] = jax.tree_util.tree_map_with_path(one, pure["groups"][i % p])
    return out


def stack_modules(modules: list) -> nnx.Module:
    """Modules of one structure as one whose parameters are stacked on a new leading axis (in list order)."""
    graphdef, _ = nnx.split(modules[0])
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in modules]))
