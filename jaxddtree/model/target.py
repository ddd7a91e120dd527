"""`Target`: the target model split once into a graph definition and parameter leaves, and the
jit-compiled pure functions over (leaves, cache) that every hot path uses (cache donated)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree.model import executables
from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.model.cache import ModelCache, init_cache
from jaxddtree.model.config import TextConfig
from jaxddtree.model.qwen35 import Qwen35

_SHARED: dict = {}  # Target.bind's callables by (graph definition, tree definition, dtype, mesh, key)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "bf16": jnp.bfloat16, "fp32": jnp.float32}


def default_kernels() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def as_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype '{dtype}' (use bfloat16 or float32)")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


@dataclasses.dataclass
class Target:
    config: TextConfig
    graphdef: Any
    treedef: Any
    leaves: list
    dtype: Any
    source: str = "random"
    # "pallas" (GPU kernels, the default on a GPU) | "xla" (jnp references, the default elsewhere); kernels_pallas.ops
    kernels: str = dataclasses.field(default_factory=lambda: default_kernels())
    # tensor parallelism (model/sharding.py): the 1-D "tp" mesh the leaves are split over; None: one device
    mesh: Any = None
    # callables bound to this target once (`bind`): jitted functions whose static parts (graph definition, tree
    # definition, plan) are closed over, so that a call passes only arrays (no per-call hashing of the graphdef)
    _bound: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.leaves = pad_projection_columns(self.treedef, self.leaves, self.dtype, self.mesh)

    def bind(self, key, make):
        """`make()` for `key`, built once and kept: e.g. a jitted round of one plan. Kept per target (a lookup by
        identity: no hashing of the graph definition per call) and shared by every target of equal graph
        definition, tree definition, dtype and mesh (e.g. a converted and an HF-loaded copy of one model: one
        compilation), found by one hashed lookup the first time a target needs `key`. The kernel path is part of
        every key (`kernels` may be changed after loading)."""
        key = (key, self.kernels)
        fn = self._bound.get(key)
        if fn is None:
            shared = (self.graphdef, self.treedef, jnp.dtype(self.dtype).name, self.mesh, key)
            fn = _SHARED.get(shared)
            if fn is None:
                fn = make()
                if hasattr(fn, "lower") and hasattr(fn, "_cache_size"):  # a jitted function: a storable Program
                    fn = executables.Program(fn, None if self.mesh is not None else repr(
                        (repr(self.graphdef), repr(self.treedef), jnp.dtype(self.dtype).name, key)))
                _SHARED[shared] = fn
            self._bound[key] = fn
        return fn

    @property
    def tp(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @classmethod
    def from_module(cls, model: Qwen35, dtype, source: str = "random") -> "Target":
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        return cls(config=model.cfg, graphdef=graphdef, treedef=treedef, leaves=leaves, dtype=dtype,
                   source=source)

    def module(self) -> Qwen35:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, self.leaves))

    @property
    def embedding(self) -> jax.Array:  # [V, D]
        return self.module().embed[...]

    @property
    def lm_head(self) -> jax.Array:  # [D, V]
        return self.module().lm_head[...]

    def shard(self, tp: int, consume: bool = False) -> "Target":
        """This (unsharded) target split over the first tp devices (tensor parallelism, model/sharding.py);
        tp = 1: itself. ValueError listing the valid values unless tp divides the head counts, the
        intermediate size and the vocab. `consume`: free this target's arrays as they are placed (it is
        unusable after; bounds the peak memory)."""
        sharding.check_tp(self.config, tp)
        if tp == 1:
            return self
        if self.mesh is not None:
            raise ValueError(f"this target is already split over {self.tp} devices")
        graphdef, treedef, leaves, mesh = sharding.shard_leaves(self.config, self.dtype, self.treedef, self.leaves,
                                                                tp, consume)
        return dataclasses.replace(self, graphdef=graphdef, treedef=treedef, leaves=leaves, mesh=mesh)

    def init_cache(self, max_len: int, batch: int = 1) -> ModelCache:
        """Zeroed caches for max_len positions, made on the device by one jitted call per shape."""
        if self.mesh is not None:
            return sharding.init_sharded_cache(self.config, self.mesh, max_len, self.dtype, batch)
        cfg, dtype = self.config, self.dtype  # (the bound callable must not keep this target alive)
        return self.bind(("init_cache", max_len, batch),
                         lambda: jax.jit(lambda: init_cache(cfg, max_len, dtype, batch)))()

    def cache_bytes(self, max_len: int) -> int:
        """Device bytes of `init_cache(max_len)` (all shards together)."""
        return self.bind(("cache_bytes", max_len), lambda: sum(
            x.size * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(jax.eval_shape(lambda: init_cache(self.config, max_len, self.dtype)))))

    def prefill(self, cache, tokens, num_valid=None, feature_layers=(), logits="last"):
        """tokens [B, T] continuing the cache (the first num_valid real, the rest padding) -> (logits,
        cache, features, None); the cache is donated. One compilation per (T, feature_layers, logits); the
        static parts are bound once per target (`bind`), so a call passes only arrays."""
        nv = jnp.int32(tokens.shape[1] if num_valid is None else num_valid)
        return self.prefill_fn(feature_layers, logits)(self.leaves, cache, tokens, nv)

    def prefill_fn(self, feature_layers=(), logits="last"):
        """The jitted prefill `prefill` calls: fn(leaves, cache, tokens, num_valid) (e.g. to compile it ahead)."""
        fl = tuple(feature_layers)
        return self.bind(("prefill", fl, logits), lambda: executables.OptionedJit(functools.partial(
            _prefill, graphdef=self.graphdef, treedef=self.treedef, feature_layers=fl, logits=logits,
            kernels=self.kernels), prefill_compiler_options(), donate_argnames=("cache",)))

    def prefill_many(self, caches, tokens, num_valid, feature_layers=(), logits="last"):
        """`prefill` of k requests in one pass: caches = k batch-1 caches stacked on a new leading axis, tokens
        [k, 1, T], num_valid [k] -> (logits, caches, features, None), each with the leading k axis; the caches are
        donated. jax.vmap over the k requests: each projection is one GEMM of k·T rows (`ops.fold_rows`), every
        request keeps its own positions and state. One compilation per (k, T, feature_layers, logits)."""
        fn = self.prefill_many_fn(feature_layers, logits)
        return fn(self.leaves, caches, tokens, jnp.asarray(num_valid, jnp.int32))

    def prefill_many_fn(self, feature_layers=(), logits="last"):
        """The jitted pass `prefill_many` calls: fn(leaves, caches, tokens, num_valid)."""
        fl = tuple(feature_layers)
        return self.bind(("prefill_many", fl, logits), lambda: executables.OptionedJit(jax.vmap(functools.partial(
            _prefill, graphdef=self.graphdef, treedef=self.treedef, feature_layers=fl, logits=logits,
            kernels=self.kernels), in_axes=(None, 0, 0, 0)), prefill_compiler_options(), donate_argnums=(1,)))


def prefill_compiler_options() -> dict | None:
    """XLA options of the prefill programs: on a GPU, every GEMM on cuBLAS (`xla_gpu_enable_triton_gemm` off), so
    that their compilation autotunes no Triton GEMM configs (most of a prefill program's compile time; the 2048-row
    chunks' GEMMs are cuBLAS's either way, BENCHMARKS.md session 17). The decode step and the rounds keep XLA's
    default (there Triton's small-row GEMMs win: session 19, `--xla_gpu_enable_triton_gemm=false` for every
    program cost the round 0.15 ms)."""
    return {"xla_gpu_enable_triton_gemm": False} if jax.default_backend() == "gpu" else None


PAD_COLUMNS = 64  # bf16 stacked projections are stored with their output columns padded to a multiple of this


def pad_projection_columns(treedef, leaves: list, dtype, mesh=None) -> list:
    """`leaves` with the bf16 stacked GDN input projections (`w_in` [G, D, C], C = conv_dim + Hv·dv + 2·Hv: 16480
    at 27B) padded with zero columns to a multiple of PAD_COLUMNS (16512): the bf16 wgmma GEMM of the verify
    (kernels_pallas/dense_mgpu.py) streams whole 64-column tiles of a stacked weight it reads in place
    (its TMA descriptor covers the whole array), and the GDN layer ignores the extra columns of its projection
    (0.2 % more bytes). Unchanged: other dtypes (FP8 weights keep b | a as their plain tail), tensor-parallel
    targets, already padded leaves."""
    if jnp.dtype(dtype) != jnp.bfloat16 or mesh is not None:
        return leaves
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, [0] * len(leaves)))[0]]
    out = list(leaves)
    for i, path in enumerate(paths):
        x = out[i]
        if ("['groups']" in path and re.search(r"\['mixer'\]\['w_in'\](\.value)?$", path) and getattr(x, "ndim", 0) == 3
                and x.dtype == jnp.bfloat16 and x.shape[-1] % PAD_COLUMNS):
            pad = -x.shape[-1] % PAD_COLUMNS
            out[i] = (jax.ShapeDtypeStruct(x.shape[:-1] + (x.shape[-1] + pad,), x.dtype)
                      if isinstance(x, jax.ShapeDtypeStruct) else jnp.pad(x, ((0, 0), (0, 0), (0, pad))))
    return out


def _prefill(leaves, cache, tokens, num_valid, *, graphdef, treedef, feature_layers, logits, kernels):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    lay = layout_lib.sequence(cache.length, tokens.shape[1], model.cfg.linear_conv_kernel_dim,
                              num_valid=num_valid, batch=tokens.shape[0], kernels=kernels)
    return model(tokens, cache, lay, feature_layers=feature_layers, logits=logits)


# The projections the Qwen3.6 FP8 release quantizes (issue 17): every layer's fused input / output projections
# and MLP; GDN w_in's trailing b | a columns (in_proj_b / in_proj_a), embed, lm_head, norms, conv, A_log, dt_bias
# stay in the compute dtype.
FP8_PROJECTIONS = ("w_in", "w_out", "w_qkv", "wo", "w_gate_up", "w_down")


def abstract_target(cfg: TextConfig, dtype) -> Target:
    """A target of cfg's shapes without weights (ShapeDtypeStruct leaves, uncommitted as loaded weights are), built as
    `checkpoint.params.target_from_params` builds a plain (bf16 / fp32) checkpoint's: its jitted programs are that
    target's (`Target.bind` shares them by graph and tree definition), so they can be compiled while the weights
    load (`speculative.loop.compile_call`)."""
    dt = as_dtype(dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35(cfg, dtype=dt, rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree.flatten(state)
    return Target(config=cfg, graphdef=graphdef, treedef=treedef, leaves=leaves, dtype=dt, source="abstract")


LEAFWISE_INIT_BYTES = 4 << 30  # random_target: larger (bf16) models are made leaf by leaf


def random_target(cfg: TextConfig, dtype="float32", seed: int = 0, weights: str = "bf16", tp: int = 1) -> Target:
    """A target with random weights. weights="fp8": the FP8_PROJECTIONS are `Fp8Weight`s (random e4m3 values,
    compact 128x128 block scales, GDN w_in's b | a as the plain tail; stacked over the layer groups). Either kind past
    LEAFWISE_INIT_BYTES (e.g. the 27B shapes) is made leaf by leaf on the device, each leaf by one jitted program,
    never materialising the model in float32 (H100, 2026-12-06: after the module's eager init of the 27B bf16 target
    its first program ran out of memory; float32 temporaries between the weights fragment the device allocator). Smaller models are the
    module's own init (the tests' values). `tp` > 1 splits the (bf16) weights over the first tp devices
    (model/sharding.py)."""
    sharding.check_tp(cfg, tp)
    dt = as_dtype(dtype)
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"unknown weights '{weights}' (bf16 or fp8)")
    if weights == "fp8" and tp > 1:
        raise ValueError("tensor parallelism of FP8 weights is not supported yet (use tp=1)")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35(cfg, dtype=dt, rngs=nnx.Rngs(seed))))
    size = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    if weights == "bf16" and (tp > 1 or size < LEAFWISE_INIT_BYTES):
        return Target.from_module(Qwen35(cfg, dtype=dt, rngs=nnx.Rngs(seed)), dt).shard(tp, consume=True)
    fp8 = weights == "fp8"
    from jaxddtree.model import fp8 as fp8_weight
    from kernels_pallas.w8a8_mgpu import scale_cols

    pure = nnx.to_pure_dict(state)
    key = jax.random.key(seed)

    def leaves(d, prefix=()):
        for k, v in d.items():
            yield from leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), d, v.shape)]

    # each large leaf is made by one jitted (fused) program: no full-size temporaries, whose holes would fragment
    # the device allocator (the benchmarks read its peak)
    fp8_q = jax.jit(lambda k, shp: jnp.clip(jax.random.normal(k, shp, dt) * 64, -448, 448).astype(fp8_weight.FP8),
                    static_argnums=1)
    scaled_normal = jax.jit(lambda k, shp, std: (jax.random.normal(k, shp, jnp.float32) * std).astype(dt),
                            static_argnums=(1, 2))
    for i, (path, node, shape) in enumerate(list(leaves(pure))):  # node[name]: the parameter's slot in `pure`
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        name = path[-1]
        normal = lambda shp=shape: jax.random.normal(k1, shp, dt)
        if fp8 and path[0] == "groups" and name in FP8_PROJECTIONS:  # stacked over the layer groups: [G, ...]
            G, shape = shape[0], shape[1:]
            nc = 2 if name in ("wo", "w_out") else 1
            K = math.prod(shape[:nc])
            n_tail = 2 * cfg.linear_num_value_heads if name == "w_in" else 0
            N = math.prod(shape[nc:]) - n_tail
            q = fp8_q(k1, (G, N, K))  # [G, N, K]: the checkpoint's layout per layer
            nb = -(-K // 128)
            scale = jax.random.uniform(k2, (G, -(-N // 128), nb), jnp.float32, 0.5, 1.5) / (64 * K ** 0.5)
            scale = jnp.pad(scale, ((0, 0), (0, 0), (0, scale_cols(nb) - nb)))
            tail = (jax.random.normal(k2, (G, K, n_tail), dt) * K ** -0.5).astype(dt) if n_tail else None
            node[name] = fp8_weight.Fp8Weight(q=q, scale=scale, tail=tail, block_in=128, block_out=128,
                                              shape=tuple(shape))
        elif name == "dt_bias":
            node[name] = jax.random.uniform(k1, shape, dt, -1, 1)
        elif name == "A_log":
            node[name] = jnp.log(jax.random.uniform(k1, shape, jnp.float32, 1, 16)).astype(dt)
        elif path[-2:] == ("mixer", "norm"):  # GDN gated norm: a plain weight
            node[name] = (1 + 0.1 * normal()).astype(dt)
        elif "norm" in name:  # (1 + w) RMSNorms, q/k norms
            node[name] = (0.1 * normal()).astype(dt)
        else:  # embed (std 1), projections, conv: std 1/sqrt(fan_in) as the module's init (a stacked leaf's fan-in:
            # its axis 1; wo / w_out [G, H, hd, D]: H·hd)
            fan_in = shape[0] if path[0] != "groups" else math.prod(shape[1:3]) if name in ("wo", "w_out") else shape[1]
            node[name] = scaled_normal(k1, tuple(shape), 1.0 if name == "embed" else float(fan_in ** -0.5))
    nnx.replace_by_pure_dict(state, pure)
    return Target.from_module(nnx.merge(graphdef, state), dt)
