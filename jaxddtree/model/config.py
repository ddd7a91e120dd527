"""The target model's configuration, read from an HF `config.json` (Qwen3.5 / Qwen3.6 family).

Two layouts are accepted: the multimodal wrapper that Qwen3.6-27B ships (`model_type: qwen3_5` with a
`text_config`), and a text-only `qwen3_5_text` config. Only the fields the text forward pass needs are
kept; anything we cannot run exactly is a `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ATTENTION = "full_attention"
GDN = "linear_attention"


class ConfigError(ValueError):
    """A config.json we cannot run; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    # tensor parallelism (model/sharding.py): set on a shard's local config to the mesh axis that the
    # row-parallel projections (o_proj, out_proj, down_proj) all-reduce over; None: unsharded
    tp_axis: str | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:  # all GDN key heads
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # all GDN value heads
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: [q | k | v]
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == GDN)

    @property
    def group_size(self) -> int:
        """Layers per layer group: the shortest period of `layer_types` that divides the layer count (Qwen3.6-27B:
        4, three GDN layers and one attention layer, 16 groups). The model stacks each group position's
        parameters and caches over the groups and runs one `lax.scan` over them (qwen35.py); a pattern that does
        not repeat is one group of every layer (a scan of length 1: unrolled)."""
        return layer_period(self.layer_types)

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // self.group_size


def layer_period(layer_types) -> int:
    """The shortest p dividing len(layer_types) with layer_types[i] == layer_types[i % p] for every i."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(layer_types[i] == layer_types[i % p]
                                                                 for i in range(n)))


def _req(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return d[key]


def text_config_from_dict(raw: dict, where: str = "config.json") -> TextConfig:
    """Parse an HF config dict of either layout into a validated `TextConfig`."""
    model_type = raw.get("model_type")
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: model_type 'qwen3_5' needs a 'text_config' object")
        where = f"{where} (text_config)"
        if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
            raise ConfigError(f"{where}: text_config.model_type is '{text.get('model_type')}', "
                              "expected 'qwen3_5_text'")
    elif model_type == "qwen3_5_text":
        text = raw
    else:
        raise ConfigError(f"{where}: unsupported model_type '{model_type}' "
                          "(jaxddtree runs the Qwen3.5/3.6 family: 'qwen3_5' or 'qwen3_5_text')")

    n_layers = int(_req(text, "num_hidden_layers", where))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [GDN if (i + 1) % interval else ATTENTION for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for "
                          f"num_hidden_layers={n_layers}")
    for t in layer_types:
        if t not in (ATTENTION, GDN):
            raise ConfigError(f"{where}: unsupported layer type '{t}' in layer_types "
                              f"(expected '{ATTENTION}' or '{GDN}')")

    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only 'default')")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{where}: rope_theta is missing (rope_parameters.rope_theta)")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act '{act}' is not supported (only 'silu')")
    if text.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true is not supported")
    if text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)):
        raise ConfigError(f"{where}: tie_word_embeddings=true is not supported (Qwen3.6 has an untied lm_head)")
    if text.get("attn_output_gate", True) is False:
        raise ConfigError(f"{where}: attn_output_gate=false is not supported")

    hidden = int(_req(text, "hidden_size", where))
    n_heads = int(_req(text, "num_attention_heads", where))
    head_dim = int(text.get("head_dim") or hidden // n_heads)
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

    cfg = TextConfig(
        vocab_size=int(_req(text, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_req(text, "intermediate_size", where)),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=n_heads,
        num_key_value_heads=int(_req(text, "num_key_value_heads", where)),
        head_dim=head_dim,
        rope_theta=float(theta),
        partial_rotary_factor=float(partial),
        linear_num_key_heads=int(_req(text, "linear_num_key_heads", where)),
        linear_num_value_heads=int(_req(text, "linear_num_value_heads", where)),
        linear_key_head_dim=int(_req(text, "linear_key_head_dim", where)),
        linear_value_head_dim=int(_req(text, "linear_value_head_dim", where)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        eos_token_ids=eos,
    )
    _validate(cfg, where)
    return cfg


def _validate(c: TextConfig, where: str) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(f"{where}: {msg}")

    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        if isinstance(v, int) and f.name != "eos_token_ids":
            need(v > 0, f"{f.name} must be positive, got {v}")
    need(c.num_attention_heads % c.num_key_value_heads == 0,
         f"num_attention_heads ({c.num_attention_heads}) must be a multiple of num_key_value_heads "
         f"({c.num_key_value_heads})")
    need(c.linear_num_value_heads % c.linear_num_key_heads == 0,
         f"linear_num_value_heads ({c.linear_num_value_heads}) must be a multiple of "
         f"linear_num_key_heads ({c.linear_num_key_heads})")
    need(0.0 < c.partial_rotary_factor <= 1.0, f"partial_rotary_factor must be in (0, 1], got "
         f"{c.partial_rotary_factor}")
    need(c.rotary_dim % 2 == 0 and c.rotary_dim > 0,
         f"rotary dim head_dim*partial_rotary_factor = {c.rotary_dim} must be even and positive")
    need(c.linear_conv_kernel_dim >= 2, "linear_conv_kernel_dim must be >= 2")


def load_config(path: str) -> TextConfig:
    """Read `path/config.json` (or `path` itself if it is a file)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{file}: not found (expected an HF model directory with config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return text_config_from_dict(raw, where=file)
