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
