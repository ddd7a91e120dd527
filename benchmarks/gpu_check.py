#!/usr/bin/env python
"""End-to-end token checks on the GPU, JSON summary on the last stdout line (and in --out).

Sections (`--sections`, default all):
  pair  the tiny fp32 built-in pair: kernels="pallas" tokens == kernels="xla" (AR, chain DFlash, DDTree), and
        DDTree == DFlash == AR on the Pallas path; then AR on a bf16 model wide enough for the Pallas GEMV
        (agreement reported, not asserted).
  real  Qwen3.6-27B widths (hidden 5120, head_dim 256, GDN 16 x 128 keys / 48 x 128 values, MLP 17408, vocab
        248320; `--layers` layers, default 8) with random weights, and a random drafter of the 27B DFlash widths.
        fp32: DFlash / DDTree tokens == AR tokens and pallas == xla (asserted: `ok`); bf16: tokens until the
        first divergence, pallas vs xla and DDTree vs AR (reported).
  long  a >= 20K-token prompt (`--long-prompt`, default 20480) on a small-width fp32 model + drafter:
        pallas == xla tokens for AR and DDTree (asserted), i.e. the chunked prefill kernels at long context.
`--quick`: fewer new tokens and no xla DFlash run (what the 4-minute H200 call runs). `--smoke`: tiny shapes
that run on a CPU (there the "pallas" runs use kernels="xla": the script's structure is what is checked).
`--kernels V`: a benchmark variant of the Pallas path (`kernels_pallas.ops.VARIANTS`) in place of "pallas"; in
`real` its bf16 DDTree tokens must then equal the default "pallas" path's (asserted: the variants that change only
which kernels run, e.g. "pallas:split_mlp", promise the same bits).
Exit code 1 when an asserted check fails."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np
import jax
import jax.numpy as jnp

import jaxddtree
from jaxddtree.checkpoint import builtin
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.target import random_target

from bench import DFLASH_27B, QWEN36_27B, SMOKE_DFLASH, SMOKE_TARGET, random_drafter

SECTIONS = ("pair", "real", "long")


def first_divergence(a, b):
    """Index of the first differing token (None: identical; the shorter length if one is a prefix)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def run(target, prompt, kernels, method, drafter, new, out, tag):
    """method "auto": DDTree with tree_budget="auto" (the lax.switch over the candidate budgets)."""
    target.kernels = kernels
    kw = {} if method == "ar" else {"drafter": drafter}
    if method in ("ddtree", "auto"):
        kw["tree_budget"] = 64 if method == "ddtree" else "auto"
        method = "ddtree"
    t = time.time()
    g = jaxddtree.generate(target, prompt, method=method, max_new_tokens=new, **kw)
    out.setdefault("seconds", {})[tag] = round(time.time() - t, 2)
    print(f"{tag}: {len(g.tokens)} tokens in {time.time() - t:.1f} s", flush=True)
    return list(g.tokens)


def section_pair(args, out, pk):
    m = builtin.load(dtype="float32")
    target, drafter = m.target, m.drafter
    prompt = np.random.RandomState(0).randint(0, 256, 37)
    res = out["pair"] = {}
    toks = {}
    methods = ("ar", "dflash", "ddtree", "auto")
    for method in methods:
        for k in ("xla", pk):
            toks[method, k] = run(target, prompt, k, method, drafter, 48, res, f"pair_{method}_{k}")
        res[f"{method}_identical"] = toks[method, "xla"] == toks[method, pk]
    res["speculative_equals_ar"] = toks["dflash", pk] == toks["ar", pk] == toks["ddtree", pk] == toks["auto", pk]
    res["ok"] = res["speculative_equals_ar"] and all(res[f"{m}_identical"] for m in methods)
    # bf16, wide enough that the decode step's projections take the Pallas GEMV (ops.pick)
    cfg = text_config_from_dict({
        "model_type": "qwen3_5_text", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "linear_num_key_heads": 4, "linear_num_value_heads": 12, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}})
    tb = random_target(cfg, "bfloat16", seed=0)
    t = {k: run(tb, prompt, k, "ar", None, 48, res, f"pair_bf16_ar_{k}") for k in ("xla", pk)}
    res["ar_bf16_identical"] = t["xla"] == t[pk]
    res["ar_bf16_first_divergence"] = first_divergence(t["xla"], t[pk])


def real_configs(args):
    raw = dict(QWEN36_27B, num_hidden_layers=args.layers)
    dflash = dict(DFLASH_27B, num_target_layers=args.layers,
                  target_layer_ids=tuple(sorted({1, args.layers // 4, args.layers // 2, 3 * args.layers // 4,
                                                 args.layers - 1}))[-DFLASH_27B["num_layers"]:])
    if args.smoke:
        raw.update(SMOKE_TARGET, num_hidden_layers=args.layers)
        dflash.update(SMOKE_DFLASH, num_target_layers=args.layers)
    dflash["num_layers"] = len(dflash["target_layer_ids"]) if not args.smoke else dflash["num_layers"]
    dflash["layer_windows"] = tuple(dflash["layer_windows"])[-dflash["num_layers"]:]
    return text_config_from_dict(raw, where="Qwen3.6-27B widths"), DrafterConfig(**dflash)


