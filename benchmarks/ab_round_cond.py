#!/usr/bin/env python
"""A/B, one process: the DDTree/chain round inside `lax.cond(done, ...)` (the loop before session 3) vs the
while_loop whose condition skips done rounds (now), at 27B shapes; also reports the profile's big copies.

    python benchmarks/ab_round_cond.py --out ab.json [--contexts 4096,32768]
"""
from __future__ import annotations

import argparse, functools, json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp

from bench import DFLASH_27B, QWEN36_27B, fill_random, make_round, median_ms, random_drafter
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.target import random_target
from jaxddtree.speculative import loop as loop_lib


@functools.partial(jax.jit, static_argnames=loop_lib._STATIC + ("rounds",), donate_argnames=("state",))
def run_rounds_cond(leaves, dparams, state, oracle, *, graphdef, treedef, dcfg, plan, rounds):
    body = functools.partial(loop_lib._round, graphdef=graphdef, treedef=treedef, dcfg=dcfg, plan=plan)

    def one(_, s):
        return jax.lax.cond(s.done, lambda s: s, lambda s: body(leaves, dparams, s, oracle), s)

    return jax.lax.fori_loop(0, rounds, one, state)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    cfg = text_config_from_dict(QWEN36_27B)
    target = random_target(cfg, "bfloat16", 0)
    dcfg = DrafterConfig(**DFLASH_27B)
    drafter = random_drafter(dcfg, jnp.bfloat16)
    res = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d")}
    for L in [int(c) for c in args.contexts.split(",")]:
        for method, budget in (("ddtree", 64), ("dflash", 15)):
            plan = loop_lib.Plan(method=method, budget=budget, max_new=100000, temperature=0.0,
                                 kernels=target.kernels, conv_kernel=cfg.linear_conv_kernel_dim,
                                 feature_layers=dcfg.target_layer_ids)
            for name, runner in (("cond", run_rounds_cond), ("while", loop_lib.run_rounds)):
                cache = fill_random(target.init_cache(L + 1024), jax.random.key(3)).replace(length=jnp.int32(L))
                one = make_round(target, drafter, plan, cache, runner=runner)
                jax.block_until_ready(one())
                ms = median_ms(one, n=args.runs)
                res[f"{method}_{name}_{L}"] = round(ms, 3)
                print(f"context {L} {method} {name}: {ms:.3f} ms", flush=True)
                del one, cache
            json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
