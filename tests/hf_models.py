"""Tiny random Qwen3.5/3.6 models built with transformers (the reference), saved in HF layouts."""

from __future__ import annotations

import os

import torch

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)

# Several shapes: hidden size, head counts, GVA ratio, head dims, layer pattern, rotary factor.
VARIANTS = {
    "base": {},
    "gva3_wide": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                      linear_value_head_dim=8,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    "pattern": dict(num_hidden_layers=5,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                 "linear_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 1.0}),
}


def text_config(**overrides) -> Qwen3_5TextConfig:
    kw = dict(BASE)
    kw.update(overrides)
    cfg = Qwen3_5TextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Non-trivial values for every parameter (norm weights, A_log, dt_bias included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                if "conv1d" in name:
                    fan_in = p.shape[-1]
                scale = 1.0 if "embed_tokens" in name else fan_in ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def causal_lm(seed: int = 0, **overrides) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(**overrides)).float().eval()
    return randomize_(model, seed)


def save_text_only(model, path: str, max_shard_size: str | None = None) -> str:
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def save_wrapper(model, path: str, extra_mtp: bool = True) -> str:
    """Save as the multimodal wrapper (`model.language_model.*`, tiny vision tower, `mtp.*` extras)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = model.config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=text["hidden_size"])
    cfg = Qwen3_5Config(text_config=text, vision_config=vision)
    wrapper = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    sd = {k: v for k, v in model.state_dict().items()}
    missing = wrapper.model.language_model.load_state_dict(
        {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}, strict=True)
    wrapper.lm_head.load_state_dict({"weight": sd["lm_head.weight"]})
    wrapper.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    if extra_mtp:
        from safetensors.torch import save_file
        save_file({"mtp.fc.weight": torch.randn(4, 4), "mtp.norm.weight": torch.randn(4)},
                  os.path.join(path, "mtp-extra.safetensors"))
        import json
        idx_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(idx_path):
            with open(idx_path) as f:
                idx = json.load(f)
            idx["weight_map"]["mtp.fc.weight"] = "mtp-extra.safetensors"
            idx["weight_map"]["mtp.norm.weight"] = "mtp-extra.safetensors"
            with open(idx_path, "w") as f:
                json.dump(idx, f)
    return path