def section_real(args, out, pk):
    cfg, dcfg = real_configs(args)
    new = 24 if args.quick else 48
    rng = np.random.RandomState(1)
    prompt = rng.randint(0, cfg.vocab_size - 1, args.real_prompt)
    res = out["real"] = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "prompt": len(prompt),
                         "max_new_tokens": new}
    for dt in ("float32", "bfloat16"):
        target = random_target(cfg, dt, seed=0)
        drafter = random_drafter(dcfg, jnp.dtype(dt), seed=1)
        runs = [("ar", pk), ("dflash", pk), ("ddtree", pk), ("ar", "xla"), ("ddtree", "xla")]
        if dt == "float32" and not args.quick:
            runs.append(("dflash", "xla"))
        if dt == "bfloat16":
            runs.remove(("dflash", pk))
        toks = {(m, k): run(target, prompt, k, m, drafter, new, res, f"real_{dt}_{m}_{k}") for m, k in runs}
        r = res[dt] = {}
        for m in ("ar", "dflash", "ddtree"):
            if (m, "xla") in toks and (m, pk) in toks:
                r[f"{m}_pallas_vs_xla_first_divergence"] = first_divergence(toks[m, pk], toks[m, "xla"])
            for k in ("xla", pk):
                if m != "ar" and (m, k) in toks:
                    r[f"{m}_vs_ar_{k}_first_divergence"] = first_divergence(toks[m, k], toks["ar", k])
        if dt == "bfloat16" and pk not in ("pallas", "xla"):  # a variant: the default Pallas path's bits
            base = run(target, prompt, "pallas", "ddtree", drafter, new, res, f"real_{dt}_ddtree_pallas")
            r["ddtree_vs_default_pallas_first_divergence"] = first_divergence(toks["ddtree", pk], base)
            r["ok"] = r["ddtree_vs_default_pallas_first_divergence"] is None
        if dt == "float32":  # exact: every pair identical
            r["ok"] = all(v is None for v in r.values())
        del target, drafter
        gc.collect()
    res["ok"] = res["float32"]["ok"] and res["bfloat16"].get("ok", True)


def section_long(args, out, pk):
    n = args.long_prompt
    raw = dict(QWEN36_27B, vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128)
    dflash = dict(DFLASH_27B, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                  intermediate_size=1024, target_layer_ids=(1, 3), mask_token_id=8191, vocab_size=8192,
                  num_target_layers=4, layer_windows=(2048, None))
    if args.smoke:
        raw.update(SMOKE_TARGET, num_hidden_layers=4)
        dflash.update(SMOKE_DFLASH, num_target_layers=4, target_layer_ids=(1, 3))
    cfg = text_config_from_dict(raw, where="long-prompt model")
    target = random_target(cfg, "float32", seed=2)
    drafter = random_drafter(DrafterConfig(**dflash), jnp.float32, seed=3)
    prompt = np.random.RandomState(2).randint(0, cfg.vocab_size - 1, n)
    new = 16 if args.quick else 32
    res = out["long"] = {"prompt": n, "hidden": cfg.hidden_size, "max_new_tokens": new}
    for m in ("ar", "ddtree"):
        t = {k: run(target, prompt, k, m, drafter, new, res, f"long_{m}_{k}") for k in ("xla", pk)}
        res[f"{m}_pallas_vs_xla_first_divergence"] = first_divergence(t[pk], t["xla"])
    res["ok"] = all(res[f"{m}_pallas_vs_xla_first_divergence"] is None for m in ("ar", "ddtree"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer new tokens, no xla DFlash run at real widths")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    p.add_argument("--layers", type=int, default=8, help="layers of the real-width model (default: 8)")
    p.add_argument("--real-prompt", type=int, default=64, help="prompt tokens at real widths (default: 64)")
    p.add_argument("--long-prompt", type=int, default=20480, help="prompt tokens of the long check (default: 20480)")
    p.add_argument("--kernels", default="pallas", help="the Pallas path or one of its benchmark variants (default: "
                   "pallas)")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section {bad[0]} (choose from {SECTIONS})")
    if args.smoke:
        args.layers = min(args.layers, 8)
        args.real_prompt = min(args.real_prompt, 16)
        args.long_prompt = min(args.long_prompt, 160)
    from kernels_pallas import ops
    if args.kernels not in ops.VARIANTS:
        p.error(f"unknown kernels '{args.kernels}' (one of {', '.join(ops.VARIANTS)})")
    gpu = jax.default_backend() == "gpu"
    pk = args.kernels if gpu else "xla"  # the Pallas kernels need a GPU
    out = {"device": jax.devices()[0].device_kind, "kernels_under_test": pk, "quick": args.quick,
           "smoke": args.smoke}
    t0 = time.time()
    for s in sections:
        {"pair": section_pair, "real": section_real, "long": section_long}[s](args, out, pk)
        if args.out:
            json.dump(out, open(args.out, "w"), indent=1)
    out["ok"] = all(out[s]["ok"] for s in sections)
    out["total_s"] = round(time.time() - t0, 1)
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
