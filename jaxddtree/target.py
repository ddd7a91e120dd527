"""`Target`: the target model split once into a graph definition and parameter leaves, and the
jit-compiled pure functions over (leaves, cache) that every hot path uses (cache donated)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree import layout as layout_lib
from jaxddtree.cache import ModelCache, init_cache
from jaxddtree.config import TextConfig, load_config
from jaxddtree.loading import CheckpointError, load_params
from jaxddtree.model import Qwen35

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
    # "pallas" (GPU kernels, the default on a GPU) | "xla" (jnp references, the default elsewhere); jaxddtree.ops
    kernels: str = dataclasses.field(default_factory=lambda: default_kernels())

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

    def init_cache(self, max_len: int, batch: int = 1) -> ModelCache:
        return init_cache(self.config, max_len, self.dtype, batch)

    def prefill(self, cache, tokens, num_valid=None, feature_layers=(), logits="last"):
        """tokens [B, T] continuing the cache (the first num_valid real, the rest padding) -> (logits,
        cache, features, None); the cache is donated. One compilation per (T, feature_layers, logits)."""
        nv = jnp.int32(tokens.shape[1] if num_valid is None else num_valid)
        return _prefill(self.leaves, cache, tokens, nv, graphdef=self.graphdef, treedef=self.treedef,
                        feature_layers=tuple(feature_layers), logits=logits, kernels=self.kernels)


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "feature_layers", "logits", "kernels"),
                   donate_argnames=("cache",))
def _prefill(leaves, cache, tokens, num_valid, *, graphdef, treedef, feature_layers, logits, kernels):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    lay = layout_lib.sequence(cache.length, tokens.shape[1], model.cfg.linear_conv_kernel_dim,
                              num_valid=num_valid, batch=tokens.shape[0], kernels=kernels)
    return model(tokens, cache, lay, feature_layers=feature_layers, logits=logits)


def random_target(cfg: TextConfig, dtype="float32", seed: int = 0) -> Target:
    dt = as_dtype(dtype)
    return Target.from_module(Qwen35(cfg, dtype=dt, rngs=nnx.Rngs(seed)), dt)


def _set_path(state, path: tuple, value):
    node = state
    for key in path[:-1]:
        node = node[key]
    leaf = node[path[-1]]
    if tuple(leaf.shape) != tuple(value.shape):
        raise CheckpointError(f"parameter {'.'.join(map(str, path))}: got shape {tuple(value.shape)}, "
                              f"model expects {tuple(leaf.shape)}")
    node[path[-1]] = value


def target_from_params(cfg: TextConfig, params: dict, dtype, source: str) -> Target:
    """Build a Target from a {param path: array} mapping that covers every parameter."""
    abstract = nnx.eval_shape(lambda: Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    for path, value in params.items():
        _set_path(pure, path, value)
    left = [p for p, leaf in _flatten_pure(pure) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if left:
        raise CheckpointError(f"no value for parameter {'.'.join(map(str, left[0]))} "
                              f"({len(left)} unfilled)")
    nnx.replace_by_pure_dict(state, pure)
    leaves, treedef = jax.tree.flatten(state)
    return Target(config=cfg, graphdef=graphdef, treedef=treedef, leaves=leaves, dtype=dtype, source=source)


def _flatten_pure(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten_pure(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def load_target(path: str, dtype="bfloat16", progress: bool = False) -> Target:
    """Load a Qwen3.5/3.6 checkpoint: an HF directory (config.json + safetensors, wrapper or text-only,
    single or sharded) or a directory written by `python -m convert`. `progress`: a bar on stderr while an HF
    directory's tensors load."""
    dt = as_dtype(dtype)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    from jaxddtree import orbax_io  # converted checkpoints
    if orbax_io.is_converted(path):
        return orbax_io.restore_target(path, dt)
    cfg = load_config(path)
    return target_from_params(cfg, load_params(cfg, path, dt, progress=progress), dt, source=path)
