"""Parameters from a checkpoint into a `Target`: a {param path: array} mapping fills the model's abstract
parameter tree, with every shape checked and every parameter required."""

from __future__ import annotations

import jax
from flax import nnx

from jaxddtree.model.config import TextConfig
from jaxddtree.model.qwen35 import Qwen35
from jaxddtree.model.target import Target


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and tensor."""


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
