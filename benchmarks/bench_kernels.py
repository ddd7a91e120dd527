"""Pallas kernels vs their XLA (jnp) references at Qwen3.6-27B shapes, on one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/kernels.json [--sections tree,attn,prefill,decode_fused]
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/long.json --sections attn_long,prefill_attn
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/slots.json --sections tree_slots  # issue 28
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/c.json --sections conv,commit,tree  # issue 26
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/n.json --sections addnorm  # issue 41
    JAX_PLATFORMS=cpu python benchmarks/bench_kernels.py --dry     # tiny shapes, interpret mode: checks the script
    --select REGEX runs only the variants whose 'section:variant' matches (the reference always runs)

Per kernel and tuning variant (the reference first):
  * rel_err = ||out − ref|| / ||ref|| vs the jnp reference on fresh random inputs (q,k l2-normalised,
    g in [-2, 0), beta in (0, 1), random trees with padding rows); attention also vs the reference on
    fp32-upcast inputs;
  * gpu_us_per_layer: GPU time of ONE layer's jitted call, summed over every kernel it launches, read
    from a jax.profiler trace of 20 calls (device events only: no launch gaps, no host time);
  * for the fastest correct variant and the reference: wall_ms_all_layers = median wall time of ONE
    jitted call running the op for every layer (48 GDN / 16 attention layers, each with its own inputs,
    so nothing stays in L2) after warm-up, with block_until_ready (this includes launch gaps).
decode_fused (the whole GDN decode step of a layer, proj row -> gated-norm output, bf16; see
section_decode_fused) times every variant with the recurrent state donated (in place, as in the model):
gpu_us_per_layer / kernels_per_layer from a trace of 50 one-layer calls, wall_ms_all_layers for 48 layers.
attn_long (tree attention, 65 nodes, prefix 4K/32K/128K) and prefill_attn (causal chunks of 1K/2K/4K
at start 0/32K/120K) time one layer per variant and report gpu_us_per_layer, ×16 layers and the achieved
TFLOP/s of useful work (QKᵀ + PV flops of the unpadded rows, causal keys only; the H200's dense bf16 peak
is 989 TFLOP/s); errors vs the bf16 jnp reference where it fits in memory, else vs today's path (the tree
kernel with a dense causal mask).
Each section has a time budget (variants past it are skipped); the JSON is rewritten after each section.
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

from kernels_pallas import (gdn_decode_fused, gdn_prefill, gdn_reference, gdn_tree, prefill_attention,  # noqa: E402
                            tree_attention)
from kernels_pallas._testing import (attention_inputs, gdn_decode_fused_inputs, gdn_inputs, random_tree_mask,  # noqa: E402
                                     rel_err)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_profile, gpu_us, log, save_json, wall_ms  # noqa: E402

# 27B shapes
HK, HV, DK, DV, CONV_K = 16, 48, 128, 128, 4
H, HKV, HD = 24, 4, 256
GDN_LAYERS, ATTN_LAYERS = 48, 16
TREE_N, PREFIX, PREFILL_T = 65, 4096, 8192
DRY = False  # --dry: tiny shapes, interpret mode, CPU (checks this script, not the kernels' speed)
LONG_CONTEXTS, PREFILL_CHUNKS, PREFILL_STARTS = (4096, 32768, 131072), (1024, 2048, 4096), (0, 32768, 122880)
BUDGET = {"commit": 40, "conv": 30, "addnorm": 40, "tree": 75, "tree_slots": 120, "attn": 50, "decode_attn": 15, "prefill": 60, "decode_fused": 60, "attn_long": 100,
          "prefill_attn": 130}  # seconds per section (scaled by --budget-scale)

RESULTS: dict = {}


def IKW():
    return {"interpret": True} if DRY else {}


def errs(pairs):
    return {n: float(f"{rel_err(a, b):.3g}") for n, a, b in pairs}


SELECT = None  # --select REGEX: only variants whose name matches (the reference always runs)


def evaluate(section, variants, make, one, check, deadline, layers_all=None, max_err=1e-4, reps=30, n_prof=20):
    """variants {name: kwargs | None (reference)}; make(kw) -> fn(*one_layer_args); one: layer-0 args;
    check(outputs of fn(*one)) -> errors; layers_all: list of per-layer args for the all-layer wall time."""
    import re
    if SELECT:
        variants = {k: v for k, v in variants.items() if v is None or re.search(SELECT, f"{section}:{k}")}
    recs = {}
    for name, kw in variants.items():
        rec = {"kwargs": None if kw is None else {k: str(v) for k, v in kw.items()}}
        recs[name] = rec
        if time.perf_counter() > deadline and kw is not None:
            rec["skipped"] = "section time budget spent"
            log(f"  [{section}] {name:30s} skipped (budget)")
            continue
        try:
            t0 = time.perf_counter()
            f = jax.jit(make(kw))
            out = jax.block_until_ready(f(*one))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            rec["rel_err"] = check(out)
            rec["gpu_us_per_layer"], rec["kernels"] = gpu_us(f, one, n=n_prof)
            if rec["gpu_us_per_layer"] is None:
                rec["wall_us_per_layer"] = 1e3 * wall_ms(f, one, reps=reps, warmup=3)
            us = rec["gpu_us_per_layer"] or rec["wall_us_per_layer"]
            log(f"  [{section}] {name:30s} {us:9.2f} us/layer  err {rec['rel_err']}  compile {rec['compile_s']} s"
                f"  {rec['kernels'][:3] if rec['kernels'] else ''}")
        except Exception as e:  # keep going: one bad variant must not sink the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"  [{section}] {name:30s} FAILED {rec['error'][:600]}")
            traceback.print_exc(limit=2)
    ok = {k: v for k, v in recs.items() if v.get("kwargs") is not None and "rel_err" in v
          and max(v["rel_err"].values()) <= max_err and (v.get("gpu_us_per_layer") or v.get("wall_us_per_layer"))}
    best = min(ok, key=lambda k: ok[k].get("gpu_us_per_layer") or ok[k]["wall_us_per_layer"]) if ok else None
    if layers_all is not None:
        for name in [n for n in ("xla_reference", best) if n]:
            kw = variants[name]
            try:
                f = jax.jit(lambda layers, fn=make(kw): [fn(*a) for a in layers])
                t0 = time.perf_counter()
                jax.block_until_ready(f(layers_all))
                recs[name]["wall_compile_s"] = round(time.perf_counter() - t0, 2)
                recs[name]["wall_ms_all_layers"] = wall_ms(f, (layers_all,), reps=reps, warmup=3)
                log(f"  [{section}] {name:30s} all {len(layers_all)} layers: {recs[name]['wall_ms_all_layers']:.3f} ms"
                    f" wall  (compile {recs[name]['wall_compile_s']} s)")
            except Exception as e:
                recs[name]["wall_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
                log(f"  [{section}] {name} all-layer wall FAILED {recs[name]['wall_error'][:300]}")
    return recs, best


def summarize(prefix, recs, best, n_layers, key):
    """Summary keys: <prefix>_ms_<n>_layers {key: wall ms of the all-layer call}, plus GPU-time figures."""
    ref = recs.get("xla_reference", {})
    b = recs.get(best, {}) if best else {}
    RESULTS[f"{prefix}_best_variant"] = best
    RESULTS[f"{prefix}_ms_{n_layers}_layers"] = {key: b.get("wall_ms_all_layers")}
    RESULTS[f"{prefix}_xla_ms_{n_layers}_layers"] = {key: ref.get("wall_ms_all_layers")}
    g, gr = b.get("gpu_us_per_layer"), ref.get("gpu_us_per_layer")
    RESULTS[f"{prefix}_gpu_ms_{n_layers}_layers"] = {key: None if g is None else n_layers * g / 1e3}
    RESULTS[f"{prefix}_xla_gpu_ms_{n_layers}_layers"] = {key: None if gr is None else n_layers * gr / 1e3}


# ----------------------------------------------------------------------------- GDN tree verify
def section_tree(deadline):
    N = TREE_N
    log(f"== GDN tree verify: N={N}, Hv={HV}, Hk={HK}, dk={DK}, dv={DV}, x{GDN_LAYERS} layers")
    rng = np.random.default_rng(0)
    layers = []
    for l in range(GDN_LAYERS):
        mask, valid = random_tree_mask(rng, 1, N, n_pad=3)
        q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(l), 1, N, HK, HV, DK, DV, valid=valid)
        layers.append((q, k, v, g, beta, mask, state))
    layers = jax.device_put(layers)
    ref0 = [np.asarray(x) for x in jax.jit(gdn_tree.gdn_masked_block_reference)(*layers[0])]
    # tuning neighbours of the default (head block 128, bv 64, 8 warps, bf16x3m, grams by XLA); rounds 4-5
    # (2026-11-29) are in the gdn_tree docstring and benchmarks/results/kernels{,5}_h200.json
    variants = {
        "xla_reference": None,
        "default": {},
        "md16": dict(max_depth=16),  # the model passes max_depth (the drafter's block size)
        "bv32": dict(block_v=32),
        "bv128": dict(block_v=128),
        "bh64": dict(head_block=64),
        "tf32": dict(precision="tf32"),
    }
    make = lambda kw: (gdn_tree.gdn_masked_block_reference if kw is None
                       else functools.partial(gdn_tree.gdn_masked_block, **kw, **IKW()))
    recs, best = evaluate("tree", variants, make, layers[0], lambda out: errs(zip("oWG", out, ref0)), deadline,
                          layers_all=layers)
    RESULTS["gdn_tree"] = recs
    summarize("gdn_tree_verify", recs, best, GDN_LAYERS, str(N))


def section_tree_slots(deadline):
    """The pool's batched verify (issue 28): the GDN tree kernel under jax.vmap over B slots of N nodes each (the
    bucket's per-slot budget + 1: 4 x 32, 8 x 16, 16 x 8) next to one slot of 64 nodes (generate's round), µs per layer;
    the profile of the 4-slot round had it at 3.5 x the one-slot time for 2 x the rows. Variants: 8 warps, 128-wide
    value tiles. Three merges of the slots' trees into one block-diagonal launch lost (NOTES.md, sessions 10, 12)."""
    shapes = [(1, 64), (4, 32), (8, 16), (16, 8)] if not DRY else [(1, 16), (2, 8)]
    rng = np.random.default_rng(1)
    for B, N in shapes:
        if time.perf_counter() > deadline:
            break
        per = []
        for b in range(B):
            mask, valid = random_tree_mask(rng, 1, N, n_pad=min(3, N - 1))
            q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(100 + b), 1, N, HK, HV, DK, DV, valid=valid)
            per.append((q, k, v, g, beta, mask, state))
        # slots stacked on a new leading axis (vmap)
        stacked = jax.device_put(tuple(jnp.stack([x[i] for x in per]) for i in range(7)))
        ref0 = [np.asarray(x) for x in jax.jit(jax.vmap(gdn_tree.gdn_masked_block_reference))(*stacked)]
        variants = {"xla_reference": None, "default": {}, "w8": dict(num_warps=8),
                    "bv128": dict(block_v=128)}
        make = lambda kw: (jax.vmap(gdn_tree.gdn_masked_block_reference) if kw is None
                           else jax.vmap(functools.partial(gdn_tree.gdn_masked_block, **kw, **IKW())))
        log(f"== GDN tree verify under vmap: {B} slot(s) x N={N}")
        recs, best = evaluate(f"tree_slots_{B}x{N}", variants, make, stacked,
                              lambda out: errs(zip("oWG", out, ref0)), deadline)
        RESULTS[f"gdn_tree_slots_{B}x{N}"] = recs
        RESULTS[f"gdn_tree_slots_{B}x{N}_best_variant"] = best


