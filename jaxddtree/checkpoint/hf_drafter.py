"""DFlash drafter checkpoints in the z-lab (HF safetensors) layout: the key map (`DrafterParams` field -> its HF
tensors with their torch shapes, stacked along the output axis, and one transform into our layout) and a strict
loader (no missing, no unexpected, no duplicate tensor, exact shapes, every tensor used once)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import ml_dtypes  # noqa: F401  (registers numpy 'bfloat16' so safetensors can return BF16 tensors)

from jaxddtree.model.drafter import DrafterLayer, DrafterParams
from jaxddtree.model.drafter_config import DrafterConfig

# field -> (parts: ((HF name after an optional "model." / "layers.{i}." prefix, torch shape fn(cfg)), ...),
#           to-JAX transform of the parts stacked along their first (output) axis, in this order).
# Fused like the target's (jaxddtree.checkpoint.hf_target): w_qkv = [q_proj | k_proj | v_proj] columns,
# w_gate_up [H, 2, I] (gate = [:, 0], up = [:, 1]).
_GLOBAL = {
    "fc": ((("fc.weight", lambda c: (c.hidden_size, c.num_target_features * c.hidden_size)),), lambda w, c: w.T),
    "hidden_norm": ((("hidden_norm.weight", lambda c: (c.hidden_size,)),), lambda w, c: w),
    "norm": ((("norm.weight", lambda c: (c.hidden_size,)),), lambda w, c: w),
}
_LAYER = {
    "attn_norm": ((("input_layernorm.weight", lambda c: (c.hidden_size,)),), lambda w, c: w),
    "w_qkv": ((("self_attn.q_proj.weight", lambda c: (c.num_heads * c.head_dim, c.hidden_size)),
               ("self_attn.k_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size)),
               ("self_attn.v_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size))),
              lambda w, c: w.T),
    "wo": ((("self_attn.o_proj.weight", lambda c: (c.hidden_size, c.num_heads * c.head_dim)),),
           lambda w, c: w.reshape(-1, c.num_heads, c.head_dim).transpose(1, 2, 0)),
    "q_norm": ((("self_attn.q_norm.weight", lambda c: (c.head_dim,)),), lambda w, c: w),
    "k_norm": ((("self_attn.k_norm.weight", lambda c: (c.head_dim,)),), lambda w, c: w),
    "mlp_norm": ((("post_attention_layernorm.weight", lambda c: (c.hidden_size,)),), lambda w, c: w),
    "w_gate_up": ((("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
                   ("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size))),
                  lambda w, c: w.T.reshape(c.hidden_size, 2, c.intermediate_size)),
    "w_down": ((("mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),), lambda w, c: w.T),
}
# HF name -> (field, index of the part) for each table
_HF_LAYER = {name: (field, j) for field, (parts, _) in _LAYER.items() for j, (name, _) in enumerate(parts)}
_HF_GLOBAL = {name: (field, j) for field, (parts, _) in _GLOBAL.items() for j, (name, _) in enumerate(parts)}


def stacked_shape(parts, cfg) -> tuple:
    """Shape of the parts' torch tensors stacked along axis 0 (the single part's shape when not fused)."""
    shapes = [tuple(fn(cfg)) for _, fn in parts]
    return shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes),) + shapes[0][1:]


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
    """Load every drafter tensor (strict: no missing, no unexpected, no duplicate tensor, exact shapes; every
    tensor used once), fused parameters stacked in `_LAYER`'s order, cast to `dtype`."""
    from safetensors import safe_open

    dtype = jnp.dtype(dtype)
    files = _checkpoint_files(path)
    slots: dict[tuple[int, str, int], tuple[str, Any]] = {}  # (layer or -1, field, part) -> (full name, file)
    for name, fname in files.items():
        short = name[len("model."):] if name.startswith("model.") else name
        m = _LAYER_RE.match(short)
        if m:
            i, hit = int(m.group(1)), _HF_LAYER.get(m.group(2))
            hit = hit if i < cfg.num_layers else None
        else:
            i, hit = -1, _HF_GLOBAL.get(short)
        if hit is None:
            raise ValueError(f"unexpected tensor '{name}' in {fname} (not a drafter weight for a "
                             f"{cfg.num_layers}-layer DFlash drafter)")
        key = (i, *hit)
        if key in slots:
            raise ValueError(f"tensor '{name}' in {fname} duplicates '{slots[key][0]}' in {slots[key][1]}")
        slots[key] = (name, fname)

    needed = [(-1, f, j, n) for f, (parts, _) in _GLOBAL.items() for j, (n, _) in enumerate(parts)] + [
        (i, f, j, f"layers.{i}.{n}") for i in range(cfg.num_layers) for f, (parts, _) in _LAYER.items()
        for j, (n, _) in enumerate(parts)]
    missing = [n for i, f, j, n in needed if (i, f, j) not in slots]
    if missing:
        raise ValueError(f"drafter checkpoint {path} is missing {len(missing)} tensor(s): {missing}")
    assert len(slots) == len(needed), "every tensor is used exactly once"

    handles: dict[str, Any] = {}

    def get(i, field):
        parts, transform = (_LAYER if i >= 0 else _GLOBAL)[field]
        ws = []
        for j, (_, shape_fn) in enumerate(parts):
            name, fname = slots[(i, field, j)]
            if fname not in handles:
                handles[fname] = safe_open(fname, framework="numpy")
            if name not in handles[fname].keys():
                raise ValueError(f"tensor '{name}' listed in the index is absent from {fname}")
            w = handles[fname].get_tensor(name)
            if tuple(w.shape) != shape_fn(cfg):
                fused = f" (part {j} of the fused '{field}')" if len(parts) > 1 else ""
                raise ValueError(f"tensor '{name}' in {fname} has shape {tuple(w.shape)}, expected "
                                 f"{shape_fn(cfg)} for this config{fused}")
            ws.append(w)
        w = ws[0] if len(ws) == 1 else np.concatenate(ws, axis=0)
        return field, jnp.asarray(transform(w, cfg), dtype=dtype)

    glob = dict(get(-1, f) for f in _GLOBAL)
    layers = tuple(DrafterLayer(**dict(get(i, f) for f in _LAYER)) for i in range(cfg.num_layers))
    return DrafterParams(layers=layers, **glob)
