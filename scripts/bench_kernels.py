"""Pallas kernels vs their XLA (jnp) references at Qwen3.6-27B shapes, on one GPU.

    PYTHONUNBUFFERED=1 python scripts/bench_kernels.py --out $OUT/kernels.json [--sections tree,attn,decode,prefill]
    JAX_PLATFORMS=cpu python scripts/bench_kernels.py --dry     # tiny shapes, interpret mode: checks the script

For every kernel: relative error ||out − ref|| / ||ref|| vs the jnp reference on fresh random inputs
(q,k l2-normalised, g in [-2, 0), beta in (0, 1), random trees with padding rows), then the median wall
time of ONE jitted call that runs the op for every layer (48 GDN / 16 attention layers, each layer with
its own inputs, so nothing stays in L2), after warm-up, with block_until_ready. Several tuning variants
per kernel (the first is the default); the fastest correct one is reported under the summary keys. Each
section has a time budget (variants past it are skipped) and the JSON is rewritten after every section.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import gdn_decode, gdn_prefill, gdn_tree, tree_attention  # noqa: E402
from kernels_pallas._testing import attention_inputs, gdn_inputs, random_tree_mask, rel_err  # noqa: E402

# 27B shapes
HK, HV, DK, DV = 16, 48, 128, 128
H, HKV, HD = 24, 4, 256
GDN_LAYERS, ATTN_LAYERS = 48, 16
TREE_N, PREFIX, PREFILL_T = 65, 4096, 8192
DRY = False  # --dry: tiny shapes, interpret mode, CPU (checks this script, not the kernels' speed)
BUDGET = {"tree": 120, "attn": 120, "decode": 40, "prefill": 60}  # seconds per section

RESULTS: dict = {}


def IKW():
    return {"interpret": True} if DRY else {}


def log(*a):
    print(*a, flush=True)


def save(path):
    if path:
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)


def timeit(f, args, reps=30, warmup=3):
    if DRY:
        reps, warmup = 1, 0
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts), 1e3 * min(ts)


def run_variants(section, variants, make_fn, args, check, deadline, reps=30):
    """variants: {name: kwargs or None (reference)}; make_fn(kw) -> f(*args); check(outputs) -> errors."""
    out = {}
    for name, kw in variants.items():
        rec = {"kwargs": None if kw is None else {k: str(v) for k, v in kw.items()}}
        if time.perf_counter() > deadline:
            rec["skipped"] = "section time budget spent"
            log(f"  [{section}] {name:28s} skipped (budget)")
            out[name] = rec
            continue
        try:
            t0 = time.perf_counter()
            f = jax.jit(make_fn(kw))
            outs = jax.block_until_ready(f(*args))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            rec["rel_err"] = check(outs)
            rec["ms"], rec["ms_min"] = timeit(f, args, reps=reps)
            log(f"  [{section}] {name:28s} {rec['ms']:9.3f} ms (min {rec['ms_min']:.3f})  err {rec['rel_err']}"
                f"  compile+1st {rec['compile_s']} s")
        except Exception as e:  # keep going: one bad variant must not sink the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"  [{section}] {name:28s} FAILED {rec['error'][:600]}")
            traceback.print_exc(limit=2)
        out[name] = rec
    return out


def best(recs, max_err=None):
    ok = {k: v for k, v in recs.items() if "ms" in v and v.get("kwargs") is not None
          and (max_err is None or max(v["rel_err"].values()) <= max_err)}
    if not ok:
        return None, None
    name = min(ok, key=lambda k: ok[k]["ms"])
    return name, ok[name]["ms"]


def errs(pairs):
    return {n: float(f"{rel_err(a, b):.3g}") for n, a, b in pairs}


def over_layers(fn):
    return lambda layers: [fn(*a) for a in layers]


# ----------------------------------------------------------------------------- GDN tree verify
def section_tree():
    N = TREE_N
    log(f"== GDN tree verify: N={N}, Hv={HV}, Hk={HK}, dk={DK}, dv={DV}, x{GDN_LAYERS} layers")
    deadline = time.perf_counter() + BUDGET["tree"]
    rng = np.random.default_rng(0)
    layers = []
    for l in range(GDN_LAYERS):
        mask, valid = random_tree_mask(rng, 1, N, n_pad=3)
        q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(l), 1, N, HK, HV, DK, DV, valid=valid)
        layers.append((q, k, v, g, beta, mask, state))
    layers = jax.device_put(layers)
    ref0 = [np.asarray(x) for x in jax.jit(gdn_tree.gdn_masked_block_reference)(*layers[0])]
    check = lambda outs: errs(zip("oWG", outs[0], ref0))
    variants = {
        "xla_reference": None,
        "bv64_bt16_w4_tf32x3": dict(block_v=64),
        "bv32_bt16_w4_tf32x3": dict(block_v=32),
        "bv32_bt16_w2_tf32x3": dict(block_v=32, num_warps=2),
        "bv128_bt16_w4_tf32x3": dict(block_v=128),
        "bv64_bt32_w4_tf32x3": dict(block_v=64, block_t=32),
        "bv32_bt16_w4_ieee": dict(block_v=32, precision="ieee"),
        "bv64_bt16_w4_ieee": dict(block_v=64, precision="ieee"),
        "bv32_bt16_w4_tf32": dict(block_v=32, precision="tf32"),
    }
    make = lambda kw: over_layers(gdn_tree.gdn_masked_block_reference if kw is None
                                  else functools.partial(gdn_tree.gdn_masked_block, **kw, **IKW()))
    recs = run_variants("tree", variants, make, (layers,), check, deadline)
    RESULTS["gdn_tree"] = recs
    name, ms = best(recs, max_err=1e-4)
    RESULTS["gdn_tree_verify_ms_48_layers"] = {str(N): ms}
    RESULTS["gdn_tree_verify_best_variant"] = name
    RESULTS["gdn_tree_verify_xla_ms_48_layers"] = {str(N): recs["xla_reference"].get("ms")}
    name_any, ms_any = best(recs)
    if name_any != name:
        RESULTS["gdn_tree_verify_fastest_any_precision"] = {"variant": name_any, "ms": ms_any}


# ----------------------------------------------------------------------------- tree attention
def section_attn(T, variants, tag):
    S = PREFIX + 64
    log(f"== attention ({tag}): T=N={T}, H={H}, Hkv={HKV}, hd={HD}, prefix {PREFIX} (cache {S}), x{ATTN_LAYERS}")
    deadline = time.perf_counter() + BUDGET["attn"] * (0.75 if T > 1 else 0.25)
    rng = np.random.default_rng(1)
    layers = [attention_inputs(jax.random.PRNGKey(100 + l), rng if T > 1 else None, 1, T, H, HKV, HD, S, PREFIX,
                               dtype=jnp.bfloat16, n_pad=3 if T > 1 else 0) for l in range(ATTN_LAYERS)]
    layers = jax.device_put(layers)
    a0 = layers[0]
    ref0 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*a0).astype(jnp.float32))
    up = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a0)
    ref32 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*up))

    def check(outs):
        o = np.asarray(outs[0].astype(jnp.float32))
        return errs([("vs_bf16_ref", o, ref0), ("vs_fp32_ref", o, ref32)])

    make = lambda kw: over_layers(tree_attention.tree_attention_reference if kw is None
                                  else functools.partial(tree_attention.tree_attention, **kw, **IKW()))
    return run_variants(tag, variants, make, (layers,), check, deadline)


# ----------------------------------------------------------------------------- GDN decode
def section_decode():
    log(f"== GDN decode step x{GDN_LAYERS} layers (states donated, updated in place)")
    deadline = time.perf_counter() + BUDGET["decode"]
    xs, states0 = [], []
    for l in range(GDN_LAYERS):
        q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(200 + l), 1, 1, HK, HV, DK, DV)
        xs.append((q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]))
        states0.append(np.asarray(state))
    xs = jax.device_put(xs)
    r0 = [np.asarray(x) for x in jax.jit(gdn_decode.gdn_step_reference)(*xs[0], jnp.asarray(states0[0]))]
    variants = {
        "xla_reference": None,
        "bv32_w4": dict(block_v=32, num_warps=4),
        "bv64_w4": dict(block_v=64, num_warps=4),
        "bv16_w2": dict(block_v=16, num_warps=2),
        "bv64_w8": dict(block_v=64, num_warps=8),
        "bv128_w8": dict(block_v=128, num_warps=8),
    }
    recs = {}
    for name, kw in variants.items():
        rec = {"kwargs": kw}
        if time.perf_counter() > deadline:
            recs[name] = dict(rec, skipped="section time budget spent")
            continue
        try:
            fn = gdn_decode.gdn_step_reference if kw is None else functools.partial(gdn_decode.gdn_step, **kw, **IKW())
            f = jax.jit(lambda xs, states: [fn(*a, s) for a, s in zip(xs, states)], donate_argnums=1)
            states = [jnp.asarray(s) for s in states0]
            t0 = time.perf_counter()
            outs = jax.block_until_ready(f(xs, states))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            rec["rel_err"] = errs([("o", outs[0][0], r0[0]), ("state", outs[0][1], r0[1])])
            states = [s for _, s in outs]
            reps, warmup = (1, 0) if DRY else (50, 3)
            ts = []
            for i in range(warmup + reps):
                t = time.perf_counter()
                outs = jax.block_until_ready(f(xs, states))
                if i >= warmup:
                    ts.append(time.perf_counter() - t)
                states = [s for _, s in outs]
            rec["ms"], rec["ms_min"] = 1e3 * statistics.median(ts), 1e3 * min(ts)
            log(f"  [decode] {name:20s} {rec['ms']:9.3f} ms (min {rec['ms_min']:.3f})  err {rec['rel_err']}")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"  [decode] {name:20s} FAILED {rec['error'][:600]}")
        recs[name] = rec
    RESULTS["gdn_decode"] = recs
    name, ms = best({k: dict(v, kwargs=v["kwargs"] if v["kwargs"] is not None else None) for k, v in recs.items()},
                    max_err=1e-4)
    RESULTS["gdn_decode_ms_48_layers"] = ms
    RESULTS["gdn_decode_best_variant"] = name
    RESULTS["gdn_decode_xla_ms_48_layers"] = recs["xla_reference"].get("ms")
    mib = GDN_LAYERS * 2 * HV * DK * DV * 4 / 2**20
    RESULTS["gdn_decode_state_traffic_MiB"] = mib
    RESULTS["gdn_decode_floor_ms"] = {"at_3.31TBps_elementwise": mib * 2**20 / 3.31e12 * 1e3,
                                      "at_4.2TBps_copy": mib * 2**20 / 4.2e12 * 1e3}


# ----------------------------------------------------------------------------- GDN prefill
def section_prefill():
    T = PREFILL_T
    log(f"== GDN chunked prefill: T={T}, one layer (x{GDN_LAYERS} projected)")
    deadline = time.perf_counter() + BUDGET["prefill"]
    args = jax.device_put(gdn_inputs(jax.random.PRNGKey(300), 1, T, HK, HV, DK, DV))
    ref = [np.asarray(x) for x in jax.jit(gdn_prefill.gdn_chunked_reference)(*args)]
    check = lambda outs: errs([("o", outs[0], ref[0]), ("state", outs[1], ref[1])])
    variants = {
        "xla_reference": None,
        "bv64_w4_tf32x3": dict(block_v=64),
        "bv128_w8_tf32x3": dict(block_v=128, num_warps=8),
        "bv32_w4_tf32x3": dict(block_v=32),
        "bv64_w4_ieee": dict(block_v=64, precision="ieee"),
    }
    make = lambda kw: (gdn_prefill.gdn_chunked_reference if kw is None
                       else functools.partial(gdn_prefill.gdn_chunked, **kw, **IKW()))
    recs = run_variants("prefill", variants, make, args, check, deadline, reps=10)
    try:  # the jnp intra-chunk part alone (the rest of a kernel variant's time is the Pallas recurrence)
        f = jax.jit(lambda q, k, v, g, beta: gdn_prefill.intra_chunk(q, k, v, g, beta, 64))
        jax.block_until_ready(f(*args[:5]))
        recs["intra_chunk_jnp_only"] = {"ms": timeit(f, args[:5], reps=10)[0]}
        log(f"  [prefill] intra_chunk_jnp_only {recs['intra_chunk_jnp_only']['ms']:.3f} ms")
    except Exception as e:
        recs["intra_chunk_jnp_only"] = {"error": str(e)[:500]}
    RESULTS["gdn_prefill"] = recs
    name, ms = best({k: v for k, v in recs.items() if k != "intra_chunk_jnp_only"}, max_err=1e-4)
    RESULTS["gdn_prefill_ms_8k_1_layer"] = ms
    RESULTS["gdn_prefill_ms_8k_48_layers_projected"] = None if ms is None else 48 * ms
    RESULTS["gdn_prefill_best_variant"] = name
    xla = recs["xla_reference"].get("ms")
    RESULTS["gdn_prefill_xla_ms_8k_1_layer"] = xla
    RESULTS["gdn_prefill_xla_ms_8k_48_layers_projected"] = None if xla is None else 48 * xla


def main():
    global DRY, HK, HV, DK, DV, H, HKV, HD, GDN_LAYERS, ATTN_LAYERS, TREE_N, PREFIX, PREFILL_T
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--sections", default="tree,attn,decode,prefill")
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--budget-scale", type=float, default=1.0)
    args = ap.parse_args()
    for k in BUDGET:
        BUDGET[k] *= args.budget_scale
    if args.dry:
        DRY = True
        HK, HV, DK, DV, H, HKV, HD = 1, 3, 16, 32, 4, 2, 16
        GDN_LAYERS, ATTN_LAYERS, TREE_N, PREFIX, PREFILL_T = 2, 2, 19, 64, 128
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dry=DRY,
                   method="median wall time of one jitted call running the op for every layer (each layer its "
                          "own inputs), after warm-up, block_until_ready; rel_err = ||out-ref||/||ref|| vs the "
                          "jnp reference (attention: also vs the reference on fp32-upcast inputs)")
    log(json.dumps(RESULTS))
    t_all = time.perf_counter()
    secs = args.sections.split(",")
    for sec in secs:
        try:
            if sec == "tree":
                section_tree()
            elif sec == "attn":
                recs = section_attn(TREE_N, {
                    "xla_reference": None,
                    "bm64_bk64_w4_s2": dict(block_m=64, block_k=64, num_warps=4, num_stages=2),
                    "bm64_bk64_w8_s2": dict(block_m=64, block_k=64, num_warps=8, num_stages=2),
                    "bm128_bk64_w8_s2": dict(block_m=128, block_k=64, num_warps=8, num_stages=2),
                    "bm64_bk64_w8_s3_split8": dict(block_m=64, block_k=64, num_warps=8, num_stages=3, n_split=8),
                    "bm32_bk64_w4_s2": dict(block_m=32, block_k=64, num_warps=4, num_stages=2),
                    "bm64_bk128_w8_s2": dict(block_m=64, block_k=128, num_warps=8, num_stages=2),
                    "bm64_bk64_w8_s2_fp32part": dict(block_m=64, block_k=64, num_warps=8, num_stages=2,
                                                     partial_dtype=jnp.float32),
                    "bm128_bk64_w8_s2_split3": dict(block_m=128, block_k=64, num_warps=8, num_stages=2, n_split=3),
                }, "tree_attn")
                RESULTS["tree_attention"] = recs
                name, ms = best(recs, max_err=2e-2)
                RESULTS["tree_attention_ms_16_layers"] = {str(TREE_N): ms}
                RESULTS["tree_attention_best_variant"] = name
                RESULTS["tree_attention_xla_ms_16_layers"] = {str(TREE_N): recs["xla_reference"].get("ms")}
                save(args.out)
                recs1 = section_attn(1, {"xla_reference": None, "default": {},
                                         "bk128_w4": dict(block_k=128, num_warps=4)}, "decode_attn")
                RESULTS["decode_attention"] = recs1
                name1, ms1 = best(recs1, max_err=2e-2)
                RESULTS["decode_attention_ms_16_layers"] = {"1": ms1}
                RESULTS["decode_attention_best_variant"] = name1
                RESULTS["decode_attention_xla_ms_16_layers"] = {"1": recs1["xla_reference"].get("ms")}
            elif sec == "decode":
                section_decode()
            elif sec == "prefill":
                section_prefill()
        except Exception as e:
            RESULTS[f"{sec}_section_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"section {sec} FAILED: {e}")
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save(args.out)
    log("\n== summary")
    for k, v in RESULTS.items():
        if k.endswith(("layers", "layer", "variant", "projected", "MiB", "precision")) or "floor" in k:
            log(f"  {k}: {v}")


if __name__ == "__main__":
    main()