# ----------------------------------------------------------------------------- tree attention
def section_attn(T, variants, tag, deadline):
    S = PREFIX + 64
    log(f"== attention ({tag}): T=N={T}, H={H}, Hkv={HKV}, hd={HD}, prefix {PREFIX} (cache {S}), x{ATTN_LAYERS}")
    rng = np.random.default_rng(1)
    layers = [attention_inputs(jax.random.PRNGKey(100 + l), rng if T > 1 else None, 1, T, H, HKV, HD, S, PREFIX,
                               dtype=jnp.bfloat16, n_pad=3 if T > 1 else 0) for l in range(ATTN_LAYERS)]
    layers = jax.device_put(layers)
    a0 = layers[0]
    ref0 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*a0).astype(jnp.float32))
    up = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a0)
    ref32 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*up))

    def check(out):
        o = np.asarray(out.astype(jnp.float32))
        return errs([("vs_bf16_ref", o, ref0), ("vs_fp32_ref", o, ref32)])

    make = lambda kw: (tree_attention.tree_attention_reference if kw is None
                       else functools.partial(tree_attention.tree_attention, **kw, **IKW()))
    return evaluate(tag, variants, make, a0, check, deadline, layers_all=layers, max_err=2e-2)


# ----------------------------------------------------------------------------- long-context attention
def _tflops(recs, flops):
    for r in recs.values():
        us = r.get("gpu_us_per_layer") or r.get("wall_us_per_layer")
        if us:
            r["tflops"] = float(f"{flops / us / 1e6:.4g}")


