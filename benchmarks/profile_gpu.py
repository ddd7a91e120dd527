#!/usr/bin/env python
"""Where the time goes: profile the AR decode step and a verify pass at 27B shapes, and summarise the GPU
kernels (total time per kernel name, busy time vs wall time) from the jax profiler trace.

    python benchmarks/profile_gpu.py --out prof.json [--kernels xla|pallas]
"""
from __future__ import annotations

import argparse, collections, glob, json, os, sys, tempfile, time

try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxddtree.model import layout as layout_lib
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.target import random_target
from jaxddtree.speculative.verify import verify
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import QWEN36_27B, fill_random, make_decode, random_tree  # noqa: E402


PALLAS_NAMES = ("gdn_tree", "tree_attention", "gdn_decode", "gdn_prefill", "decode_attention", "pallas")


def category(name: str) -> str:
    """Coarse kernel class: GEMMs, our Pallas kernels, XLA fusions (elementwise/reduction), copies, other."""
    n = name.lower()
    if any(p in n for p in PALLAS_NAMES):
        return "pallas"
    if any(p in n for p in ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas", "matmul", "dot")):
        return "gemm"
    if any(p in n for p in ("memcpy", "memset", "copy")):
        return "copy"
    if any(p in n for p in ("fusion", "loop_", "input_", "reduce", "broadcast", "concatenate", "slice",
                            "transpose", "convert")):
        return "fusion"
    return "other"


def summarise(trace_dir, n_steps):
    from jax.profiler import ProfileData
    fn = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    pd = ProfileData.from_file(fn)
    per = collections.defaultdict(lambda: [0.0, 0])
    starts, ends, busy = [], [], 0.0
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name and "stream" not in line.name:
                continue
            for ev in line.events:
                per[ev.name][0] += ev.duration_ns / 1e3
                per[ev.name][1] += 1
                busy += ev.duration_ns / 1e3
                starts.append(ev.start_ns)
                ends.append(ev.start_ns + ev.duration_ns)
    span = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:40]
    cats = collections.defaultdict(lambda: [0.0, 0])
    for k, v in per.items():
        cats[category(k)][0] += v[0]
        cats[category(k)][1] += v[1]
    return {"kernel_busy_us_per_step": busy / n_steps, "span_us_per_step": span / n_steps,
            "gaps_us_per_step": (span - busy) / n_steps,
            "by_category": {c: {"us_per_step": round(v[0] / n_steps, 1), "kernels_per_step": v[1] / n_steps}
                            for c, v in sorted(cats.items(), key=lambda kv: -kv[1][0])},
            "kernels_per_step": sum(v[1] for v in per.values()) / n_steps,
            "top": [{"name": k[:120], "us_per_step": round(v[0] / n_steps, 1), "count_per_step": v[1] / n_steps}
                    for k, v in top]}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="prof.json")
    ap.add_argument("--kernels", default="pallas", choices=["xla", "pallas"])
    ap.add_argument("--nodes", type=int, default=65)
    args = ap.parse_args()
    cfg = text_config_from_dict(QWEN36_27B)
    target = random_target(cfg, "bfloat16", 0)
    gd, td = target.graphdef, target.treedef
    L, S = 4096, 4096 + 1024
    cache = fill_random(target.init_cache(S), jax.random.key(3)).replace(length=jnp.int32(L))
    res = {}

    decode = make_decode(target, args.kernels)

    parents = jnp.asarray(random_tree(args.nodes, 15, 0))
    tokens = jnp.ones((1, args.nodes), jnp.int32)

    @jax.jit
    def run_verify(leaves, cache):
        model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
        lay = layout_lib.tree(cache.length, parents, cfg.linear_conv_kernel_dim, kernels=args.kernels)
        logits, feats, _ = verify(model, cache, tokens, lay, feature_layers=(1, 16, 31, 46, 61))
        return jnp.argmax(logits, -1), feats

    tok = jnp.ones((1, 1), jnp.int32)
    for _ in range(3):
        tok, cache = decode(target.leaves, cache, tok)
    jax.block_until_ready(run_verify(target.leaves, cache))
    for name, fn in [("decode", None), ("verify", None)]:
        d = tempfile.mkdtemp()
        n = 5
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(n):
                if name == "decode":
                    tok, cache = decode(target.leaves, cache, tok)
                    jax.block_until_ready(tok)
                else:
                    jax.block_until_ready(run_verify(target.leaves, cache))
        res[name] = summarise(d, n)
        res[name]["wall_ms_per_step_profiled"] = (time.perf_counter() - t) * 1e3 / n
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "top"}), flush=True)
        for e in res[name]["top"][:25]:
            print("   ", e, flush=True)
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
