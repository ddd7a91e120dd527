"""HF safetensors -> target parameters: a regex key map with shape asserts and a strict coverage check.

Accepts the multimodal wrapper layout (`model.language_model.*`, Qwen3.6-27B as shipped) and the
text-only layout (`model.*`), single-file or sharded (`model.safetensors.index.json`). `model.visual.*`
and `mtp.*` tensors are skipped. Tensors are read one at a time, moved to the device and cast there, so
host memory stays near the size of the largest tensor.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from jaxddtree.checkpoint.params import CheckpointError
from jaxddtree.model.config import ATTENTION, GDN, TextConfig


SKIP = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.|visual\.)")
PREFIXES = ("model.language_model.", "model.")


def _rules(c: TextConfig):
    """(regex on the stripped name, layer type or None, param path template, HF shape, transform)."""
    D, V, F = c.hidden_size, c.vocab_size, c.intermediate_size
    H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hv, dv, K = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    T = lambda x: x.T
    return [
        (r"embed_tokens\.weight", None, ("embed",), (V, D), None),
        (r"norm\.weight", None, ("final_norm", "weight"), (D,), None),
        (r"lm_head\.weight", None, ("lm_head",), (V, D), T),
        (r"layers\.(\d+)\.input_layernorm\.weight", "*", ("input_norm", "weight"), (D,), None),
        (r"layers\.(\d+)\.post_attention_layernorm\.weight", "*", ("post_norm", "weight"), (D,), None),
        (r"layers\.(\d+)\.mlp\.gate_proj\.weight", "*", ("mlp", "w_gate"), (F, D), T),
        (r"layers\.(\d+)\.mlp\.up_proj\.weight", "*", ("mlp", "w_up"), (F, D), T),
        (r"layers\.(\d+)\.mlp\.down_proj\.weight", "*", ("mlp", "w_down"), (D, F), T),
        (r"layers\.(\d+)\.self_attn\.q_proj\.weight", ATTENTION, ("mixer", "wq"), (H * 2 * hd, D),
         lambda x: x.T.reshape(D, H, 2 * hd)),
        (r"layers\.(\d+)\.self_attn\.k_proj\.weight", ATTENTION, ("mixer", "wk"), (Hkv * hd, D),
         lambda x: x.T.reshape(D, Hkv, hd)),
        (r"layers\.(\d+)\.self_attn\.v_proj\.weight", ATTENTION, ("mixer", "wv"), (Hkv * hd, D),
         lambda x: x.T.reshape(D, Hkv, hd)),
        (r"layers\.(\d+)\.self_attn\.o_proj\.weight", ATTENTION, ("mixer", "wo"), (D, H * hd),
         lambda x: x.T.reshape(H, hd, D)),
        (r"layers\.(\d+)\.self_attn\.q_norm\.weight", ATTENTION, ("mixer", "q_norm"), (hd,), None),
        (r"layers\.(\d+)\.self_attn\.k_norm\.weight", ATTENTION, ("mixer", "k_norm"), (hd,), None),
        (r"layers\.(\d+)\.linear_attn\.in_proj_qkv\.weight", GDN, ("mixer", "w_qkv"), (c.conv_dim, D), T),
        (r"layers\.(\d+)\.linear_attn\.in_proj_z\.weight", GDN, ("mixer", "w_z"), (Hv * dv, D),
         lambda x: x.T.reshape(D, Hv, dv)),
        (r"layers\.(\d+)\.linear_attn\.in_proj_b\.weight", GDN, ("mixer", "w_b"), (Hv, D), T),
        (r"layers\.(\d+)\.linear_attn\.in_proj_a\.weight", GDN, ("mixer", "w_a"), (Hv, D), T),
        (r"layers\.(\d+)\.linear_attn\.conv1d\.weight", GDN, ("mixer", "conv"), (c.conv_dim, 1, K),
         lambda x: x[:, 0, :].T),
        (r"layers\.(\d+)\.linear_attn\.dt_bias", GDN, ("mixer", "dt_bias"), (Hv,), None),
        (r"layers\.(\d+)\.linear_attn\.A_log", GDN, ("mixer", "A_log"), (Hv,), None),
        (r"layers\.(\d+)\.linear_attn\.norm\.weight", GDN, ("mixer", "norm"), (dv,), None),
        (r"layers\.(\d+)\.linear_attn\.out_proj\.weight", GDN, ("mixer", "w_out"), (D, Hv * dv),
         lambda x: x.T.reshape(Hv, dv, D)),
    ]


def expected_paths(c: TextConfig) -> set[tuple]:
    """Every parameter path the model needs."""
    out = set()
    for pattern, kind, path, _, _ in _rules(c):
        if kind is None:
            out.add(path)
        else:
            for i, t in enumerate(c.layer_types):
                if kind == "*" or kind == t:
                    out.add(("layers", i) + path)
    return out


def map_name(c: TextConfig, name: str, rules=None):
    """HF tensor name -> (param path, HF shape, transform), None if skipped; CheckpointError if unknown."""
    if SKIP.match(name):
        return None
    stripped = name
    if name != "lm_head.weight":
        for p in PREFIXES:
            if name.startswith(p):
                stripped = name[len(p):]
                break
        else:
            raise CheckpointError(f"unexpected tensor '{name}' (not a Qwen3.5/3.6 text tensor)")
    for pattern, kind, path, shape, fn in rules or _rules(c):
        m = re.fullmatch(pattern, stripped)
        if not m:
            continue
        if kind is None:
            return path, shape, fn
        i = int(m.group(1))
        if i >= c.num_hidden_layers:
            raise CheckpointError(f"tensor '{name}' is for layer {i}, but the config has "
                                  f"{c.num_hidden_layers} layers")
        if kind != "*" and c.layer_types[i] != kind:
            raise CheckpointError(f"tensor '{name}' belongs to a {kind} layer, but config.layer_types[{i}] "
                                  f"is {c.layer_types[i]}")
        return ("layers", i) + path, shape, fn
    raise CheckpointError(f"unexpected tensor '{name}' (no rule maps it)")


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, for a single-file or sharded HF directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("'weight_map' is not an object of tensor name -> file name")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e!r})") from None
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    out = {}
    for fname in files:
        full = os.path.join(path, fname)
        for k in _open(full).keys():
            out[k] = full
    return out


def _open(file: str):
    if not os.path.exists(file):
        raise CheckpointError(f"{file}: missing shard")
    try:
        return safetensors.safe_open(file, framework="numpy")
    except Exception as e:  # truncated or corrupt header
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def plan_tensors(c: TextConfig, path: str) -> list[tuple]:
    """The checkpoint's tensors as [(param path, tensor name, file, HF shape, transform or None)], sorted by
    (file, name), after the key map, duplicate and coverage checks (shapes are checked when read)."""
    files = checkpoint_files(path)
    rules = _rules(c)
    plan = {}
    for name, file in files.items():
        m = map_name(c, name, rules)
        if m is not None:
            if m[0] in plan:
                raise CheckpointError(f"tensor '{name}' ({file}) maps to a parameter already provided by "
                                      f"'{plan[m[0]][0]}'")
            plan[m[0]] = (name, file, m[1], m[2])
    missing = expected_paths(c) - set(plan)
    if missing:
        p = sorted(missing, key=str)[0]
        raise CheckpointError(f"{path}: checkpoint lacks the tensor for parameter {'.'.join(map(str, p))} "
                              f"({len(missing)} missing in all)")
    return sorted(((p, *v) for p, v in plan.items()), key=lambda e: (e[2], e[1]))


def iter_tensors(plan: list[tuple]) -> Iterator[tuple[tuple, np.ndarray, Callable | None, str, str]]:
    """Yield (param path, host array, transform, tensor name, file) for `plan_tensors`' entries one tensor
    at a time, after the shape assert; raises CheckpointError for unreadable/misshapen tensors."""
    by_file: dict[str, list] = {}
    for p, name, file, shape, fn in plan:
        by_file.setdefault(file, []).append((p, name, shape, fn))
    for file in sorted(by_file):
        with _open(file) as f:
            for p, name, shape, fn in sorted(by_file[file], key=lambda e: e[1]):
                try:
                    arr = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{file}: cannot read tensor '{name}' ({e})") from None
                if tuple(arr.shape) != tuple(shape):
                    raise CheckpointError(f"{file}: tensor '{name}' has shape {tuple(arr.shape)}, "
                                          f"expected {tuple(shape)}")
                yield p, arr, fn, name, file


def load_params(c: TextConfig, path: str, dtype, progress: bool = False) -> dict[tuple, jax.Array]:
    """param path -> device array in `dtype`, tensor by tensor; `progress`: a tqdm bar (tensors) on stderr."""
    from tqdm.auto import tqdm

    plan = plan_tensors(c, path)
    out = {}
    with tqdm(total=len(plan), unit=" tensors", desc=f"loading {os.path.basename(os.path.normpath(path))}",
              disable=not progress, dynamic_ncols=True) as bar:
        for p, arr, fn, _, _ in iter_tensors(plan):
            x = jax.device_put(arr)
            x = (fn(x) if fn is not None else x).astype(dtype)
            out[p] = x
            bar.update()
            del arr
    return out
