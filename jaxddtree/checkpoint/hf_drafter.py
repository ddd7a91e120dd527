"""DFlash drafter checkpoints in the z-lab (HF safetensors) layout: the key map (HF name -> `DrafterParams`
field, torch shape, transform into our layout) and a strict loader (no missing, no unexpected tensor, exact
shapes)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy 'bfloat16' so safetensors can return BF16 tensors)

from jaxddtree.model.drafter import DrafterLayer, DrafterParams
from jaxddtree.model.drafter_config import DrafterConfig

# HF name (after an optional "model." prefix) -> (field, torch shape fn(cfg), to-JAX transform).
_GLOBAL = {
    "fc.weight": ("fc", lambda c: (c.hidden_size, c.num_target_features * c.hidden_size), lambda w, c: w.T),
    "hidden_norm.weight": ("hidden_norm", lambda c: (c.hidden_size,), lambda w, c: w),
    "norm.weight": ("norm", lambda c: (c.hidden_size,), lambda w, c: w),
}
_LAYER = {
    "input_layernorm.weight": ("attn_norm", lambda c: (c.hidden_size,), lambda w, c: w),
    "post_attention_layernorm.weight": ("mlp_norm", lambda c: (c.hidden_size,), lambda w, c: w),
    "self_attn.q_proj.weight": ("wq", lambda c: (c.num_heads * c.head_dim, c.hidden_size),
                                lambda w, c: w.reshape(c.num_heads, c.head_dim, -1).transpose(2, 0, 1)),
    "self_attn.k_proj.weight": ("wk", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
                                lambda w, c: w.reshape(c.num_kv_heads, c.head_dim, -1).transpose(2, 0, 1)),
    "self_attn.v_proj.weight": ("wv", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
                                lambda w, c: w.reshape(c.num_kv_heads, c.head_dim, -1).transpose(2, 0, 1)),
    "self_attn.o_proj.weight": ("wo", lambda c: (c.hidden_size, c.num_heads * c.head_dim),
                                lambda w, c: w.reshape(-1, c.num_heads, c.head_dim).transpose(1, 2, 0)),
    "self_attn.q_norm.weight": ("q_norm", lambda c: (c.head_dim,), lambda w, c: w),
    "self_attn.k_norm.weight": ("k_norm", lambda c: (c.head_dim,), lambda w, c: w),
    "mlp.gate_proj.weight": ("w_gate", lambda c: (c.intermediate_size, c.hidden_size), lambda w, c: w.T),
    "mlp.up_proj.weight": ("w_up", lambda c: (c.intermediate_size, c.hidden_size), lambda w, c: w.T),
    "mlp.down_proj.weight": ("w_down", lambda c: (c.hidden_size, c.intermediate_size), lambda w, c: w.T),
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors or model.safetensors.index.json."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            wm = json.load(f).get("weight_map")
        if not isinstance(wm, dict):
            raise ValueError(f"{index}: no 'weight_map' dict")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="numpy") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_drafter_params(path: str, cfg: DrafterConfig, dtype: Any = "bfloat16") -> DrafterParams:
    """Load every drafter tensor (strict: no missing, no unexpected, exact shapes), cast to `dtype`."""
    from safetensors import safe_open

    dtype = jnp.dtype(dtype)
    files = _checkpoint_files(path)
    slots: dict[tuple[int, str], tuple[str, Any]] = {}  # (layer or -1, hf suffix) -> (full name, file)
    for name, fname in files.items():
        short = name[len("model."):] if name.startswith("model.") else name
        m = _LAYER_RE.match(short)
        key = (int(m.group(1)), m.group(2)) if m else (-1, short)
        known = (key[1] in _LAYER and 0 <= key[0] < cfg.num_layers) if m else key[1] in _GLOBAL
        if not known:
            raise ValueError(f"unexpected tensor '{name}' in {fname} (not a drafter weight for a "
                             f"{cfg.num_layers}-layer DFlash drafter)")
        if key in slots:
            raise ValueError(f"tensor '{name}' in {fname} duplicates '{slots[key][0]}' in {slots[key][1]}")
        slots[key] = (name, fname)

    needed = [(-1, k) for k in _GLOBAL] + [(i, k) for i in range(cfg.num_layers) for k in _LAYER]
    missing = [("" if i < 0 else f"layers.{i}.") + k for i, k in needed if (i, k) not in slots]
    if missing:
        raise ValueError(f"drafter checkpoint {path} is missing {len(missing)} tensor(s): {missing}")

    handles: dict[str, Any] = {}

    def get(key):
        name, fname = slots[key]
        field, shape_fn, transform = (_LAYER if key[0] >= 0 else _GLOBAL)[key[1]]
        if fname not in handles:
            handles[fname] = safe_open(fname, framework="numpy")
        if name not in handles[fname].keys():
            raise ValueError(f"tensor '{name}' listed in the index is absent from {fname}")
        w = handles[fname].get_tensor(name)
        if tuple(w.shape) != shape_fn(cfg):
            raise ValueError(f"tensor '{name}' in {fname} has shape {tuple(w.shape)}, expected "
                             f"{shape_fn(cfg)} for this config")
        return field, jnp.asarray(transform(w, cfg), dtype=dtype)

    glob = dict(get((-1, k)) for k in _GLOBAL)
    layers = tuple(DrafterLayer(**dict(get((i, k)) for k in _LAYER)) for i in range(cfg.num_layers))
    return DrafterParams(layers=layers, **glob)