def _upcast(args):
    return tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args)


def section_attn_long(deadline):
    """Tree attention (verify of TREE_N nodes) at prefixes LONG_CONTEXTS: one layer per variant."""
    N = TREE_N
    rng = np.random.default_rng(2)
    # variants: the default (tail tile: 3x128 + 16 rows for 65 nodes, tail launched last), the previous
    # default (4 x 128-row tiles), 64-row tiles (+ tail), bigger key blocks, more/fewer splits
    variants = {
        "default": {},
        "notail": dict(tail=False),
        "tail_rows_first": dict(rows_last=False),
        "bm64_w4": dict(block_m=64, num_warps=4),
        "bk128_s1": dict(block_k=128, num_stages=1),
        "bk32_s3": dict(block_k=32, num_stages=3),
        "target264": dict(target_programs=264),
        "target66": dict(target_programs=66),
    }
    out = {}
    for ctx in LONG_CONTEXTS:
        log(f"== tree attention at long context: N={N}, prefix {ctx}, H={H}, Hkv={HKV}, hd={HD}")
        a0 = jax.device_put(attention_inputs(jax.random.PRNGKey(ctx), rng, 1, N, H, HKV, HD, ctx + 128, ctx,
                                             dtype=jnp.bfloat16, n_pad=3))
        ref0 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*a0).astype(jnp.float32))
        ref32 = np.asarray(jax.jit(tree_attention.tree_attention_reference)(*_upcast(a0)))

        def check(o):
            o = np.asarray(o.astype(jnp.float32))
            return errs([("vs_bf16_ref", o, ref0), ("vs_fp32_ref", o, ref32)])

        make = lambda kw: functools.partial(tree_attention.tree_attention, **kw, **IKW())
        recs, best = evaluate(f"attn_long_{ctx}", variants, make, a0, check, deadline, max_err=2e-2)
        n_real = N - 3  # random trees: 3 padding rows; flops of the real rows over the prefix + their ancestors
        _tflops(recs, 4.0 * HD * H * n_real * ctx)
        for r in recs.values():
            us = r.get("gpu_us_per_layer")
            r[f"gpu_ms_{ATTN_LAYERS}_layers"] = None if us is None else round(ATTN_LAYERS * us / 1e3, 3)
        out[str(ctx)] = {"best": best, "variants": recs,
                         "floor_ms_16_layers_at_989_tflops": 4.0 * HD * H * N * ctx * ATTN_LAYERS / 989e12 * 1e3}
        del a0
    RESULTS["attn_long"] = out
    RESULTS[f"tree_attention_gpu_ms_{ATTN_LAYERS}_layers_by_context"] = {
        c: v["variants"].get(v["best"] or "default", {}).get(f"gpu_ms_{ATTN_LAYERS}_layers") for c, v in out.items()}


