"""DFlash drafter config: parse and validate an HF `config.json` (Qwen3 config + DFlash fields).

Mirrors what z-lab/dflash `dflash/model.py` (via transformers' `Qwen3Config`) reads:
  * `target_layer_ids = dflash_config.target_layer_ids`, else `build_target_layer_ids(num_target_layers,
    num_hidden_layers)`.
  * `layer_types`: per-layer "sliding_attention" / "full_attention". When absent, Qwen3Config's rule:
    sliding iff `use_sliding_window` and `i >= max_window_layers`.
  * Qwen3Config sets `sliding_window = None` unless `use_sliding_window` is true, so a "sliding_attention"
    layer only gets a window when `use_sliding_window` is true (the published Qwen3.6 drafter sets it).
  * RoPE: default rope only (`rope_theta` or `rope_parameters.rope_theta`, default 10000 like HF).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

_LAYER_TYPES = ("sliding_attention", "full_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers: n == 1 -> [L // 2]; else round(1 + i (L - 4) / (n - 1)), i < n (Python round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static (hashable) drafter hyper-parameters; safe as a `jax.jit` static argument."""

    hidden_size: int  # H (== target hidden size)
    num_layers: int  # nL
    num_heads: int  # nh
    num_kv_heads: int  # nkv
    head_dim: int  # hd
    intermediate_size: int  # I
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # Bs
    target_layer_ids: tuple[int, ...]  # nT entries, 0-based target decoder-layer indices
    mask_token_id: int
    vocab_size: int | None  # as written in the drafter config (the drafter has no embedding of its own)
    num_target_layers: int | None
    layer_windows: tuple[int | None, ...]  # per layer: sliding window w, or None for full attention

    @property
    def num_target_features(self) -> int:  # nT
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        def err(msg: str) -> ValueError:
            return ValueError(f"{source}: {msg}")

        def req_int(key: str, container: dict[str, Any] = d, lo: int = 1) -> int:
            if key not in container or container[key] is None:
                raise err(f"missing required field '{key}'")
            v = container[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise err(f"field '{key}' must be an integer >= {lo}, got {v!r}")
            return v

        H = req_int("hidden_size")
        nL = req_int("num_hidden_layers")
        nh = req_int("num_attention_heads")
        nkv = d.get("num_key_value_heads") or nh
        if not isinstance(nkv, int) or nkv < 1 or nh % nkv:
            raise err(f"num_key_value_heads={nkv!r} must be a positive divisor of num_attention_heads={nh}")
        hd = req_int("head_dim")
        if hd % 2:
            raise err(f"head_dim={hd} must be even (rotate_half RoPE)")
        I = req_int("intermediate_size")
        Bs = req_int("block_size", lo=2)
        eps = float(d.get("rms_norm_eps", 1e-6))
        if not eps > 0:
            raise err(f"rms_norm_eps must be > 0, got {eps}")

        if d.get("attention_bias", False):
            raise err("attention_bias=true is not supported (DFlash drafters have bias-free projections)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise err(f"hidden_act={act!r} is not supported (only 'silu', Qwen3MLP SwiGLU)")

        # --- RoPE: default rope only.
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")
        for key, rp in (("rope_scaling", d.get("rope_scaling")), ("rope_parameters", rope_params)):
            if rp is None:
                continue
            if not isinstance(rp, dict):
                raise err(f"{key} must be a dict or null, got {rp!r}")
            kind = rp.get("rope_type", rp.get("type", "default"))
            if kind != "default":
                raise NotImplementedError(
                    f"{source}: {key} with rope_type={kind!r} is not implemented (only default RoPE): {rp}")
            if rp.get("partial_rotary_factor", 1.0) != 1.0:
                raise NotImplementedError(f"{source}: {key}.partial_rotary_factor != 1 is not implemented: {rp}")
        if rope_params is not None and rope_params.get("rope_theta") is not None:
            if rope_theta is not None and float(rope_theta) != float(rope_params["rope_theta"]):
                raise err(f"rope_theta={rope_theta} disagrees with rope_parameters.rope_theta="
                          f"{rope_params['rope_theta']}")
            rope_theta = rope_params["rope_theta"]
        rope_theta = float(10000.0 if rope_theta is None else rope_theta)
        if not rope_theta > 0:
            raise err(f"rope_theta must be > 0, got {rope_theta}")

        # --- DFlash fields.
        dfc = d.get("dflash_config") or {}
        if not isinstance(dfc, dict):
            raise err(f"dflash_config must be a dict, got {dfc!r}")
        n_tgt = d.get("num_target_layers")
        if n_tgt is not None:
            n_tgt = req_int("num_target_layers")
        ids = dfc.get("target_layer_ids")
        if ids is None:
            if n_tgt is None:
                raise err("need dflash_config.target_layer_ids or num_target_layers (for the default rule)")
            ids = build_target_layer_ids(n_tgt, nL)
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise err(f"dflash_config.target_layer_ids must be a non-empty list of ints >= 0, got {ids!r}")
        if n_tgt is not None and max(ids) >= n_tgt:
            raise err(f"target_layer_ids {list(ids)} out of range for num_target_layers={n_tgt}")
        mask_id = req_int("mask_token_id", dfc, lo=0) if "mask_token_id" in dfc else None
        if mask_id is None:
            raise err("missing required field 'dflash_config.mask_token_id'")
        vocab = d.get("vocab_size")
        if vocab is not None:
            vocab = req_int("vocab_size")
            if mask_id >= vocab:
                raise err(f"mask_token_id={mask_id} >= vocab_size={vocab}")

        # --- Attention layer types / sliding windows.
        use_sw = bool(d.get("use_sliding_window", False))
        window = d.get("sliding_window") if use_sw else None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise err(f"sliding_window must be a positive integer, got {window!r}")
        layer_types = d.get("layer_types")
        if layer_types is None:
            mwl = d.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
                           for i in range(nL)]
        if len(layer_types) != nL or any(t not in _LAYER_TYPES for t in layer_types):
            raise err(f"layer_types must list {nL} entries from {_LAYER_TYPES}, got {layer_types!r}")
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)

        return cls(hidden_size=H, num_layers=nL, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                   intermediate_size=I, rms_norm_eps=eps, rope_theta=rope_theta, block_size=Bs,
                   target_layer_ids=tuple(ids), mask_token_id=mask_id, vocab_size=vocab,
                   num_target_layers=n_tgt, layer_windows=windows)

    @classmethod
    def from_pretrained(cls, path: str) -> "DrafterConfig":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"drafter config not found: {f}")
        with open(f) as fh:
            return cls.from_dict(json.load(fh), source=f)
