"""Tensor parallelism (Megatron-style) of the target over a 1-D device mesh axis "tp".

Each device runs the decoder layers on its own heads with a *local* config (q / kv attention heads, GDN
key / value heads and the MLP's intermediate size divided by tp), inside one `jax.shard_map`, so the model
code and the Pallas kernels run unchanged per shard on local shapes. The row-parallel projections (attention
o_proj, GDN out_proj, MLP down_proj) sum their fp32 partial products over the axis (`jax.lax.psum`, one
all-reduce each) before the single rounding; the embedding and the norms are replicated; the lm_head is split
over the vocabulary and the logits leave the shard_map vocab-sharded (XLA partitions their consumers).

The fused projections are not head-major across their parts (attention `w_qkv` = [q|gate per head | k | v],
GDN `w_in` = [q | k | v | z | b | a], the conv's channels [q | k | v]), so `shard_leaves` permutes their
columns into shard-major order: contiguous column block i of the global array is exactly the tp=1 layout of
shard i's heads. Head-indexed arrays (wo, w_out, A_log, dt_bias, the KV cache [B, Hkv, S, hd], the GDN state
[B, Hv, dk, dv], the tree stash) keep the global head order and are split in contiguous head blocks (value
head h reads key head h // (Hv/Hk), which stays inside a shard). The conv state and the stash's pre-conv
inputs carry the conv channels in the same shard-major order. tp = 1 is the plain model (no wrapper).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxddtree.model.attention import AttentionStash
from jaxddtree.model.cache import GDNState, KVCache, ModelCache, init_cache
from jaxddtree.model.config import ATTENTION, TextConfig
from jaxddtree.model.fp8 import Fp8Weight
from jaxddtree.model.gated_deltanet import GDNStash
from jaxddtree.model.qwen35 import Qwen35

AXIS = "tp"

# How the per-layer all-reduces run at tp > 1 (XLA_FLAGS entries; they must be set before the backend starts):
#   nccl            XLA's default: an NCCL all-reduce per psum, each one ending a command buffer (CUDA graph);
#   oneshot         XLA's one-shot all-reduce kernel (a Triton kernel reading the peers' buffers over NVLink:
#                   peer access, no multicast) instead of NCCL where it applies (small, one host);
#   graphs          collectives recorded into the command buffers too (fewer host launches per step);
#   graphs_oneshot  both.
# benchmarks/bench_allreduce.py times them on their own; bench.py / profile_gpu.py --allreduce in the model.
_ONESHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
_GRAPHS = "--xla_gpu_enable_command_buffer=+COLLECTIVES"
ALLREDUCE_MODES = {"nccl": (), "oneshot": (_ONESHOT,), "graphs": (_GRAPHS,), "graphs_oneshot": (_GRAPHS, _ONESHOT)}


def use_allreduce(mode: str) -> None:
    """Append mode's XLA_FLAGS entries to the environment (call before the first device use)."""
    import os
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"unknown all-reduce mode '{mode}' (choose one of {', '.join(ALLREDUCE_MODES)})")
    flags = " ".join(ALLREDUCE_MODES[mode])
    if flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

# per parameter name (unique across the layer types): the axis split over the mesh (None: replicated)
_SPLIT = {"embed": None, "lm_head": 1, "weight": None,  # input / post / final norms
          "w_qkv": 1, "wo": 0, "q_norm": None, "k_norm": None,  # attention
          "w_in": 1, "conv": 1, "dt_bias": 0, "A_log": 0, "norm": None, "w_out": 0,  # gated deltanet
          "w_gate_up": 2, "w_down": 0}  # mlp


def _divided(cfg: TextConfig) -> dict[str, int]:
    """The sizes that tp must divide, by name."""
    return {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}


def valid_tp(cfg: TextConfig) -> list[int]:
    g = math.gcd(*_divided(cfg).values())
    return [d for d in range(1, g + 1) if g % d == 0]


def check_tp(cfg: TextConfig, tp: int) -> None:
    """ValueError unless tp divides every split size and there are tp devices."""
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp not in valid_tp(cfg):
        sizes = ", ".join(f"{k}={v}" for k, v in _divided(cfg).items())
        raise ValueError(f"tp={tp} must divide every split size of this model ({sizes}); "
                         f"valid values: {', '.join(map(str, valid_tp(cfg)))}")
    n = len(jax.devices())
    if tp > n:
        raise ValueError(f"tp={tp} needs {tp} devices, but only {n} {jax.default_backend()} device(s) are "
                         "visible (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")