def section_prefill_attn(deadline):
    """Causal prefill attention of one chunk (PREFILL_CHUNKS tokens at PREFILL_STARTS) per variant, vs
    today's path (the tree kernel with a dense causal mask); and the attention part of a whole prefill of
    LONG_CONTEXTS[-1] tokens projected from a linear fit of the chunk time in `start`, x16 layers."""
    extra = {"bk32_s3": dict(block_k=32, num_stages=3), "bm64_w4": dict(block_m=64, num_warps=4), "ns1": dict(n_split=1),
             "bk128_s1": dict(block_k=128, num_stages=1), "bk128_w8_s2": dict(block_k=128, num_stages=2)}
    mid = PREFILL_CHUNKS[len(PREFILL_CHUNKS) // 2]
    out = {}

    def masked(q, kc, vc, st, kn, vn):  # today's prefill attention: the tree kernel, dense causal mask
        T = q.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (q.shape[0], T, T))
        return tree_attention.tree_attention(q, kc, vc, st, kn, vn, mask, **IKW())

    for T in PREFILL_CHUNKS:
        for st in PREFILL_STARTS:
            key = f"T{T}_start{st}"
            log(f"== prefill attention: chunk {T} at start {st}, H={H}, Hkv={HKV}, hd={HD}")
            S = st + T + 128
            args = jax.device_put(attention_inputs(jax.random.PRNGKey(T + st), None, 1, T, H, HKV, HD, S, st,
                                                   dtype=jnp.bfloat16)[:6])
            variants = {"default": {}, "tree_kernel_masked": {"path": "masked"}}
            if T == mid and st > 0:
                variants.update(extra)
            if T * S <= 2 ** 27 or DRY:  # the jnp reference's fp32 logits [T, H, S] fit (≤ 13 GB a copy)
                ref = np.asarray(jax.jit(prefill_attention.prefill_attention_reference)(*args).astype(jnp.float32))
                rname = "vs_bf16_ref"
            else:
                ref = np.asarray(jax.jit(masked)(*args).astype(jnp.float32))
                rname = "vs_tree_kernel_masked"

            def check(o):
                return errs([(rname, np.asarray(o.astype(jnp.float32)), ref)])

            make = lambda kw: (masked if "path" in kw
                               else functools.partial(prefill_attention.prefill_attention, **kw, **IKW()))
            recs, best = evaluate(f"prefill_attn_{key}", variants, make, args, check, deadline, max_err=2e-2,
                                  n_prof=5 if T * st > 2 ** 27 else 10)
            _tflops(recs, prefill_attention.prefill_flops(T, st, H, HD))
            out[key] = {"best": best, "variants": recs}
            del args
    RESULTS["prefill_attn"] = out
    # projected attention time of a whole prefill of L tokens in chunks of T (16 layers), from a least-squares
    # line through the measured chunk times vs start
    L = LONG_CONTEXTS[-1]
    proj = {}
    for T in PREFILL_CHUNKS:
        for name in ("default", "tree_kernel_masked"):
            recs = [out[f"T{T}_start{st}"]["variants"].get(name, {}) for st in PREFILL_STARTS]
            pts = [(st, r.get("gpu_us_per_layer") or r.get("wall_us_per_layer")) for st, r in zip(PREFILL_STARTS, recs)]
            pts = [(x, y) for x, y in pts if y]
            if len(pts) < 2:
                continue
            b, a = np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)
            starts = np.arange(0, L, T)
            proj.setdefault(name, {})[str(T)] = float(f"{ATTN_LAYERS * float(np.sum(a + b * starts)) / 1e6:.4g}")
    RESULTS[f"prefill_attention_projected_s_{L}_tokens_{ATTN_LAYERS}_layers_by_chunk"] = proj
    RESULTS[f"prefill_attention_floor_s_{L}_tokens_{ATTN_LAYERS}_layers_at_989_tflops"] = float(
        f"{ATTN_LAYERS * prefill_attention.prefill_flops(L, 0, H, HD) / 989e12:.4g}")


