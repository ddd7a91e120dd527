"""Parameters from a checkpoint into a `Target`: a {param path: array} mapping fills the model's abstract
parameter tree, with every shape checked and every parameter required."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxddtree.model.config import TextConfig
from jaxddtree.model.qwen35 import Qwen35
from jaxddtree.model.target import Target


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and tensor."""


def _get_path(state, path: tuple):
    node = state
    for key in path:
        node = node[key]
    return node


def _set_path(state, path: tuple, value):
    node = _get_path(state, path[:-1])
    leaf = node[path[-1]]
    if tuple(leaf.shape) != tuple(value.shape):
        raise CheckpointError(f"parameter {'.'.join(map(str, path))}: got shape {tuple(value.shape)}, "
                              f"model expects {tuple(leaf.shape)}")
    node[path[-1]] = value


def target_from_params(cfg: TextConfig, params: dict, dtype, source: str) -> Target:
    """Build a Target from a {param path: array} mapping that covers every parameter. Per-layer paths
    ("layers", i, ...) (the checkpoints' layout) are shape-checked per layer, then stacked per layer-group
    position into the model's ("groups", j, ...) [G, ...] (`Qwen35`); `params` is consumed as they are."""
    abstract = nnx.eval_shape(lambda: Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    p, G = cfg.group_size, cfg.num_groups
    per = {}
    for path in [k for k in params if k[0] == "layers"]:
        i = path[1]
        if not (isinstance(i, int) and 0 <= i < cfg.num_hidden_layers):
            raise CheckpointError(f"parameter {'.'.join(map(str, path))}: no layer {i} in a "
                                  f"{cfg.num_hidden_layers}-layer model")
        group_path = ("groups", i % p) + path[2:]
        try:
            leaf = _get_path(pure, group_path)
        except KeyError:
            raise CheckpointError(f"unexpected parameter {'.'.join(map(str, path))}") from None
        if tuple(leaf.shape[1:]) != tuple(params[path].shape):
            raise CheckpointError(f"parameter {'.'.join(map(str, path))}: got shape {tuple(params[path].shape)}, "
                                  f"model expects {tuple(leaf.shape[1:])}")
        per.setdefault(group_path, {})[i // p] = path
    for group_path, idx in per.items():
        if len(idx) == G:  # (a missing layer leaves the leaf unfilled: reported below)
            values = [params.pop(idx[g]) for g in range(G)]
            _get_path(pure, group_path[:-1])[group_path[-1]] = jax.tree.map(lambda *xs: jnp.stack(xs), *values)
            del values
    for path, value in params.items():
        if path[0] != "layers":
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
