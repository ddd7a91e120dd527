#!/usr/bin/env python
"""A/B of the decode-step fusions at Qwen3.6-27B shapes, one process: the AR decode step's median time for each
variant of kernels="pallas" (`kernels_pallas.ops.VARIANTS`, passed as the step's `kernels`), plus its greedy token
vs the first variant's. The RMSNorm-prologue and MLP-chain variants lost and were removed from the kernels
(kernels_pallas/ops.py); this script's 2026-11-30 record names the variants kept here "unfused",
"no_mlp_no_norm" (now "default") and "epilogues_only" (now "no_partials").

    python benchmarks/ab_decode_fusions.py --out ab.json        # H200
    JAX_PLATFORMS=cpu python benchmarks/ab_decode_fusions.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import QWEN36_27B, SMOKE_TARGET, fill_random, make_decode, median_ms  # noqa: E402
from jaxddtree.model.config import text_config_from_dict  # noqa: E402
from jaxddtree.model.target import random_target  # noqa: E402
from kernels_pallas import ops  # noqa: E402

VARIANTS = {"unfused": "pallas:unfused", "default": "pallas", "no_partials": "pallas:no_partials"}  # -> kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (xla: checks the script only)")
    args = ap.parse_args(argv)
    missing = [v for v in VARIANTS.values() if v not in ops.VARIANTS]
    if missing:
        sys.exit(f"ab_decode_fusions: kernels_pallas.ops has no variant {', '.join(missing)}")
    raw = dict(QWEN36_27B)
    if args.smoke:
        raw.update(SMOKE_TARGET)
        args.context, args.runs = 64, 3
    cfg = text_config_from_dict(raw, where="Qwen3.6-27B shapes")
    target = random_target(cfg, "bfloat16")
    gpu = jax.default_backend() == "gpu"
    res = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(), "context": args.context,
           "kernels": {n: VARIANTS[n] if gpu else "xla" for n in args.variants.split(",")}, "variants": {}}
    base_tok = None
    for name, kernels in res["kernels"].items():
        decode = make_decode(target, kernels)  # the variant is the step's kernels (the smoke run: xla)
        cache = fill_random(target.init_cache(args.context + 512), jax.random.key(3)).replace(
            length=jnp.int32(args.context))
        state = [jnp.ones((1, 1), jnp.int32), cache]
        tok, state[1] = decode(target.leaves, state[1], state[0])
        first = int(jax.device_get(tok)[0, 0])
        base_tok = first if base_tok is None else base_tok

        def step():
            state[0], state[1] = decode(target.leaves, state[1], state[0])
            return state[0]

        ms = median_ms(step, n=args.runs)
        res["variants"][name] = {"ar_step_ms": round(ms, 3), "first_token": first, "same_token_as_first": first == base_tok}
        print(name, res["variants"][name], flush=True)
        del state, cache
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
