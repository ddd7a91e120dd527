"""Tiny random DFlash drafter checkpoints (z-lab layout: config.json + model.safetensors) for tests."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file


def tiny_config(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=96, block_size=8,
                target_layer_ids=(1, 3), num_target_layers=6, layer_types=None, window=6, vocab=101,
                mask_token_id=100, rope_theta=10000.0, **extra) -> dict:
    if layer_types is None:
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": intermediate,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": None,
        "attention_bias": False, "max_position_embeddings": 4096, "vocab_size": vocab,
        "use_sliding_window": True, "sliding_window": window, "max_window_layers": layers,
        "layer_types": layer_types, "block_size": block_size, "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "torch_dtype": "float32",
    }
    cfg.update(extra)
    return cfg


def random_weights(cfg: dict, seed: int = 0, prefix: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nT = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def nrm(n):  # non-trivial norm weights
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": lin(H, nT * H), "hidden_norm.weight": nrm(H), "norm.weight": nrm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": nrm(H), p + "post_attention_layernorm.weight": nrm(H),
            p + "self_attn.q_proj.weight": lin(nh * hd, H), p + "self_attn.k_proj.weight": lin(nkv * hd, H),
            p + "self_attn.v_proj.weight": lin(nkv * hd, H), p + "self_attn.o_proj.weight": lin(H, nh * hd),
            p + "self_attn.q_norm.weight": nrm(hd), p + "self_attn.k_norm.weight": nrm(hd),
            p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
            p + "mlp.down_proj.weight": lin(H, I),
        })
    return {prefix + k: v for k, v in w.items()}


def write_checkpoint(path: str, cfg: dict, weights: dict[str, np.ndarray], shards: int = 1) -> str:
    """Write config.json + model.safetensors (or `shards` files + model.safetensors.index.json)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if shards == 1:
        save_file(weights, os.path.join(path, "model.safetensors"))
        return path
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return path


def tiny_pair(tmp_path_factory, name: str, vocab: int = 97, block: int = 8):
    """(target, drafter): the tiny HF causal LM of hf_models (fp32) and a random DFlash drafter for it (hidden 64,
    target layers (1, 2), `block` slots), both written to temporary directories and loaded."""
    import hf_models
    import jaxddtree
    tdir = str(tmp_path_factory.mktemp(f"{name}_target"))
    hf_models.save_text_only(hf_models.causal_lm(0), tdir)
    target = jaxddtree.load_target(tdir, "float32")
    ddir = str(tmp_path_factory.mktemp(f"{name}_drafter"))
    cfg = tiny_config(hidden=64, vocab=vocab, mask_token_id=vocab - 1, num_target_layers=4, target_layer_ids=(1, 2),
                      block_size=block)
    write_checkpoint(ddir, cfg, random_weights(cfg, seed=1))
    return target, jaxddtree.load_drafter(ddir, target, "float32")


def builtin_pair(layers: int, seed: int, last_tap: int):
    """The built-in demo pair's shapes at `layers` target layers (the 27B's 3 GDN + 1 attention pattern), random fp32
    weights: a pair of its own shapes, so that no other test in the process has compiled its programs. The drafter
    taps target layers (1, last_tap)."""
    import dataclasses

    import jax.numpy as jnp

    from jaxddtree.checkpoint import builtin
    from jaxddtree.model.config import ATTENTION, GDN
    from jaxddtree.model.drafter import Drafter
    from jaxddtree.model.target import random_target
    cfg = dataclasses.replace(builtin.target_config(), num_hidden_layers=layers,
                              layer_types=tuple(ATTENTION if (i + 1) % 4 == 0 else GDN for i in range(layers)))
    dcfg = dataclasses.replace(builtin.drafter_config(), num_target_layers=layers, target_layer_ids=(1, last_tap))
    return random_target(cfg, "float32"), Drafter(
        config=dcfg, params=builtin.random_drafter_params(dcfg, jnp.float32, seed), path="test")
