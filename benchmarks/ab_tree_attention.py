"""A/B: tree attention as the Pallas-Triton kernel vs the Pallas Mosaic GPU kernel (issue 27), 27B shapes, one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/ab_tree_attention.py --out $OUT/ab_tree_attention.json
    JAX_PLATFORMS=cpu python benchmarks/ab_tree_attention.py --smoke --out /tmp/ab.json   # interpret mode, tiny

For each context (committed keys, default 4096,32768,131072) and tree size T (default 16,32,64,65,128; N = T new
rows, one random tree with padding rows for every layer, as in a verify round), each kernel runs as LAYERS (16)
layer-calls inside one jitted function, every layer with its own K/V cache [1, 4, context + 128, 256] bf16 (so the
caches really stream from HBM) and `start` = context passed as a run-time int32:
  * gpu_ms: GPU time per call (all layers), the sum of the device kernels of a jax.profiler trace of `--prof`
    calls (kernels + the jnp prep / merge XLA ops; no launch gaps) — the figure to compare;
  * wall_ms: median wall time of `--reps` calls (block_until_ready; includes launch gaps);
  * tflops: effective TFLOP/s = LAYERS · 4·T·H·context·hd / gpu_ms (the issue's count: every tree row, prefix
    keys only; the H200's dense bf16 peak is 989);
  * errors (at the smallest context, layer 0): max |out − ref| and ||out − ref|| / ||ref|| vs the bf16 jnp
    reference and vs the reference on fp32-upcast inputs.
The jnp reference is timed at the smallest context only. Prefill rows (--prefill T:start, --prefill-layers
layers each with its own cache): the Triton `prefill_attention` vs the Mosaic GPU kernel's causal mode
(`prefill_attention_mgpu`), gpu_ms per layer, TFLOP/s of the causal work (`prefill_flops`), and the max / relative
difference between the two. The Mosaic GPU kernel's tuning variants
(--mgpu-variants) run at T = 65 (one at 128) for every context. A failing variant (compile or run
error) is recorded as {"error": ...} and the run goes on; work past --budget-s is listed in "skipped". The
order: T = 65 at every context, the variants at the longest context, the other tree sizes, prefill, the
variants at the other contexts. The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import prefill_attention as ptri  # noqa: E402
from kernels_pallas import prefill_attention_mgpu as pmg  # noqa: E402
from kernels_pallas import tree_attention as tri  # noqa: E402
from kernels_pallas import tree_attention_mgpu as mg  # noqa: E402
from kernels_pallas._testing import random_tree_mask  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_profile, log, save_json, wall_ms  # noqa: E402

# the Mosaic GPU kernel's tuning neighbours (name: kwargs), run at T = 65 (or _T)
# (default at T = 65 since session 9: 4 kv heads x (3 full row blocks x 9 splits + the light 4th x 6) = 132 CTAs,
# the best measured on the H200 at 128K: 6.79 ms vs 7.17 for 8 splits everywhere, 11.94 for 10 + 3)
MGPU_VARIANTS = {
    "ns8_all": dict(n_split=8, tail_split=8),  # the session-8 default: every row block on 8 splits (128 CTAs)
    "ns8_tail9": dict(n_split=8, tail_split=9),  # 4 x (3 x 8 + 9) = 132: the light CTAs on shorter ranges
    "ns18_tail12": dict(n_split=18, tail_split=12),  # two full waves (264 CTAs), the same balance as 9 + 6
    "ns16": dict(n_split=16),  # two waves
    "ns4": dict(n_split=4),
    "no_pingpong": dict(pingpong=False),
    "s1": dict(num_stages=1),
    "bk128_s1": dict(block_k=128, num_stages=1),  # QKᵀ at n = 128 (less SMEM traffic per flop), K/V not ringed
    "T128_ns11": dict(n_split=11, _T=128),  # T = 128: 6 x 4 x 11 = 264 CTAs, two full waves (default 5: 120)
}


def caches_for(key, layers, B, Hkv, hd, S, dtype):
    """Per layer (k_cache, v_cache): generated on the device, layer by layer."""
    gen = jax.jit(lambda k: (jax.random.normal(jax.random.fold_in(k, 0), (B, Hkv, S, hd), dtype),
                             jax.random.normal(jax.random.fold_in(k, 1), (B, Hkv, S, hd), dtype)))
    return [gen(jax.random.fold_in(key, i)) for i in range(layers)]


def small_inputs(key, rng, layers, B, T, H, Hkv, hd, dtype):
    """(mask, per layer (q, k_new, v_new)): one random tree mask for every layer, as in a verify round."""
    mask, _ = random_tree_mask(rng, B, T, n_pad=min(3, T - 1))
    out = []
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, 1000 + i), 3)
        q = jax.random.normal(ks[0], (B, T, H, hd), dtype)
        kn = jax.random.normal(ks[1], (B, T, Hkv, hd), dtype)
        vn = jax.random.normal(ks[2], (B, T, Hkv, hd), dtype)
        out.append((q, kn, vn))
    return mask, out


def all_layers(fn):
    """One jitted function running fn for every layer: (start, mask, caches, smalls) -> per-layer outputs (start and
    the mask are one argument each, shared by the layers)."""
    def run(start, mask, caches, smalls):
        return [fn(q, kc, vc, start, kn, vn, mask) for (kc, vc), (q, kn, vn) in zip(caches, smalls)]
    return jax.jit(run)


def errors(out, ref, ref32):
    o = np.asarray(out, np.float32)
    r = np.asarray(ref, np.float32)
    r32 = np.asarray(ref32, np.float32)
    rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return {"max_abs_vs_bf16_ref": float(np.max(np.abs(o - r))), "rel_vs_bf16_ref": rel(o, r),
            "max_abs_vs_fp32_ref": float(np.max(np.abs(o - r32))), "rel_vs_fp32_ref": rel(o, r32),
            "finite": bool(np.all(np.isfinite(o)))}


def measure(name, fn, start, mask, caches, smalls, flops, args):
    """{compile_s, gpu_ms, wall_ms, tflops} of fn over every layer, or {"error": ...}."""
    rec = {}
    try:
        f = all_layers(fn)
        t0 = time.perf_counter()
        out = jax.block_until_ready(f(start, mask, caches, smalls))
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        rec["wall_ms"] = round(wall_ms(f, (start, mask, caches, smalls), reps=args.reps, warmup=1), 4)
        prof = None if args.smoke else gpu_profile(f, (start, mask, caches, smalls), n=args.prof, top=4)
        if prof is not None:
            rec["gpu_ms"] = round(prof["us"] / 1e3, 4)
            rec["launches"] = prof["launches"]
            rec["top_kernels"] = prof["top"]
        ms = rec.get("gpu_ms") or rec["wall_ms"]
        rec["tflops"] = float(f"{flops / (ms * 1e-3) / 1e12:.4g}")
        log(f"    {name:24s} gpu {rec.get('gpu_ms')} ms  wall {rec['wall_ms']} ms  {rec['tflops']} TFLOP/s  "
            f"compile {rec['compile_s']} s")
        return rec, out
    except Exception as e:  # one failing variant must not sink the run
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        log(f"    {name:24s} FAILED {rec['error'][:500]}")
        traceback.print_exc(limit=3)
        return rec, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--nodes", default="16,32,64,65,128")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prof", type=int, default=5, help="calls in the profiler trace")
    ap.add_argument("--mgpu-variants", default=",".join(MGPU_VARIANTS), help="comma list ('' for none)")
    ap.add_argument("--budget-s", type=float, default=180.0, help="skip the rows not started by then")
    ap.add_argument("--prefill", default="4096:0,4096:122880",
                    help="causal prefill rows T:start ('' for none), each --prefill-layers layers")
    ap.add_argument("--prefill-layers", type=int, default=2)
    ap.add_argument("--batched", type=int, default=4,
                    help="slots of the vmapped check (the pool's batched round: one start per slot; 0: none)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    args = ap.parse_args()
    H, Hkv, hd, dtype = 24, 4, 256, jnp.bfloat16
    contexts = [int(c) for c in args.contexts.split(",")]
    nodes = [int(t) for t in args.nodes.split(",")]
    layers = args.layers
    ikw = {}
    if args.smoke:
        gpu_timing.QUICK = True
        H, Hkv, hd, layers, ikw = 4, 2, 64, 2, {"interpret": True}
        contexts, nodes = [100], [5]
        args.prefill = "24:40" if args.prefill else ""
    t_end = time.perf_counter() + args.budget_s
    dev = jax.devices()[0]
    res = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "smoke": args.smoke, "layers": layers, "shapes": dict(H=H, Hkv=Hkv, hd=hd, dtype="bfloat16",
                                                                  cache="context + 128"),
           "method": __doc__.split("For each context")[1].split("The JSON")[0].strip(),
           "rows": {}, "errors": {}, "prefill": {}, "mgpu_variants": {}}
    log(json.dumps({k: v for k, v in res.items() if k not in ("method", "rows", "errors", "mgpu_variants")}))
    kernels = {"triton": lambda *a: tri.tree_attention(*a, **ikw), "mgpu": lambda *a: mg.tree_attention(*a, **ikw)}
    small_ctx = min(contexts)
    key = jax.random.PRNGKey(0)
    held = {}  # the caches of one context at a time

    def caches_at(ctx):
        if held.get("ctx") != ctx:
            held.clear()
            held.update(ctx=ctx, caches=caches_for(jax.random.fold_in(key, ctx), layers, 1, Hkv, hd, ctx + 128, dtype))
        return held["caches"]

    def tree_row(ctx, T):
        row = res["rows"].setdefault(str(ctx), {}).setdefault(str(T), {})
        log(f"== context {ctx}, T = {T} ({layers} layers, cache {ctx + 128})")
        caches = caches_at(ctx)
        mask, smalls = small_inputs(jax.random.fold_in(key, T), np.random.default_rng(T), layers, 1, T, H, Hkv, hd,
                                    dtype)
        start = jnp.int32(ctx)
        flops = layers * 4.0 * T * H * ctx * hd
        outs = {}
        for name, fn in kernels.items():
            row[name], outs[name] = measure(name, fn, start, mask, caches, smalls, flops, args)
        if ctx == small_ctx:
            row["reference"], outs["reference"] = measure("reference", tri.tree_attention_reference, start, mask,
                                                          caches, smalls, flops, args)
            (kc, vc), (q, kn, vn) = caches[0], smalls[0]
            one = (q, kc, vc, start, kn, vn, mask)
            ref = jax.jit(tri.tree_attention_reference)(*one)
            up = tuple(x.astype(jnp.float32) if x.dtype == dtype else x for x in one)
            ref32 = jax.jit(tri.tree_attention_reference)(*up)
            res["errors"].setdefault(str(ctx), {})[str(T)] = {
                n: errors(o[0], ref, ref32) for n, o in outs.items() if o is not None and n != "reference"}
            log(f"    errors {res['errors'][str(ctx)][str(T)]}")

    def variant_row(vname, ctx):
        kw = dict(MGPU_VARIANTS[vname], **ikw)
        T = kw.pop("_T", 65)
        T = nodes[0] if args.smoke else T
        rec = res["mgpu_variants"].setdefault(vname, {"kwargs": MGPU_VARIANTS[vname], "T": T})
        log(f"== mgpu variant {vname} {kw}, context {ctx}, T = {T}")
        caches = caches_at(ctx)
        mask, smalls = small_inputs(jax.random.fold_in(key, T), np.random.default_rng(T), layers, 1, T, H, Hkv, hd,
                                    dtype)
        rec[str(ctx)], _ = measure(vname, lambda *a, kw=kw: mg.tree_attention(*a, **kw), jnp.int32(ctx), mask,
                                   caches, smalls, layers * 4.0 * T * H * ctx * hd, args)

    # causal prefill: the Triton prefill kernel vs the Mosaic GPU kernel's causal mode (compute bound: a few
    # layers, each with its own cache; ms are per layer)
    pref = [tuple(int(x) for x in r.split(":")) for r in args.prefill.split(",") if r]
    lp = max(1, args.prefill_layers)
    pk = {"triton": lambda *a: ptri.prefill_attention(*a, **ikw), "mgpu": lambda *a: pmg.prefill_attention(*a, **ikw)}
    pargs = argparse.Namespace(**dict(vars(args), reps=min(args.reps, 3), prof=min(args.prof, 2)))

    def prefill_row(T, st):
        row = res["prefill"].setdefault(f"T{T}_start{st}", {})
        cap = max(s_ + t_ for t_, s_ in pref) + 128
        log(f"== prefill T = {T} at start {st} ({lp} layers, cache {cap})")
        if held.get("ctx") != ("prefill", cap):
            held.clear()
            held.update(ctx=("prefill", cap), caches=caches_for(jax.random.fold_in(key, 7), lp, 1, Hkv, hd, cap, dtype))
        _, smalls = small_inputs(jax.random.fold_in(key, 100 + T), np.random.default_rng(T), lp, 1, T, H, Hkv, hd,
                                 dtype)
        flops = lp * ptri.prefill_flops(T, st, H, hd)
        outs = {}
        for name, fn in pk.items():
            rec, out = measure(name, lambda q, kc, vc, s_, kn, vn, m, fn=fn: fn(q, kc, vc, s_, kn, vn),
                               jnp.int32(st), None, held["caches"], smalls, flops, pargs)
            for k in ("gpu_ms", "wall_ms"):
                if rec.get(k) is not None:
                    rec[f"{k}_per_layer"] = round(rec[k] / lp, 4)
            row[name], outs[name] = rec, out
        if outs.get("triton") is not None and outs.get("mgpu") is not None:
            x, y = np.asarray(outs["mgpu"][0], np.float32), np.asarray(outs["triton"][0], np.float32)
            row["mgpu_vs_triton"] = {"max_abs": float(np.max(np.abs(x - y))),
                                     "rel": float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))}

    def batched_row(V):
        """Errors only: jax.vmap of the Mosaic GPU kernel over V slots (its slot axis folded into the batch axis,
        one start per slot: 0, mid-block, block-aligned, full cache), T = 32, one layer, vs each slot's reference."""
        T, S = (nodes[0], 100) if args.smoke else (32, small_ctx + 128)
        starts = [0, S // 3 + 5, (S // 2) // 64 * 64, S][:V] + [S - 1] * max(0, V - 4)
        kc, vc = caches_for(jax.random.fold_in(key, 99), 1, V, Hkv, hd, S, dtype)[0]
        kc, vc = kc[:, None], vc[:, None]  # [V, 1, Hkv, S, hd]
        mask, smalls = small_inputs(jax.random.fold_in(key, 98), np.random.default_rng(98), V, 1, T, H, Hkv, hd,
                                    dtype)
        q, kn, vn = (jnp.stack([sm[i] for sm in smalls]) for i in range(3))
        st = jnp.asarray(starts, jnp.int32)
        out = jax.jit(jax.vmap(lambda *a: mg.tree_attention(*a, **ikw), in_axes=(0, 0, 0, 0, 0, 0, None)))(
            q, kc, vc, st, kn, vn, mask)
        rec = res.setdefault("batched", {"slots": V, "T": T, "cache": S, "starts": starts, "errors": []})
        ref = jax.jit(tri.tree_attention_reference)
        for v in range(V):
            one = (q[v], kc[v], vc[v], st[v], kn[v], vn[v], mask)
            up = tuple(x.astype(jnp.float32) if x.dtype == dtype else x for x in one)
            rec["errors"].append(errors(out[v], ref(*one), ref(*up)))
        worst = max(e["rel_vs_fp32_ref"] for e in rec["errors"])
        rec["ok"] = bool(worst < 0.02 and all(e["finite"] for e in rec["errors"]))
        log(f"== batched: {V} slots, starts {starts}: worst rel error vs fp32 {worst:.3g} ok={rec['ok']}")

    vnames = [v for v in args.mgpu_variants.split(",") if v]
    if args.smoke:  # the interpreter takes seconds a call: one variant checks the loop
        vnames = vnames[-1:]
    # most important first: T = 65 at every context, the variants at the longest context, the other tree sizes,
    # prefill, the variants at the other contexts
    by_ctx = sorted(contexts, reverse=True)
    tasks = ([(f"batched.{args.batched}", batched_row, (args.batched,))] if args.batched else []) + (
             [(f"rows.{c}.65", tree_row, (c, 65)) for c in by_ctx if 65 in nodes]
             + [(f"mgpu_variants.{v}.{by_ctx[0]}", variant_row, (v, by_ctx[0])) for v in vnames]
             + [(f"rows.{c}.{t}", tree_row, (c, t)) for c in by_ctx for t in nodes if t != 65]
             + [(f"prefill.T{t}_start{st}", prefill_row, (t, st)) for t, st in pref]
             + [(f"mgpu_variants.{v}.{c}", variant_row, (v, c)) for c in by_ctx[1:] for v in vnames])
    res["skipped"] = []
    for name, fn, targs in tasks:
        if time.perf_counter() > t_end:
            res["skipped"].append(name)
            continue
        try:
            fn(*targs)
        except Exception as e:  # inputs or the reference failing: record, go on
            res.setdefault("task_errors", {})[name] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"  task {name} FAILED {e}")
        save_json(args.out, res)
    held.clear()
    # summary: ms per LAYERS layers (gpu_ms, else wall_ms) by kernel, context and T
    summ = {}
    for ctx, by_t in res["rows"].items():
        for T, row in by_t.items():
            for name in ("triton", "mgpu", "reference"):
                r = row.get(name) or {}
                ms = r.get("gpu_ms") or r.get("wall_ms")
                if ms is not None:
                    summ.setdefault(name, {}).setdefault(ctx, {})[T] = ms
    res["ms_by_kernel_context_nodes"] = summ
    best = {}
    for ctx in map(str, contexts):
        cands = {n: summ.get(n, {}).get(ctx, {}).get("65") for n in ("triton", "mgpu")}
        cands.update({f"mgpu_{v}": (r.get(ctx) or {}).get("gpu_ms")
                      for v, r in res["mgpu_variants"].items() if r.get("T") == 65})
        cands = {n: v for n, v in cands.items() if v}
        best[ctx] = min(cands, key=cands.get) if cands else None
    res["fastest_at_T65"] = best
    res["goal"] = "T = 65, 131072 keys, 16 layers: <= 5.5 ms (>= 600 TFLOP/s)"
    res["total_s"] = round(time.perf_counter() - (t_end - args.budget_s), 1)
    save_json(args.out, res)
    log(json.dumps({"ms_by_kernel_context_nodes": summ, "fastest_at_T65": best}, indent=1))


if __name__ == "__main__":
    main()
