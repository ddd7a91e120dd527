"""The benchmark scripts (run on the H200 by hand) still run end to end: tiny shapes on the CPU."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(args, timeout=600):
    p = subprocess.run([sys.executable] + args, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    return p


def test_bench_smoke_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    _run(["benchmarks/bench.py", "--smoke", "--sections", "bandwidth,ar,verify,parts,round", "--verify-nodes", "8",
          "--budgets", "8", "--out", str(out)])
    res = json.loads(out.read_text())
    for key in ("weight_stream_tb_s", "floor_ms", "ar_step_ms", "draft_ms", "tree_build_ms", "commit_ms",
                "chain_round_ms", "device", "date", "jax"):
        assert key in res, key
    assert res["verify_ms"]["9"] > 0 and res["round_ms"]["8"] > 0


def test_kernel_benches_dry(tmp_path):
    _run(["benchmarks/bench_kernels.py", "--dry", "--sections", "tree,attn,decode,prefill",
          "--out", str(tmp_path / "k.json")])
    _run(["benchmarks/bench_gemv.py", "--dry", "--out", str(tmp_path / "g.json")])
    assert json.loads((tmp_path / "g.json").read_text())["dry"] is True


def test_skinny_bench_dry(tmp_path):
    """bench_skinny.py --dry: the sweep's plumbing (XLA, Mosaic plain + warp-specialized, Triton) in interpret mode."""
    out = tmp_path / "s.json"
    _run(["benchmarks/bench_skinny.py", "--dry", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["dry"] is True and len(res["runs"]) == 2
    for run in res["runs"].values():
        assert run["best_mosaic"] and run["best_triton"] and run["xla_us"] > 0
        assert not any(v.get("error") or v.get("wrong") for v in run["variants"].values()), run["variants"]


def test_skinny_bench_isolated_survives_a_crashing_variant(tmp_path):
    """--isolate: a variant that kills its process is recorded as such and a new child finishes the sweep."""
    out = tmp_path / "s.json"
    env = dict(ENV, BENCH_SKINNY_CRASH="triton_default")
    p = subprocess.run([sys.executable, "benchmarks/bench_skinny.py", "--dry", "--isolate", "--shapes", "mlp_down",
                        "--ms", "17", "--select", "default,triton_default", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    run = json.loads(out.read_text())["runs"]["mlp_down@M17"]
    assert "died or hung" in run["variants"]["triton_default"]["error"]
    assert run["best_mosaic"] == "default" and run["xla_us"] > 0 and run["done"]