# ----------------------------------------------------------------------------- GDN decode, fused
def section_decode_fused(deadline):
    """One GDN decode step from the fused projection row to the gated-norm output (conv + SiLU, l2norm,
    beta/g, recurrent step, o rounding, gated RMSNorm, conv-state shift), bf16, at 27B shapes:
      xla_reference   the model's ops in jnp (kernels="xla" today), gdn_reference.gdn_decode_fused;
      the rest        kernels_pallas.gdn_decode_fused (one Pallas kernel) with tuning variants.
    Every call donates the recurrent state (in place; fed back from call to call), so no state copy is
    timed. rel_err vs the reference (o in bf16, conv state, fp32 state) and o_bf16_differ_frac, the
    fraction of o's bf16 values that are not bitwise those of the reference."""
    d = dict(num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=CONV_K, eps=1e-6)
    cd = 2 * HK * DK + HV * DV
    log(f"== GDN decode step, fused: Hk={HK}, Hv={HV}, dk={DK}, dv={DV}, conv_dim={cd}, K={CONV_K}, bf16,"
        f" x{GDN_LAYERS} layers")
    layers = [gdn_decode_fused_inputs(jax.random.PRNGKey(400 + l), 1, HK, HV, DK, DV, CONV_K, dtype=jnp.bfloat16)
              for l in range(GDN_LAYERS)]
    xs = jax.device_put([a[:6] for a in layers])
    states0 = jax.device_put([a[6] for a in layers])
    ref_fn = functools.partial(gdn_reference.gdn_decode_fused, **d)
    r0 = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(ref_fn)(*xs[0], states0[0])]
    variants = {
        "xla_reference": ref_fn,
        "default": {},  # whole head per program (block_v = dv), 4 warps
        "w8": dict(num_warps=8),
        "w16": dict(num_warps=16),
        "bv64_w4": dict(block_v=64, num_warps=4),
        "bv64_w8": dict(block_v=64, num_warps=8),
        "bv32_w4": dict(block_v=32, num_warps=4),
    }
    if DRY:  # interpret mode on the CPU: check the script, not the tuning
        variants = {k: variants[k] for k in ("xla_reference", "default")}
        variants["bv16_w4"] = dict(block_v=16, num_warps=4)
    if SELECT:
        import re
        variants = {k: v for k, v in variants.items() if callable(v) or re.search(SELECT, f"decode_fused:{k}")}
    make = lambda v: v if callable(v) else functools.partial(gdn_decode_fused.gdn_decode_fused, **d, **v, **IKW())
    reps, warmup = (1, 0) if DRY else (50, 3)

    def wall_fed(f, x, states):
        """Median wall ms of f(x, states) (states donated, fed back from the previous call's outputs)."""
        ts = []
        for i in range(warmup + reps):
            t = time.perf_counter()
            out = jax.block_until_ready(f(x, states))
            if i >= warmup:
                ts.append(time.perf_counter() - t)
            states = out[2] if isinstance(out, tuple) else [o_[2] for o_ in out]
        return 1e3 * statistics.median(ts)

    recs = {}
    for name, v in variants.items():  # one layer: errors, GPU time and kernels per call
        rec = recs[name] = {"kwargs": None if callable(v) else {k: str(x) for k, x in v.items()}}
        if time.perf_counter() > deadline and not name.startswith("xla"):
            rec["skipped"] = "section time budget spent"
            log(f"  [decode_fused] {name:30s} skipped (budget)")
            continue
        try:
            fn = make(v)
            one = jax.jit(lambda x, s, fn=fn: fn(*x, s), donate_argnums=1)
            t0 = time.perf_counter()
            out = jax.block_until_ready(one(xs[0], jnp.array(states0[0])))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            o, conv, st = (np.asarray(x.astype(jnp.float32)) for x in out)
            rec["rel_err"] = errs([("o", o, r0[0]), ("conv_state", conv, r0[1]), ("state", st, r0[2])])
            rec["o_bf16_differ_frac"] = float(np.mean(o != r0[0]))
            prof = gpu_profile(one, (xs[0], jnp.array(states0[0])), n=50, feed=lambda args, out: (args[0], out[2]))
            if prof is not None:
                rec["gpu_us_per_layer"] = prof["us"]
                rec["kernels_per_layer"] = prof["launches"]
                rec["kernels"] = prof["top"]
            else:
                rec["wall_us_per_layer"] = 1e3 * wall_fed(one, xs[0], jnp.array(states0[0]))
            us = rec.get("gpu_us_per_layer")
            log(f"  [decode_fused] {name:22s} {'n/a' if us is None else f'{us:8.2f}'} us/layer GPU,"
                f" {rec.get('kernels_per_layer')} kernels/layer  err {rec['rel_err']}"
                f"  o differs {rec['o_bf16_differ_frac']:.2e}  compile {rec['compile_s']} s  {rec.get('kernels', '')}")
        except Exception as e:  # keep going: one bad variant must not sink the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"  [decode_fused] {name:30s} FAILED {rec['error'][:600]}")
            traceback.print_exc(limit=2)
    key = lambda r: r.get("gpu_us_per_layer") or r.get("wall_us_per_layer")
    ok = {k: r for k, r in recs.items() if not k.startswith("xla") and "rel_err" in r
          and max(r["rel_err"].values()) <= 1e-3 and key(r)}
    best = min(ok, key=lambda k: key(ok[k])) if ok else None
    for name in [n for n in ("xla_reference", best) if n in recs and "rel_err" in recs[n]]:
        try:  # all layers in one call (each its own inputs), states donated and fed back
            fn = make(variants[name])
            allf = jax.jit(lambda xs, states, fn=fn: [fn(*x, s) for x, s in zip(xs, states)], donate_argnums=1)
            t0 = time.perf_counter()
            outs = jax.block_until_ready(allf(xs, [jnp.array(s) for s in states0]))
            recs[name]["wall_compile_s"] = round(time.perf_counter() - t0, 2)
            recs[name]["wall_ms_all_layers"] = wall_fed(allf, xs, [o_[2] for o_ in outs])
            log(f"  [decode_fused] {name:22s} all {GDN_LAYERS} layers (donated): {recs[name]['wall_ms_all_layers']:.3f}"
                f" ms wall  (compile {recs[name]['wall_compile_s']} s)")
        except Exception as e:
            recs[name]["wall_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
            log(f"  [decode_fused] {name} all-layer wall FAILED {recs[name]['wall_error'][:300]}")
    RESULTS["gdn_decode_fused"] = recs
    RESULTS["gdn_decode_fused_best_variant"] = best
    for tag, name in (("fused", best), ("xla", "xla_reference")):
        r = recs.get(name, {}) if name else {}
        g = r.get("gpu_us_per_layer")
        RESULTS[f"gdn_decode_fused_{tag}_gpu_ms_{GDN_LAYERS}_layers"] = None if g is None else GDN_LAYERS * g / 1e3
        RESULTS[f"gdn_decode_fused_{tag}_kernels_{GDN_LAYERS}_layers"] = (
            None if r.get("kernels_per_layer") is None else GDN_LAYERS * r["kernels_per_layer"])
        RESULTS[f"gdn_decode_fused_{tag}_wall_ms_{GDN_LAYERS}_layers"] = r.get("wall_ms_all_layers")


# ----------------------------------------------------------------------------- GDN prefill
def section_prefill(deadline):
    T = PREFILL_T
    log(f"== GDN chunked prefill: T={T}, one layer (x{GDN_LAYERS} projected)")
    args = jax.device_put(gdn_inputs(jax.random.PRNGKey(300), 1, T, HK, HV, DK, DV))
    ref = [np.asarray(x) for x in jax.jit(gdn_prefill.gdn_chunked_reference)(*args)]
    variants = {
        "xla_reference": None,
        "bv64_w4_tf32x3": dict(block_v=64),
        "bv32_w4_tf32x3": dict(block_v=32),
        "bv64_w4_s3_tf32x3": dict(block_v=64, num_stages=3),
    }
    make = lambda kw: (gdn_prefill.gdn_chunked_reference if kw is None
                       else functools.partial(gdn_prefill.gdn_chunked, **kw, **IKW()))
    recs, best = evaluate("prefill", variants, make, args,
                          lambda out: errs([("o", out[0], ref[0]), ("state", out[1], ref[1])]), deadline,
                          reps=5, n_prof=3)
    RESULTS["gdn_prefill"] = recs
    b, r = recs.get(best, {}), recs["xla_reference"]
    RESULTS["gdn_prefill_best_variant"] = best
    g, gr = b.get("gpu_us_per_layer"), r.get("gpu_us_per_layer")
    RESULTS["gdn_prefill_gpu_ms_8k_1_layer"] = None if g is None else g / 1e3
    RESULTS["gdn_prefill_xla_gpu_ms_8k_1_layer"] = None if gr is None else gr / 1e3
    RESULTS["gdn_prefill_gpu_ms_8k_48_layers_projected"] = None if g is None else 48 * g / 1e3
    RESULTS["gdn_prefill_xla_gpu_ms_8k_48_layers_projected"] = None if gr is None else 48 * gr / 1e3


def section_commit(deadline):
    """The commit of an accepted path (12 of 16 rows) into one GDN layer from the verify's stash of 65 nodes (the
    round's accept + commit part, 48 layers): the model's path (`gdn_reference.gdn_commit`). A fused
    multiply-sum over the path rows instead of its batched fp32 dot lost (11.6 vs 11.0 µs per layer, H200
    2026-12-02)."""
    N, P, conv_dim = TREE_N, 16, 2 * HK * DK + HV * DV
    log(f"== GDN commit: stash of {N} nodes, path of 12 in {P} rows, x{GDN_LAYERS} layers")
    layers = []
    for l in range(GDN_LAYERS):
        ks = jax.random.split(jax.random.PRNGKey(500 + l), 6)
        k = jax.random.normal(ks[0], (1, N, HK, DK), jnp.float32)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        W = 0.1 * jax.random.normal(ks[1], (1, N, HV, DV), jnp.float32)
        g = -jax.random.uniform(ks[2], (1, N, HV), jnp.float32, 0.01, 2.0)
        x = jax.random.normal(ks[3], (1, N, conv_dim), jnp.bfloat16)
        state = jax.random.normal(ks[4], (1, HV, DK, DV), jnp.float32)
        conv = jax.random.normal(ks[5], (1, CONV_K - 1, conv_dim), jnp.bfloat16)
        path = jnp.asarray(np.sort(np.random.default_rng(l).choice(N, P, replace=False)))[None].astype(jnp.int32)
        layers.append((state, conv, k, W, g, x, path, jnp.array([12], jnp.int32)))
    layers = jax.device_put(layers)
    ref0 = [np.asarray(a, np.float32) for a in jax.jit(gdn_reference.gdn_commit)(*layers[0])]
    variants = {"xla_reference": None}
    make = lambda kw: gdn_reference.gdn_commit
    recs, best = evaluate("commit", variants, make, layers[0],
                          lambda out: errs(zip(("state", "conv"), [np.asarray(a, np.float32) for a in out], ref0)),
                          deadline, layers_all=layers)
    RESULTS["gdn_commit"] = recs
    summarize("gdn_commit", recs, best, GDN_LAYERS, "16")


def section_conv(deadline):
    """The GDN layer's causal conv + SiLU (bf16, 27B conv width) over a 2048-row prefill chunk and a 65-node tree
    (random parents): the model's path (`gdn_reference.tree_conv`: taps summed one by one; a chunk's taps as
    static slices). One layer per call; x48 for a pass. The former einsum over gathered taps (a dot laid out
    [C, B, T] and transposed back) took 388 vs 151 µs per layer on the chunk, 15.0 vs 7.2 on the tree (H200
    2026-12-02)."""
    from jaxddtree.model import layout as layout_lib
    conv_dim = 2 * HK * DK + HV * DV
    rng = np.random.default_rng(7)
    for name, T, tree in (("prefill", 2048 if not DRY else 64, False), ("tree", TREE_N, True)):
        if time.perf_counter() > deadline:
            break
        ks = jax.random.split(jax.random.PRNGKey(600 + T), 3)
        x = jax.random.normal(ks[0], (1, T, conv_dim), jnp.bfloat16)
        cs = jax.random.normal(ks[1], (1, CONV_K - 1, conv_dim), jnp.bfloat16)
        w = (0.3 * jax.random.normal(ks[2], (CONV_K, conv_dim), jnp.float32)).astype(jnp.bfloat16)
        if tree:
            parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, T)], np.int32)
            src = layout_lib.tree(0, jnp.asarray(parents), CONV_K).conv_src
        else:
            src = layout_lib.sequence(0, T, CONV_K).conv_src
        one = jax.device_put((cs, x, src, w))
        model = (lambda cs, x, src, w: gdn_reference.tree_conv(cs, x, src, w)) if tree else (
            lambda cs, x, src, w: gdn_reference.tree_conv(cs, x, None, w))
        ref0 = np.asarray(jax.jit(model)(*one), np.float32)
        log(f"== GDN conv + SiLU: {name}, {T} rows x {conv_dim} channels (x{GDN_LAYERS} layers)")
        recs, best = evaluate(f"conv_{name}", {"xla_reference": None}, lambda kw: model, one,
                              lambda out: errs([("xc", np.asarray(out, np.float32), ref0)]), deadline)
        RESULTS[f"gdn_conv_{name}"] = recs


