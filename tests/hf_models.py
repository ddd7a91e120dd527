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
    # hidden != heads*head_dim, MHA (GQA 1), GVA 1, dk != dv, conv kernel 2 (conv state of one row)
    "k2_mha": dict(hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=6, linear_conv_kernel_dim=2,
                   layer_types=["linear_attention", "full_attention", "linear_attention"],
                   rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}),
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


# The bf16 comparison model: a little larger (hidden 128, head dims 64), and "tamed" so that bf16 rounding
# noise is not amplified chaotically (fully random GDN weights with strong decay and full-scale residual
# branches turn 0.4% bf16 rounding into >10% logit differences, even between transformers' own bf16 and
# fp32 runs). Every mixer still moves the top-1 token at a large fraction of positions.
BF16 = dict(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64)


def causal_lm_bf16(seed: int = 3) -> Qwen3_5ForCausalLM:
    """fp32 weights of the bf16 comparison model (saved, then loaded with `from_pretrained_bf16` for the
    reference)."""
    model = causal_lm(seed, **BF16)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in [0.05, 1)
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g)))
            if any(s in name for s in ("out_proj", "o_proj", "down_proj")):  # smaller residual branches
                p.mul_(0.3)
    return model


def from_pretrained_bf16(path: str) -> Qwen3_5ForCausalLM:
    """transformers' bf16 model as it is normally run: `from_pretrained(path, dtype=torch.bfloat16)`, eager
    attention. Not `model.to(torch.bfloat16)`: that also casts the rotary embedding's `inv_freq` buffer to
    bf16 (from_pretrained keeps it fp32, as jaxddtree does), which moves every cos/sin by up to ~1%."""
    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    return model.eval()


def edit_config(path: str, fn) -> None:
    """Rewrite `path`/config.json in place after `fn(config dict)` (tests that break a checkpoint's config)."""
    import json
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    fn(cfg)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


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


# ----------------------------------------------------------------------------- reference helpers
# (numpy in, numpy out; everything fp32 unless the model is bf16)

import numpy as np  # noqa: E402


def rel_err(ours, ref) -> float:
    """The suite's error metric: max|ours - ref| / max|ref| (fp64)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def hf_logits(model, seqs) -> np.ndarray:
    """Logits [B, T, V] (fp32 numpy) of a plain forward over equal-length sequences [B, T]."""
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(seqs, np.int64)), use_cache=False)
    return out.logits.float().numpy()


def root_paths(parents) -> list[list[int]]:
    """Node indices of every node's root path (root first, node last)."""
    paths = []
    for i, p in enumerate(parents):
        paths.append([i] if p < 0 else paths[p] + [i])
    return paths


def hf_tree_logits(model, prefix, tree_tokens, parents, nodes=None, hidden: bool = False):
    """node -> logits [V] of transformers' plain forward over prefix + that node's root path tokens.
    Paths of equal length are batched into one forward. With hidden=True also node -> [L, D], the output
    of every decoder layer at that node."""
    prefix = np.asarray(prefix, np.int64)
    toks = np.asarray(tree_tokens, np.int64)
    paths = root_paths(parents)
    nodes = range(len(parents)) if nodes is None else nodes
    by_len: dict[int, list[int]] = {}
    for i in nodes:
        by_len.setdefault(len(paths[i]), []).append(i)
    out, hid = {}, {}
    for _, group in sorted(by_len.items()):
        seqs = np.stack([np.concatenate([prefix, toks[paths[i]]]) for i in group])
        if hidden:
            lg, layers, _, _ = hf_prefill_state(model, seqs)
            hid.update(zip(group, np.stack([h[:, -1] for h in layers], axis=1)))
        else:
            lg = hf_logits(model, seqs)
        out.update(zip(group, lg[:, -1]))
    return (out, hid) if hidden else out


def hf_prefill_state(model, ids):
    """transformers' forward with use_cache=True over ids [B, T]: returns (logits, per-layer hidden
    states after each decoder layer [L x [B, T, D]] (forward hooks: HF's own `hidden_states[-1]` is
    post-final-norm), HF's `output_hidden_states` tuple, per-layer cache dicts in HF layout: GDN
    {'conv': [B, conv_dim, K], 'recurrent': [B, Hv, dk, dv]}, attention {'k','v': [B, Hkv, T, hd]})."""
    caps = []
    hooks = [layer.register_forward_hook(
        lambda mod, inp, out: caps.append((out[0] if isinstance(out, tuple) else out).float().numpy()))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.asarray(ids, np.int64)), use_cache=True, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    layers = []
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            layers.append({"conv": layer.conv_states[0].float().numpy(),
                           "recurrent": layer.recurrent_states[0].float().numpy()})
        else:
            layers.append({"k": layer.keys.float().numpy(), "v": layer.values.float().numpy()})
    hidden = tuple(h.float().numpy() for h in out.hidden_states)
    return out.logits.float().numpy(), caps, hidden, layers
