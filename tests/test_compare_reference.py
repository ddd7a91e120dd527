"""scripts/compare_reference.py on a tiny model: runs end to end and its figures hold."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_reference_tiny():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_reference.py"), "--tiny", "--json",
                        "--max-new-tokens", "12", "--prompt-len", "40"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    print("logits max rel err", rep["logits_max_rel_err"])
    assert rep["logits_max_rel_err"] <= 1e-4
    assert rep["top1_agreement"] == 1.0
    assert rep["jaxddtree_ar"]["tokens"] == rep["transformers_ar"]["tokens"]
    assert len(rep["transformers_ar"]["tokens"]) == 12


def test_compare_reference_scale_mode_tiny_config(tmp_path):
    """--scale (reference timings with random weights, no checkpoint) on a tiny config, merged into --out."""
    cfg = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"ar_step_ms": 1.0}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_reference.py"), "--scale",
                        "--config", str(tmp_path / "config.json"), "--context", "32", "--verify-nodes", "8",
                        "--runs", "1", "--out", str(out), "--json"],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["ar_step_ms"] == 1.0  # merged, not overwritten
    ref = data["reference"]
    assert ref["ar_step_ms"] > 0 and ref["verify_ms"]["9"] > 0 and ref["context"] == 32
    assert ref["attn_implementation"] == "eager" and ref["dtype"] == "bfloat16"
