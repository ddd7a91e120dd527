#!/usr/bin/env python
"""`--budget auto` vs every fixed budget: projected tokens/s at 27B for committed contexts 4K / 32K / 128K.

    python benchmarks/bench_auto_budget.py --costs benchmarks/results/h200.json --out benchmarks/results/h200.json
    python benchmarks/bench_auto_budget.py --smoke --out /tmp/auto_budget.json     # made-up round times, CPU

Runs on the CPU (the demo pair is tiny; the GPU is not needed): the shipped demo pair (demo/, fp32) generates
from held-out prompts (64-token windows of the held-out stdlib files, as scripts/train_drafter.py's evaluation)
at T = 0 with each fixed candidate (chain DFlash, DDTree 16 / 32 / 64 / 128) and with auto, and the tokens per
round of each are combined with the 27B round times of --costs (`round_ms_by_budget_context`: {"chain" |
"<budget>": {"<context>": ms}}, measured by benchmarks/bench.py on the H200):

- fixed budget b at context C: projected tok/s = 1000 · (tokens emitted / rounds) / c(b, C);
- auto at context C: the generation runs with the 27B table at C plugged in (constant in the committed length,
  `CostTable.flat`: the demo's own contexts are short), so its per-round choices are the ones it would make at
  27B; projected tok/s = 1000 · Σ tokens / Σ_rounds c_auto(chosen budget, C), where c_auto is the auto round
  forced to that budget (`auto_round_ms_by_budget_context`: it drafts and builds the largest tree every round)
  when --costs has it, else the fixed-budget round time (then `auto_cost` says "fixed rounds (optimistic)").

Writes `auto_budget.<context>` = {budget (auto's most chosen), budget_counts, projected_tok_s, best_fixed_tok_s,
best_fixed_budget, ratio (auto / best fixed), fixed_tok_s, tokens_per_round, ...} into --out (merged into an
existing JSON object) and prints it. All outputs are checked to equal the AR tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# made-up 27B-like round times for --smoke (ms): not measurements
SMOKE_COSTS = {"round_ms_by_budget_context": {
    "chain": {"4096": 17.4, "131072": 20.6}, "16": {"4096": 18.6, "131072": 23.5},
    "32": {"4096": 19.4, "131072": 26.5}}}


def log(msg):
    print(f"bench_auto_budget: {msg}", file=sys.stderr, flush=True)


def heldout_prompts(tok, n: int, length: int, seed: int = 1) -> list[list[int]]:
    """n prompts of `length` tokens from the held-out stdlib files (starting at line starts); this repository's
    own sources when that library is not on this machine."""
    from jaxddtree.training import tokenizer as tk

    held = None
    if not os.path.isdir(tk.STDLIB):
        held = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "jaxddtree")) for f in fs
                      if f.endswith(".py"))
        log(f"{tk.STDLIB} not found: prompts from jaxddtree/*.py instead")
    return tk.heldout_prompts(tok, n, length, seed, held)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", default=os.path.join(ROOT, "benchmarks", "results", "h200.json"),
                    help="JSON with round_ms_by_budget_context (and optionally auto_round_ms_by_budget_context)")
    ap.add_argument("--contexts", default="4096,32768,131072", help="committed contexts to project")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (fewer: noisier; 4 moved the ratio by 2 %%)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", required=True, help="JSON file to merge auto_budget into")
    ap.add_argument("--smoke", action="store_true", help="made-up round times (chain, 16, 32), 1 short prompt")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import numpy as np
    from transformers import AutoTokenizer

    import jaxddtree
    from jaxddtree.speculative import budget as B

    if args.smoke:
        raw = SMOKE_COSTS
        args.prompts, args.max_new = 1, 24
        source = "made-up (--smoke)"
    else:
        with open(args.costs) as f:
            raw = json.load(f)
        source = args.costs
    fixed_table = B.from_dict(raw[B.TABLE_KEY], source)
    auto_table = B.from_dict(raw[B.AUTO_TABLE_KEY], source) if B.AUTO_TABLE_KEY in raw else None
    cands = fixed_table.candidates
    contexts = [int(c) for c in args.contexts.split(",")]

    demo = os.path.join(ROOT, "demo")
    target = jaxddtree.load_target(os.path.join(demo, "target"), dtype="float32")
    drafter = jaxddtree.load_drafter(os.path.join(demo, "drafter"), target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(os.path.join(demo, "target"))
    prompts = heldout_prompts(tok, args.prompts, args.prompt_len)
    gen = lambda p, **kw: jaxddtree.generate(target, p, drafter=drafter, max_new_tokens=args.max_new,
                                             loop="device", **kw)

    t0 = time.time()
    ar = [gen(p, method="ar").tokens for p in prompts]
    per_budget = {}  # name -> (tokens, rounds)
    for b in cands:
        kw = dict(method="dflash") if b == B.CHAIN else dict(method="ddtree", tree_budget=b)
        toks = rounds = 0
        for p, ref in zip(prompts, ar):
            g = gen(p, **kw)
            assert g.tokens == ref, f"budget {B.name(b)}: not the AR tokens"
            toks += sum(g.acceptance_lengths)
            rounds += len(g.acceptance_lengths)
        per_budget[B.name(b)] = (toks, rounds)
        log(f"{B.name(b)}: {toks / rounds:.3f} tokens/round ({time.time() - t0:.0f} s)")

    res = {}
    for C in contexts:
        c_fixed = {B.name(b): float(v) for b, v in zip(cands, fixed_table.at(C))}
        fixed = {n: 1000.0 * t / r / c_fixed[n] for n, (t, r) in per_budget.items()}
        best = max(fixed, key=fixed.get)
        c_auto = ({B.name(b): float(v) for b, v in zip(auto_table.candidates, auto_table.at(C))} if auto_table
                  else c_fixed)
        toks, ms, chosen = 0, 0.0, []
        for p, ref in zip(prompts, ar):
            g = gen(p, tree_budget="auto", method="ddtree", budget_costs=fixed_table.flat(C))
            assert g.tokens == ref, "auto: not the AR tokens"
            assert len(g.stats["budget_per_round"]) == len(g.acceptance_lengths)
            toks += sum(g.acceptance_lengths)
            ms += sum(c_auto[B.name(b)] for b in g.stats["budget_per_round"])
            chosen += g.stats["budget_per_round"]
        counts = B.summary(chosen)
        auto = 1000.0 * toks / ms
        res[str(C)] = {
            "budget": max(counts, key=counts.get), "budget_counts": counts, "projected_tok_s": round(auto, 2),
            "best_fixed_tok_s": round(fixed[best], 2), "best_fixed_budget": best,
            "ratio": round(auto / fixed[best], 4), "fixed_tok_s": {n: round(v, 2) for n, v in fixed.items()},
            "tokens_per_round": {n: round(t / r, 3) for n, (t, r) in per_budget.items()},
            "auto_tokens_per_round": round(toks / len(chosen), 3), "round_ms_fixed": {n: round(float(v), 3)
                                                                                       for n, v in c_fixed.items()},
            "auto_cost": "auto rounds (auto_round_ms_by_budget_context)" if auto_table else
                         "fixed rounds (optimistic: the auto round also builds the largest tree)",
        }
        log(f"context {C}: auto {auto:.1f} tok/s ({counts}) vs best fixed {best} {fixed[best]:.1f} "
            f"(ratio {auto / fixed[best]:.4f})")
    meta = {"costs": source, "prompts": len(prompts), "prompt_len": args.prompt_len, "max_new": args.max_new,
            "pair": "demo (fp32, CPU)", "date": time.strftime("%Y-%m-%d")}
    out = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out["auto_budget"] = res
    out["auto_budget_note"] = meta
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps({"auto_budget": res, "auto_budget_note": meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
