#!/usr/bin/env python
"""Start-up benchmark (issue 40): how long until the model answers.

    python benchmarks/bench_startup.py --layers 8,64 [--out FILE]   # first generate() call's time, tiny models

--layers: tiny random targets (hidden 64, the 27B's repeating 3 GDN + 1 attention pattern) of each depth with a
random drafter; for each method (ar, ddtree) the first `generate` call (compilation included: the programs are
compiled once per model) and a second one (what remains: running), in one process without a persistent
compilation cache. The goal is the depth ratio of the first call, 64 / 8 layers ≤ 1.25 (one scanned layer group,
not every layer, is compiled).
At 27B shapes, bench.py prints each program's first call with compilation ("AR step ... (8.3s with compilation)").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tiny_pair(layers: int, dtype="float32"):
    import dataclasses
    import jax.numpy as jnp
    from jaxddtree.checkpoint import builtin
    from jaxddtree.model.config import ATTENTION, GDN
    from jaxddtree.model.drafter import Drafter
    from jaxddtree.model.target import random_target

    cfg = dataclasses.replace(builtin.target_config(), num_hidden_layers=layers,
                              layer_types=tuple(ATTENTION if (i + 1) % 4 == 0 else GDN for i in range(layers)))
    target = random_target(cfg, dtype)
    dcfg = dataclasses.replace(builtin.drafter_config(), num_target_layers=layers,
                               target_layer_ids=(1, layers - 1))
    drafter = Drafter(config=dcfg, params=builtin.random_drafter_params(dcfg, jnp.float32, 1), path="builtin")
    return target, drafter


def first_calls(target, drafter, prompt_len=40, new=24):
    import numpy as np
    from jaxddtree.speculative.loop import generate

    ids = np.arange(1, prompt_len + 1) % 200
    out = {}
    for method, kw in (("ar", {}), ("ddtree", dict(drafter=drafter, tree_budget=16))):
        for call in ("first", "second"):
            t = time.perf_counter()
            generate(target, ids, method=method, max_new_tokens=new, loop="device", **kw)
            out[f"{method}_{call}_s"] = round(time.perf_counter() - t, 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="8,64", help="tiny model depths (CPU mode)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    import jax
    res = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "depths": {}}
    for n in [int(x) for x in args.layers.split(",")]:
        target, drafter = tiny_pair(n)
        res["depths"][str(n)] = first_calls(target, drafter)
        print(n, res["depths"][str(n)], flush=True)
    d = res["depths"]
    if len(d) >= 2:
        lo, hi = d[min(d, key=int)], d[max(d, key=int)]
        res["ratio"] = {m: round(hi[f"{m}_first_s"] / lo[f"{m}_first_s"], 3) for m in ("ar", "ddtree")}
        print("first-call ratio deepest / shallowest:", res["ratio"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