def make_mesh(tp: int) -> Mesh:
    """The first tp devices (of every process, after jax.distributed.initialize) as a 1-D mesh."""
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def local_config(cfg: TextConfig, tp: int) -> TextConfig:
    """One shard's config: split head counts and intermediate size, the all-reduce axis set. The vocabulary
    stays global (the embedding is replicated; the local lm_head's width is read from its array)."""
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp, num_key_value_heads=cfg.num_key_value_heads // tp,
        linear_num_key_heads=cfg.linear_num_key_heads // tp,
        linear_num_value_heads=cfg.linear_num_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp, tp_axis=AXIS)


def _shard_major(parts: list[tuple[int, int]], tp: int) -> np.ndarray:
    """Column order of a fused axis made of `parts` (heads, width per head), concatenated part after part:
    new column -> old column, such that block i holds every part's heads [i*n/tp, (i+1)*n/tp)."""
    offsets = np.cumsum([0] + [n * w for n, w in parts])
    blocks = []
    for i in range(tp):
        for (n, w), off in zip(parts, offsets):
            lo, hi = i * (n // tp) * w, (i + 1) * (n // tp) * w
            blocks.append(off + np.arange(lo, hi))
    return np.concatenate(blocks)


def column_order(cfg: TextConfig, name: str, tp: int) -> np.ndarray | None:
    """The shard-major permutation of a fused parameter's split axis (None: no permutation needed)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    conv = [(hk, dk), (hk, dk), (hv, dv)]  # [q | k | v]
    if name == "w_qkv":
        hd = cfg.head_dim
        return _shard_major([(cfg.num_attention_heads, 2 * hd), (cfg.num_key_value_heads, hd),
                             (cfg.num_key_value_heads, hd)], tp)
    if name == "w_in":
        return _shard_major(conv + [(hv, dv), (hv, 1), (hv, 1)], tp)  # + z | b | a
    if name == "conv":
        return _shard_major(conv, tp)
    return None


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), AXIS)


def _name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    keys = [k for k in keys if k != "value"]
    return str(keys[-1])


def _axis(path) -> int | None:
    """The split axis of a leaf: its name's, one later under "groups" (stacked over the layer groups)."""
    axis = _SPLIT[_name(path)]
    stacked = any(getattr(k, "key", None) == "groups" for k in path)
    return None if axis is None else axis + stacked


def leaf_specs(state) -> list[P]:
    """PartitionSpecs of a Qwen35 state's leaves (flatten order)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = _name(path)
        if name not in _SPLIT:
            raise ValueError(f"tensor parallelism: no placement rule for parameter '{name}'")
        out.append(_spec(_axis(path)))
    return out


def cache_specs(cache: ModelCache) -> ModelCache:
    """KV cache [G, B, Hkv, S, hd] and GDN state [G, B, Hv, dk, dv] by heads, conv state [G, B, K-1, C] by
    channels (G: the layer groups, cache.py)."""
    groups = tuple(KVCache(k=P(None, None, AXIS), v=P(None, None, AXIS)) if isinstance(c, KVCache)
                   else GDNState(conv=P(None, None, None, AXIS), recurrent=P(None, None, AXIS)) for c in cache.groups)
    return ModelCache(groups=groups, length=P())


def _stash_spec(attention: bool):
    """A tree-pass stash [G, B, N, heads|channels, ...] (stacked over the layer groups): split on axis 3."""
    s = P(None, None, None, AXIS)
    return AttentionStash(k=s, v=s) if attention else GDNStash(k=s, W=s, g=s, x=s)


def commit_per_shard(commit, mesh: Mesh, cache: ModelCache, stashes, path, path_len) -> ModelCache:
    """`commit(cache, stashes, path, path_len)` (speculative/verify.py) run on each device's heads inside
    `jax.shard_map`: every step of a commit is per head / per conv channel, and the Pallas GDN commit kernel
    needs the local arrays (outside a shard_map XLA would gather the states to run it)."""
    stash_specs = tuple(_stash_spec(isinstance(s, AttentionStash)) for s in stashes)
    return jax.shard_map(commit, mesh=mesh, in_specs=(cache_specs(cache), stash_specs, P(), P()),
                         out_specs=cache_specs(cache), check_vma=False)(cache, stashes, path, path_len)


def shardings(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicate(tree, mesh: Mesh | None):
    """`tree` copied to every device of `mesh` (None: unchanged); e.g. the drafter's parameters."""
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


def _state_shardings(mesh: Mesh, tree):
    """Caches (`ModelCache` subtrees) split by heads, everything else replicated."""
    specs = jax.tree.map(lambda x: cache_specs(x) if isinstance(x, ModelCache) else P(), tree,
                         is_leaf=lambda x: isinstance(x, ModelCache))
    return shardings(mesh, specs)


def place(tree, mesh: Mesh | None):
    """Outside jit: put a state pytree (e.g. the decode loop's) on `mesh` as `constrain` lays it out, so that
    its first and later jitted calls see the same input shardings (one compilation)."""
    return tree if mesh is None else jax.device_put(tree, _state_shardings(mesh, tree))


def constrain(tree, mesh: Mesh | None):
    """Inside jit: the same layout as `place`, as a sharding constraint on a returned state."""
    return tree if mesh is None else jax.lax.with_sharding_constraint(tree, _state_shardings(mesh, tree))


def init_sharded_cache(cfg: TextConfig, mesh: Mesh, max_len: int, dtype, batch: int = 1) -> ModelCache:
    """`init_cache` of the global shapes, created directly in its shards."""
    make = lambda: init_cache(cfg, max_len, dtype, batch)
    return jax.jit(make, out_shardings=shardings(mesh, cache_specs(jax.eval_shape(make))))()


class TensorParallel(nnx.Module):
    """A `Qwen35` built from a local config whose parameters are the global (shard-major, sharded) arrays;
    calling it runs the local module per shard inside `jax.shard_map`. Same call signature and results
    as the unsharded model (logits vocab-sharded, caches and stashes head-sharded, features replicated)."""

    def __init__(self, inner: Qwen35, mesh: Mesh):
        self.inner = inner
        self.mesh = mesh

    @property
    def cfg(self) -> TextConfig:  # the local config
        return self.inner.cfg

    @property
    def embed(self):
        return self.inner.embed

    @property
    def lm_head(self):
        return self.inner.lm_head

    def __call__(self, tokens, cache: ModelCache, layout, feature_layers: tuple[int, ...] = (),
                 logits: str = "all"):
        graphdef, state = nnx.split(self.inner)
        leaves, treedef = jax.tree.flatten(state)

        def local(leaves, tokens, cache, layout):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            return model(tokens, cache, layout, feature_layers=feature_layers, logits=logits)

        out_specs = (None if logits == "none" else P(None, None, AXIS), cache_specs(cache),
                     P() if feature_layers else None,
                     tuple(_stash_spec(t == ATTENTION) for t in self.cfg.layer_types[:self.cfg.group_size])
                     if layout.is_tree else None)
        # check_vma=False: the Pallas kernels' out_shape carries no varying-axes type (jax 0.11.2 refuses a
        # pallas_call under check_vma=True); the features are replicated because every psum result is
        return jax.shard_map(local, mesh=self.mesh, in_specs=(leaf_specs(state), P(), cache_specs(cache), P()),
                             out_specs=out_specs, check_vma=False)(leaves, tokens, cache, layout)


def shard_leaves(cfg: TextConfig, dtype, treedef, leaves: list, tp: int, consume: bool = False):
    """An unsharded target's parameters (`treedef`, `leaves`) placed over the first tp > 1 devices ->
    (graphdef, treedef, leaves, mesh) of the `TensorParallel` model (`Target.shard` wraps it). `consume`:
    set each entry of `leaves` to None once placed (bounds the peak memory; the source is unusable after)."""
    check_tp(cfg, tp)
    src = jax.tree.unflatten(treedef, leaves)
    if any(isinstance(x, Fp8Weight) for x in jax.tree.leaves(src, is_leaf=lambda x: isinstance(x, Fp8Weight))):
        raise ValueError("tensor parallelism of FP8 checkpoints is not supported yet (load with tp=1)")
    mesh = make_mesh(tp)
    abstract = nnx.eval_shape(lambda: TensorParallel(Qwen35(local_config(cfg, tp), dtype, rngs=nnx.Rngs(0)), mesh))
    graphdef, state = nnx.split(abstract)
    src_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(src)[0]]
    dst_paths = [path[1:] for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]  # less "inner"
    if src_paths != dst_paths:
        raise ValueError("tensor parallelism: the target's parameters differ from the model's (already sharded?)")
    del src
    placed = []
    for i, (path, spec) in enumerate(zip(src_paths, leaf_specs(state))):
        name = _name(path)
        order = column_order(cfg, name, tp)
        x = leaves[i]
        if order is not None:
            x = jnp.take(x, jnp.asarray(order), axis=_axis(path))
        placed.append(jax.device_put(x, NamedSharding(mesh, spec)))
        if consume:
            leaves[i] = None
        del x
    return graphdef, jax.tree.structure(state), placed, mesh
