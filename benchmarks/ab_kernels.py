#!/usr/bin/env python
"""A/B of kernel paths in ONE process at Qwen3.6-27B / DFlash shapes (random bf16 weights): the AR step and the
rounds of --budgets for each of --variants (`kernels_pallas.ops.VARIANTS`, or "xla"), timed as bench.py times them
(`loop.loop_fn` rounds on the device loop, --rounds-per-call per jitted call, median of --runs calls), on one target
and one cache, the variants taking turns for --passes passes (so a drift of the machine shows as a pass-to-pass
difference, not as a variant's). One process, one machine: the comparison bench.py's two-process runs cannot give
when two calls land on two machines.

    python benchmarks/ab_kernels.py --variants pallas,pallas:unfused --out ab.json     # H200
    JAX_PLATFORMS=cpu python benchmarks/ab_kernels.py --smoke    # the script (off a GPU every variant runs as xla)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from bench import (DFLASH_27B, QWEN36_27B, SMOKE_DFLASH, SMOKE_TARGET, Rounds, plan_for,  # noqa: E402
                   random_drafter)
from jaxddtree.model.config import text_config_from_dict  # noqa: E402
from jaxddtree.model.drafter_config import DrafterConfig  # noqa: E402
from jaxddtree.model.target import random_target  # noqa: E402
from kernels_pallas import ops  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="pallas,pallas:unfused",
                    help=f"comma list of kernel paths: xla or one of {', '.join(ops.VARIANTS)}")
    ap.add_argument("--budgets", default="chain,64", help="rounds to time besides the AR step ('chain' = DFlash)")
    ap.add_argument("--context", type=int, default=4096, help="committed context length")
    ap.add_argument("--runs", type=int, default=5, help="timed calls per figure (median)")
    ap.add_argument("--rounds-per-call", type=int, default=16, help="rounds per jitted call (AR steps: 4x as many)")
    ap.add_argument("--passes", type=int, default=2, help="times every variant is timed, in turn")
    ap.add_argument("--ar-first-only", action="store_true",
                    help="time the AR step for the first variant only (variants that change only the tree verify)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few runs: check the script on a CPU")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v != "xla" and v not in ops.VARIANTS]
    if bad:
        ap.error(f"unknown kernel path {', '.join(bad)} (xla or one of {', '.join(ops.VARIANTS)})")
    raw, dflash = dict(QWEN36_27B), dict(DFLASH_27B)
    if args.smoke:
        raw.update(SMOKE_TARGET)
        dflash.update(SMOKE_DFLASH)
        args.context, args.runs, args.rounds_per_call, args.passes = 64, 2, 2, 1
    cfg = text_config_from_dict(raw, where="Qwen3.6-27B shapes")
    dcfg = DrafterConfig(**dflash)
    target = random_target(cfg, "bfloat16", seed=0)
    drafter = random_drafter(dcfg, jax.numpy.bfloat16)
    n = args.rounds_per_call
    gpu = jax.default_backend() == "gpu"
    ran_as = {v: v if gpu else "xla" for v in variants}  # off a GPU (the smoke run) every variant runs as xla
    res = {"ran_as": ran_as, "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
           "context": args.context, "rounds_per_call": n, "runs": args.runs, "variants": variants,
           "ms": {v: {} for v in variants}}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    figures = ["ar"] + [b for b in args.budgets.split(",") if b]
    for p in range(args.passes):
        for v in variants:
            target.kernels = ran_as[v]
            for name in figures:
                if name == "ar" and args.ar_first_only and v != variants[0]:
                    continue
                per_call = 4 * n if name == "ar" else n  # caches sized per figure by loop.capacity (bench.Rounds)
                r = Rounds(target, drafter, plan_for(target, dcfg, name), args.context, per_call,
                           (args.runs + 2) * per_call)
                ms = round(r.ms_per_round(args.runs), 3)
                del r
                res["ms"][v].setdefault(name, []).append(ms)
                log(f"pass {p}: {v} {name} {ms} ms")
    res["median_ms"] = {v: {k: round(statistics.median(x), 3) for k, x in d.items()} for v, d in res["ms"].items()}
    base = variants[0]
    res["minus_first_ms"] = {v: {k: round(x - res["median_ms"][base][k], 3) for k, x in d.items()
                                 if k in res["median_ms"][base]}
                             for v, d in res["median_ms"].items() if v != base}
    print(json.dumps(res, indent=1, sort_keys=True))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
