#!/usr/bin/env python
"""Batched DDTree rounds (speculative/batch.py) at Qwen3.6-27B / DFlash shapes, random bf16 weights made on the GPU.

For each slot count B in --slots: ms per round of what a SlotPool runs for B active requests —
  B = 1: generate's own round (`loop.loop_fn`, greedy plan, DDTree at --single-budget);
  B >= 2: the batched round (`batch.slots_fn`, vmap of loop's per-slot round; the sampling class is data, the
          widest of the slots') at the pool's per-slot budget `batch.bucket_budget(B, --slot-rows)`, greedy requests,
each slot's caches filled at --context committed tokens (random contents), --rounds-per-call rounds per jitted call
(time / rounds, median of --runs calls). Tokens/s are projected from an acceptance (tokens per round per slot:
--acceptance, one number or budget=value pairs) as B · acceptance / round time, and their ratio to B = 1.
--truncate-ab B,...: also the batched round of sampled requests (temperature 1) and of truncated ones (top_k 20) at
those B: what sampling and truncation cost over greedy.
--prefill-groups K,...: the prefill + start of K joining prompts of --prefill-prompt tokens, one by one (K = 1: K
sequential `loop.Prefill`s, as the pool ran joiners before) and as one `loop.PrefillGroup` (one pass per chunk for all
K): ms for all K (median of --runs), the group's speed-up (`prefill_by_group`).
JSON into --out (merged by slot count with what the file holds).

    python benchmarks/bench_batch.py --slots 1,2,4,8,16 --out benchmarks/results/batch_27b_h200.json
    python benchmarks/bench_batch.py --smoke        # tiny shapes on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

# this checkout's code first (also where another copy of jaxddtree is installed), and bench.py's helpers
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench  # noqa: E402
from jaxddtree.model.config import text_config_from_dict  # noqa: E402
from jaxddtree.model.drafter_config import DrafterConfig  # noqa: E402
from jaxddtree.model.target import random_target  # noqa: E402
from jaxddtree.speculative import batch as batch_lib  # noqa: E402
from jaxddtree.speculative import loop as loop_lib  # noqa: E402


def acceptance_for(spec: str, budget: int) -> float:
    """--acceptance: "4.0" (every budget) or "7=3.1,15=3.6,31=4.0,63=4.4" (the nearest listed budget)."""
    if "=" not in spec:
        return float(spec)
    pairs = {int(k): float(v) for k, v in (p.split("=") for p in spec.split(","))}
    return pairs[min(pairs, key=lambda b: abs(b - budget))]


def slot_state(target, drafter, plan, context: int, max_new: int, temperature=0.0):
    """One slot's decode state after a `context`-token prompt (bench.loop_state: random caches), out buffer and
    acceptance record of the pool's layout."""
    st = bench.loop_state(target, drafter, plan, context, max_new)
    return st.replace(temperature=jnp.float32(temperature))