def section_addnorm(deadline):
    """A tree verify's residual add + the next input norm (`rms_norm.add_rms_norm_rows`, 65 rows x 5120, the weight
    read from a 64-layer stack): the split-K partials of an out projection (S = 3, K = 6144) and of a down
    projection (S = 2, K = 17408) summed, the residual added, the new residual and the normed rows written; 112
    calls per round (7 per group of 4 layers). Variants: the kernel's num_warps (one program per row: 72 programs)."""
    from kernels_pallas import rms_norm
    M, D, L = (13, 64, 4) if DRY else (TREE_N, 5120, 64)
    for S in (3, 2):
        if time.perf_counter() > deadline:
            break
        ks = jax.random.split(jax.random.PRNGKey(700 + S), 3)
        parts = 2.0 * jax.random.normal(ks[0], (S, M, D), jnp.float32)
        base = (3.0 * jax.random.normal(ks[1], (M, D), jnp.float32)).astype(jnp.bfloat16)
        w = (0.1 * jax.random.normal(ks[2], (L, D), jnp.float32)).astype(jnp.bfloat16)
        one = jax.device_put((parts, base, w, jnp.int32(L // 2)))
        ref = functools.partial(rms_norm.add_rms_norm_rows_reference, eps=1e-6)
        ref0 = [np.asarray(a, np.float32) for a in jax.jit(lambda p, b, w_, l: ref(p, b, w_, layer=l))(*one)]
        variants = {"xla_reference": None, "default": {}, "w2": dict(num_warps=2), "w8": dict(num_warps=8),
                    "w16": dict(num_warps=16)}

        def make(kw):
            if kw is None:
                return lambda p, b, w_, l: ref(p, b, w_, layer=l)
            f = functools.partial(rms_norm.add_rms_norm_rows, eps=1e-6, **kw, **IKW())
            return lambda p, b, w_, l: f(p, b, w_, layer=l)
        log(f"== add + RMSNorm: {S} partials of {M} x {D} (x112 a round)")
        recs, best = evaluate(f"addnorm_s{S}", variants, make, one,
                              lambda out: errs(zip(("x", "normed"), [np.asarray(a, np.float32) for a in out], ref0)),
                              deadline, max_err=1e-2)
        RESULTS[f"add_rms_norm_s{S}"] = recs
        RESULTS[f"add_rms_norm_s{S}_best_variant"] = best


# the sections that take only their deadline ("attn" runs two parts of its own in main)
SECTIONS = {"tree": section_tree, "tree_slots": section_tree_slots, "prefill": section_prefill,
            "commit": section_commit, "conv": section_conv, "addnorm": section_addnorm,
            "decode_fused": section_decode_fused, "attn_long": section_attn_long, "prefill_attn": section_prefill_attn}


def main():
    global DRY, HK, HV, DK, DV, CONV_K, H, HKV, HD, GDN_LAYERS, ATTN_LAYERS, TREE_N, PREFIX, PREFILL_T, SELECT
    global LONG_CONTEXTS, PREFILL_CHUNKS, PREFILL_STARTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--sections", default="tree,attn,prefill,decode_fused")
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--budget-scale", type=float, default=1.0)
    ap.add_argument("--select", default=None, help="regex on 'section:variant' (the reference always runs)")
    ap.add_argument("--no-decode-attn", action="store_true")
    args = ap.parse_args()
    SELECT = args.select
    if args.dry:
        DRY = gpu_timing.QUICK = True
        HK, HV, DK, DV, H, HKV, HD = 1, 3, 16, 32, 4, 2, 16  # CONV_K stays 4
        GDN_LAYERS, ATTN_LAYERS, TREE_N, PREFIX, PREFILL_T = 2, 2, 19, 64, 128
        LONG_CONTEXTS, PREFILL_CHUNKS, PREFILL_STARTS = (40, 72), (16, 24), (0, 40)
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dry=DRY,
                   method=__doc__.split("Per kernel and tuning variant (the reference first):")[1].split("Each section")[0]
                   .strip())
    log(json.dumps({k: v for k, v in RESULTS.items() if k != "method"}))
    t_all = time.perf_counter()
    for sec in args.sections.split(","):
        deadline = time.perf_counter() + BUDGET.get(sec, 60) * args.budget_scale
        try:
            if sec in SECTIONS:
                SECTIONS[sec](deadline)
            elif sec == "attn":
                # tuning neighbours of the default (128x64 tiles, 8 warps, 2 stages, splits for ~132
                # programs, jnp merge); rounds 4-5 are in the tree_attention docstring
                attn_variants = {
                    "xla_reference": None,
                    "default": {},
                    "s1": dict(num_stages=1),
                    "ns6": dict(n_split=6),
                    "ns12": dict(n_split=12),
                    "bk32_s3": dict(block_k=32, num_stages=3),
                    "bm64_bk32_w4_s3_ns9": dict(block_m=64, block_k=32, num_warps=4, num_stages=3, n_split=9),
                }
                recs, best = section_attn(TREE_N, attn_variants, "tree_attn", deadline)
                RESULTS["tree_attention"] = recs
                summarize("tree_attention", recs, best, ATTN_LAYERS, str(TREE_N))
                save_json(args.out, RESULTS)
                if args.no_decode_attn:
                    continue
                recs1, best1 = section_attn(1, {"xla_reference": None, "default": {}, "s1": dict(num_stages=1)},
                                            "decode_attn", time.perf_counter() + BUDGET["decode_attn"] * args.budget_scale)
                RESULTS["decode_attention"] = recs1
                summarize("decode_attention", recs1, best1, ATTN_LAYERS, "1")
            else:
                raise ValueError(f"unknown section '{sec}'")
        except Exception as e:
            RESULTS[f"{sec}_section_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"section {sec} FAILED: {e}")
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save_json(args.out, RESULTS)
    log("\n== summary")
    for k, v in RESULTS.items():
        if isinstance(v, (dict, str, float, int, type(None))) and ("_ms_" in k or k.endswith("variant")):
            log(f"  {k}: {v}")


if __name__ == "__main__":
    main()