def time_calls(call, state, runs: int, rounds: int):
    """Median ms per round over `runs` calls of `rounds` rounds (after one warm-up call that compiles)."""
    state, prog = call(state)
    jax.block_until_ready(prog.n_rounds)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        state, prog = call(state)
        jax.block_until_ready(prog.n_rounds)
        ts.append((time.perf_counter() - t) * 1e3 / rounds)
    return statistics.median(ts), state, prog


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", default="1,2,4,8,16", help="slot counts B")
    ap.add_argument("--context", type=int, default=4096, help="committed tokens per slot")
    ap.add_argument("--slot-rows", type=int, default=128, help="the pool's verify rows in all (B·(budget+1) <= it)")
    ap.add_argument("--single-budget", type=int, default=63, help="DDTree budget of the B = 1 (generate) round")
    ap.add_argument("--acceptance", default="7=3.0,15=3.5,31=4.0,63=4.4",
                    help="tokens per round per slot for the projection: a number or budget=value pairs")
    ap.add_argument("--rounds-per-call", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--truncate-ab", default="4", help="slot counts also timed with sampled and truncated requests ('' none)")
    ap.add_argument("--prefill-groups", default="", help="joining prompts prefilled together, e.g. 2,4,8 ('' none)")
    ap.add_argument("--prefill-prompt", type=int, default=512, help="tokens per prompt of --prefill-groups")
    ap.add_argument("--kernels", default=None, choices=["xla", "pallas"])
    ap.add_argument("--out", default="benchmarks/results/batch_27b_h200.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few runs: check the script on a CPU")
    args = ap.parse_args(argv)

    raw, dflash = dict(bench.QWEN36_27B), dict(bench.DFLASH_27B)
    if args.smoke:
        raw.update(bench.SMOKE_TARGET)
        dflash.update(bench.SMOKE_DFLASH)
        args.context, args.runs, args.rounds_per_call = 64, 2, 2
    cfg = text_config_from_dict(raw, where="built-in Qwen3.6-27B shapes")
    dcfg = DrafterConfig(**dflash)
    dev = jax.devices()[0]
    target = random_target(cfg, "bfloat16", seed=0)
    if args.kernels:
        target = dataclasses.replace(target, kernels=args.kernels)
    drafter = bench.random_drafter(dcfg, jnp.bfloat16)
    slots = [int(s) for s in args.slots.split(",") if s]
    ab = {int(s) for s in args.truncate_ab.split(",") if s}
    R = args.rounds_per_call
    max_new = (args.runs + 3) * R * dcfg.block_size
    res = {"device": dev.device_kind, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
           "kernels": target.kernels, "context": args.context, "slot_rows": args.slot_rows,
           "rounds_per_call": R, "acceptance": args.acceptance, "by_slots": {},
           "method_note": "B=1: loop.loop_fn (generate's round, greedy); B>=2: batch.slots_fn (the pool's batched "
                          "round, sampling+truncation on, T=0 per slot); ms per round = call time / rounds"}

    if os.path.exists(args.out):  # merge: slot counts from an earlier run (e.g. --slots split over two calls) stay
        with open(args.out) as f:
            old = json.load(f)
        res["by_slots"] = old.get("by_slots", {})
        if "prefill_by_group" in old:
            res["prefill_by_group"] = old["prefill_by_group"]

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    leaves, dparams = target.leaves, drafter.params
    for B in slots:
        row = {}
        if B == 1:
            budget = args.single_budget
            plan = bench.make_plan(target, dcfg, "ddtree", budget)
            fn = loop_lib.loop_fn(target, dcfg, plan, R)
            oracle = jnp.zeros((1,), jnp.int32)
            state = slot_state(target, drafter, plan, args.context, max_new)
            ms, _, prog = time_calls(lambda s: fn(leaves, dparams, s, oracle), state, args.runs, R)
            row.update(budget=budget, round_ms=ms)
            del state
        else:
            budget = batch_lib.bucket_budget(B, args.slot_rows)
            variants = {"round_ms": (0.0, 0), "round_ms_sampled": (1.0, 0), "round_ms_truncated": (1.0, 20)}
            plan = batch_lib.batch_plan(target, dcfg, "ddtree", budget)
            for key, (temperature, top_k) in variants.items() if B in ab else [("round_ms", (0.0, 0))]:
                one = slot_state(target, drafter, plan, args.context, max_new, temperature).replace(
                    top_k=jnp.int32(top_k))
                bstate = jax.tree.map(lambda x: jnp.stack([x] * B), one)
                del one
                bstate = bstate.replace(budget=jnp.full((B,), budget, jnp.int32))
                fn = batch_lib.slots_fn(target, dcfg, plan, B, R)
                oracle = jnp.zeros((B, 1), jnp.int32)
                ms, bstate, prog = time_calls(lambda s: fn(leaves, dparams, s, oracle), bstate, args.runs, R)
                assert not bool(jnp.any(prog.done)), "a slot finished during the timing (raise max_new)"
                row[key] = ms
                del bstate
            row["budget"] = budget
        acc = acceptance_for(args.acceptance, row["budget"])
        row.update(acceptance=acc, tokens_per_s=B * acc / row["round_ms"] * 1e3, rows=B * (row["budget"] + 1))
        res["by_slots"][str(B)] = row
        log(f"B={B}: budget {row['budget']} ({row['rows']} rows) {row['round_ms']:.2f} ms/round, "
            f"{row['tokens_per_s']:.1f} tokens/s at acceptance {acc}"
            + (f"; sampled {row['round_ms_sampled']:.2f} ms, truncated {row['round_ms_truncated']:.2f} ms"
               if "round_ms_sampled" in row else ""))
        base = res["by_slots"].get("1")
        if base:
            for r in res["by_slots"].values():
                r["tokens_per_s_over_1"] = r["tokens_per_s"] / base["tokens_per_s"]
        save()
    groups = [int(k) for k in args.prefill_groups.split(",") if k]
    if groups:
        res["prefill_by_group"] = prefill_groups(target, drafter, dcfg, groups, args.prefill_prompt, args.runs, log)
        save()
    print(json.dumps(res, indent=1, sort_keys=True))


def prefill_groups(target, drafter, dcfg, groups, n_tokens: int, runs: int, log) -> dict:
    """ms to prefill + start K prompts of n_tokens, one by one and as one PrefillGroup, for each K in groups."""
    import numpy as np
    plan = batch_lib.batch_plan(target, dcfg, "ddtree", 0)
    chunk, S = loop_lib.capacity(target, dcfg, "ddtree", 63, n_tokens, 128)
    V = target.config.vocab_size
    rng = np.random.default_rng(0)

    def prefill(k):
        return [loop_lib.Prefill(target, drafter, plan, rng.integers(0, V, n_tokens), chunk, S, S, seed=i,
                                 stop_mask=np.zeros((V,), bool), temperature=0.0, max_new=128) for i in range(k)]

    def run(ps, together):
        t = time.perf_counter()
        if together:
            loop_lib.PrefillGroup(ps)
        for p in ps:
            while not p.advance():
                pass
        jax.block_until_ready([p.state for p in ps])
        return (time.perf_counter() - t) * 1e3

    out = {"prompt_tokens": n_tokens, "chunk": chunk, "cache_positions": S, "by_k": {}}
    for k in groups:
        row = {}
        for name, together in (("one_by_one_ms", False), ("group_ms", True)) if k > 1 else (("one_by_one_ms", False),):
            times = [run(prefill(k), together) for _ in range(runs + 1)][1:]  # the first compiles
            row[name] = statistics.median(times)
        if "group_ms" in row:
            row["speedup"] = row["one_by_one_ms"] / row["group_ms"]
        out["by_k"][str(k)] = row
        log(f"prefill of {k} x {n_tokens} tokens: " + ", ".join(f"{a} {b:.2f}" for a, b in row.items()))
    return out


if __name__ == "__main__":
    main()
