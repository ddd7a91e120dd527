"""Pallas dense GEMV/skinny GEMM (kernels_pallas.dense) vs XLA's dot at Qwen3.6-27B weight shapes, on one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv.py --out $OUT/gemv.json [--time-budget-s 200]
    JAX_PLATFORMS=cpu python benchmarks/bench_gemv.py --dry     # tiny shapes, interpret mode: checks the script
    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv.py --scan-mgpu --out $OUT/dense_mgpu.json [--mgpu-sweep]
        [--rows 16 65 129] [--table-out $OUT/dense_mgpu_configs.json]    # issue 40: stacked weights + layer
    JAX_PLATFORMS=cpu python benchmarks/bench_gemv.py --scan-mgpu --smoke   # (--smoke = --dry)

--scan-mgpu runs only `bench_scan_mgpu` (its docstring): the Mosaic GPU wgmma GEMM `dense_mgpu` vs XLA's dot on
one layer of a stacked weight [16, K, N] inside a `lax.fori_loop` over the layers.

Per weight shape [K, N] and M (1 = decode; 65 = verify) — the XLA reference first, then a few Pallas variants:
  * gpu_us: GPU time of ONE y = x @ w, summed over every kernel it launches (split-K adds one small XLA
    reduce), read from a jax.profiler trace. Each timed jit runs R calls on R DISTINCT weight copies (and
    distinct x), R = clamp(256 MB / (K·N·2), 2, 16) ≥ 3x the 50 MB L2, so nothing is served from L2; gpu_us = total / R.
  * GBps: K·N·2 bytes of w / gpu_us (the floor is the weight stream: ~4.2 TB/s copy bandwidth on an H200);
  * rel_err vs the bf16 XLA reference and vs an fp32 product of the same bf16 inputs.
Then a chain: the decode GEMVs of one GDN + MLP layer in the fused parameter layout (w_in = qkv|z|b|a, w_out,
w_gate_up, w_down, with cheap elementwise glue and data dependencies) for --chain-sets distinct weight sets in
one jit, for XLA, the Pallas default and the per-shape best Pallas variant: GPU ms (profile) and wall ms per call.
(benchmarks/results/gemv_h200.json, 2026-11-29, predates the fused layout: its shapes are the unfused
projections w_qkv 10240, w_z 6144, w_ba 96, wq 12288, wk|wv 1024, w_gate|w_up 17408, and its chain has 7 GEMVs.)
The JSON is rewritten after each shape; --time-budget-s bounds the whole sweep (variants past a shape's share
are skipped; the reference and the default always run while the global budget lasts).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
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

from kernels_pallas import dense as dn  # noqa: E402
from kernels_pallas import dense_mgpu as dm  # noqa: E402
from kernels_pallas._testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_us, log, save_json, wall_ms  # noqa: E402

DRY = False
RESULTS: dict = {"shapes": {}}
L2_BYTES_MIN = 256 << 20  # distinct weight bytes per timed call ≥ 5x L2


def IKW():
    return {"interpret": True} if DRY else {}


# ---------------------------------------------------------------- shapes and variants
# name -> (K, N); the model's weights [in, out] flattened to 2-D (the fused layout: every projection of a
# 27B layer, see NOTES.md "Design")
SHAPES_27B = {
    "w_in": (5120, 16480),  # GDN qkv 10240 | z 6144 | b 48 | a 48
    "w_out|wo": (6144, 5120),
    "w_gate_up": (5120, 34816),  # MLP [D, 2, F]: gate | up
    "w_down": (17408, 5120),
    "attn_w_qkv": (5120, 14336),  # attention q(+gate) 12288 | k 1024 | v 1024
    "lm_head": (5120, 248320),
    "w_in_pad64": (5120, 16512),  # w_in padded to whole 64-column tiles (dense_mgpu refuses 16480)
}
# (shape name, M, budget share): decode first, then the chain, then verify
PLAN_27B = [("w_in", 1, 12), ("w_gate_up", 1, 12), ("w_down", 1, 12), ("w_out|wo", 1, 10),
            ("attn_w_qkv", 1, 10), ("lm_head", 1, 14), ("chain", 1, 30),
            ("w_in", 65, 14), ("w_gate_up", 65, 14), ("w_down", 65, 14)]
SHAPES_DRY = {"w_in": (256, 424), "w_out|wo": (128, 256), "w_gate_up": (256, 1024), "w_down": (512, 256),
              "attn_w_qkv": (256, 448), "lm_head": (256, 1000), "w_in_pad64": (256, 448)}
PLAN_DRY = [("w_in", 1, 10), ("lm_head", 1, 10), ("attn_w_qkv", 1, 10), ("chain", 1, 10), ("w_down", 65, 10)]
SHAPES = dict(SHAPES_27B)


def variants_for(M, K, N):
    """≤ 6 Pallas variants: {name: kwargs} ({} = the default heuristic: split-K to 4 programs/SM; tp2x is
    the earlier 2/SM). The CUDA-core FMA kernel (0.5-0.6x of these at M = 1, gemv_h200.json) is gone."""
    big = K * N >= 256 << 20  # lm_head: fewer
    d = dn.default_config(M, K, N)
    if M == 1:
        v = {  # most likely winners first (the budget may cut the tail)
            "default": {},
            "dot_bn256_bk64_w4_s4": dict(block_n=256, block_k=64, num_warps=4, num_stages=4),
            "dot_bn128_bk128_w4_s4": dict(block_n=128, block_k=128, num_warps=4, num_stages=4),
            "dot_default_tp2x": dict(target_programs=2 * dn.N_SM),
            "dot_bn64_bk256_w4_s3": dict(block_n=64, block_k=256, num_warps=4, num_stages=3),
            "dot_nosplit_bn64_bk128_w4_s4": dict(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
        }
        if big:
            v = {k: v[k] for k in ("default", "dot_bn256_bk64_w4_s4", "dot_bn128_bk128_w4_s4")}
        if d["split_k"] == 1 and not big:  # split-K variants would equal the default
            v.pop("dot_default_tp2x")
    else:
        v = {
            "default": {},
            "dot_bn64_bk64_w4_s3": dict(block_n=64, block_k=64, num_warps=4, num_stages=3),
            "dot_bn128_bk128_w8_s3": dict(block_n=128, block_k=128, num_warps=8, num_stages=3),
            "dot_bn128_bk64_w4_s4": dict(block_n=128, block_k=64, num_warps=4, num_stages=4),
            "dot_bn256_bk64_w8_s3": dict(block_n=256, block_k=64, num_warps=8, num_stages=3),
            "dot_default_tp2x": dict(target_programs=2 * dn.N_SM),
        }
    return v


def copies_for(K, N):
    if DRY:
        return 2
    return int(min(16, max(2, math.ceil(L2_BYTES_MIN / (K * N * 2)))))


def make_fn(kw):
    if kw is None:
        return dn.dense_reference
    return functools.partial(dn.dense, **kw, **IKW())


def bench_shape(name, M, deadline, global_deadline, sweep_all):
    K, N = SHAPES[name]
    R = copies_for(K, N)
    log(f"== {name} M={M} K={K} N={N}: {K * N * 2 / 1e6:.1f} MB of weights, {R} distinct copies per timed call")
    key = jax.random.PRNGKey(K * 7 + N + M)
    kx, kw_ = jax.random.split(key)
    xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, R)]
    ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
          if DRY else jax.random.normal(k, (K, N), jnp.bfloat16) * jnp.bfloat16(K ** -0.5)
          for k in jax.random.split(kw_, R)]
    jax.block_until_ready((xs, ws))
    ref = np.asarray(jax.jit(dn.dense_reference)(xs[0], ws[0]), np.float32)
    ref32 = np.asarray(jnp.dot(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST))
    rec_shape = {"K": K, "N": N, "M": M, "copies": R, "weight_MB": K * N * 2 / 1e6,
                 "default_config": dn.default_config(M, K, N), "variants": {}}
    RESULTS["shapes"][f"{name}@M{M}"] = rec_shape
    variants = {"xla_reference": None, **variants_for(M, K, N)}
    for vname, kw in variants.items():
        rec = {"kwargs": kw}
        rec_shape["variants"][vname] = rec
        now = time.perf_counter()
        if now > global_deadline or (now > deadline and vname not in ("xla_reference", "default")):
            rec["skipped"] = "time budget"
            log(f"  {vname:32s} skipped (budget)")
            continue
        if sweep_all is not None and vname not in sweep_all:
            rec["skipped"] = "--select"
            continue
        try:
            fn = make_fn(kw)
            f = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
            t0 = time.perf_counter()
            outs = jax.block_until_ready(f(xs, ws))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            rec["rel_err"] = rel_err(outs[0], ref)
            rec["rel_err_fp32"] = rel_err(outs[0], ref32)
            g, top = gpu_us(f, (xs, ws), n=1 if DRY else 10, top=4, width=60)
            if g is None:
                rec["wall_us"] = 1e3 * wall_ms(f, (xs, ws)) / R
            else:
                rec["gpu_us"] = g / R
                rec["kernels"] = top
            us = rec.get("gpu_us") or rec["wall_us"]
            rec["GBps"] = K * N * 2 / (us * 1e3)
            log(f"  {vname:32s} {us:9.2f} us  {rec['GBps']:7.0f} GB/s  err {rec['rel_err']:.2g} "
                f"(fp32 {rec['rel_err_fp32']:.2g})  compile {rec['compile_s']} s")
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"  {vname:32s} FAILED {rec['error'][:500]}")
            traceback.print_exc(limit=2)
    ok = {k: v for k, v in rec_shape["variants"].items() if v["kwargs"] is not None and "GBps" in v
          and v["rel_err"] < 2e-2}
    best = max(ok, key=lambda k: ok[k]["GBps"]) if ok else None
    rec_shape["best"] = best
    if best:
        ref_rec = rec_shape["variants"]["xla_reference"]
        rec_shape["best_kwargs"] = ok[best]["kwargs"]
        rec_shape["best_GBps"] = ok[best]["GBps"]
        rec_shape["xla_GBps"] = ref_rec.get("GBps")
        if ref_rec.get("GBps"):
            rec_shape["speedup_vs_xla"] = ok[best]["GBps"] / ref_rec["GBps"]
        log(f"  -> best {best} {ok[best]['GBps']:.0f} GB/s vs XLA {ref_rec.get('GBps') or float('nan'):.0f} GB/s")
    del xs, ws
    return best


# ---------------------------------------------------------------- chain: one GDN + MLP layer's decode GEMVs
CHAIN = ["w_in", "w_out|wo", "w_gate_up", "w_down"]


def layer_chain(h, ws, fns):
    """h [1, D]; ws: 4 weights in CHAIN order; fns: 4 callables (x, w) -> y."""
    f32 = jnp.float32
    proj = fns[0](h, ws[0]).astype(f32)  # qkv | z | b | a
    F = ws[1].shape[0]
    o = (proj[:, :F] * jax.nn.sigmoid(proj[:, F:2 * F]) * (1 + jnp.mean(proj[:, 2 * F:]))).astype(h.dtype)
    h = h + fns[1](o, ws[1])
    gu = fns[2](h, ws[2]).astype(f32)  # gate | up
    i = ws[3].shape[0]
    a = (jax.nn.silu(gu[:, :i]) * gu[:, i:]).astype(h.dtype)
    return h + fns[3](a, ws[3])


def bench_chain(n_sets, best_by_shape):
    D = SHAPES["w_in"][0]
    log(f"== chain: {len(CHAIN)} decode GEMVs of one GDN+MLP layer x {n_sets} distinct weight sets")
    sets = []
    for s in range(n_sets):
        ks = jax.random.split(jax.random.PRNGKey(1000 + s), len(CHAIN))
        ws = []
        for k, nm in zip(ks, CHAIN):
            K, N = SHAPES[nm]
            ws.append((jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16) if DRY
                      else jax.random.normal(k, (K, N), jnp.bfloat16) * jnp.bfloat16(K ** -0.5))
        sets.append(ws)
    x = jax.random.normal(jax.random.PRNGKey(7), (1, D), jnp.bfloat16)
    jax.block_until_ready((x, sets))
    mb = sum(math.prod(w.shape) * 2 for w in sets[0]) / 1e6
    rec = {"n_sets": n_sets, "weight_MB_per_set": mb, "gemvs": CHAIN, "variants": {}}
    RESULTS["chain"] = rec
    configs = {
        "xla_reference": [None] * len(CHAIN),
        "pallas_default": [{}] * len(CHAIN),
        "pallas_best_per_shape": [best_by_shape.get(nm) or {} for nm in CHAIN],
    }
    ref_out = None
    for cname, kws in configs.items():
        r = {"kwargs": kws}
        rec["variants"][cname] = r
        try:
            fns = [make_fn(kw) for kw in kws]
            f = jax.jit(lambda x, sets: functools.reduce(lambda h, ws: layer_chain(h, ws, fns), sets, x))
            t0 = time.perf_counter()
            out = np.asarray(jax.block_until_ready(f(x, sets)), np.float32)
            r["compile_s"] = round(time.perf_counter() - t0, 2)
            if ref_out is None:
                ref_out = out
            r["rel_err"] = rel_err(out, ref_out)
            g, top = gpu_us(f, (x, sets), n=1 if DRY else 10, top=4, width=60)
            r["gpu_ms"] = None if g is None else g / 1e3
            r["kernels"] = top
            r["wall_ms"] = wall_ms(f, (x, sets))
            t = r["gpu_ms"] or r["wall_ms"]
            r["GBps"] = mb * n_sets / 1e3 / t
            r["gpu_ms_per_layer"] = t / n_sets
            log(f"  {cname:24s} gpu {r['gpu_ms']} ms  wall {r['wall_ms']:.3f} ms  ({r['gpu_ms_per_layer']:.3f} ms/layer, "
                f"{r['GBps']:.0f} GB/s)  err {r['rel_err']:.2g}  compile {r['compile_s']} s")
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"  {cname} FAILED {r['error'][:500]}")
            traceback.print_exc(limit=2)
    del sets


# ---------------------------------------------------------------- issue 40: stacked weights + layer in a device loop
SCAN_LAYERS = 16  # one stacked matrix of a 16-group layer scan
SCAN_SHAPES = ["w_in", "w_in_pad64", "w_out|wo", "w_gate_up", "w_down", "attn_w_qkv"]


def mgpu_sweep_configs(M, K, N):
    """A few `dense_mgpu.Config`s around the default (block_n 64 / 128, split-K ½ / 1 / 2x, stages 3 / 4) that fit."""
    d = dm.default_config(M, K, N)
    out = {}
    for bn in (64, 128):
        for sp in sorted({max(1, d.split_k // 2), d.split_k, 2 * d.split_k}):
            for st in (3, 4):
                c = dm.Config(block_n=bn, block_k=d.block_k, split_k=sp, num_stages=st)
                if c != d and dm._fits(c, M, K, N) and N % bn == 0:
                    out[f"mgpu_bn{bn}_s{sp}_st{st}"] = c
    return out


def bench_scan_mgpu(rows, sweep: bool, deadline: float):
    """Per 27B bf16 matrix [K, N] (SCAN_SHAPES) and M in `rows`: a stack w [L, K, N] (L = 16 distinct layers,
    16 · K · N · 2 bytes ≫ the 50 MB L2) and x [M, K]; each variant runs y_l = x @ w[l] for l = 0..L-1 in one jitted
    `lax.fori_loop` (a checksum Σ y_l, fp32, keeps every y: one small XLA reduce per layer, the same in every
    variant); gpu_us = GPU time of the loop / L (summed over its kernels, profiled); TBps = K·N·2 / gpu_us.
    Variants: xla_scan (dense_reference(x, w, layer=l): XLA's dot of the dynamic slice w[l], which XLA copies:
    issue 40), xla_unrolled (L separate weight arrays, a Python loop: XLA's dot reading each in place, the target),
    pallas_triton (`dense.dense(..., layer=l)`, the Triton GEMV, ≤ 256 rows), mgpu (`dense_mgpu(..., layer=l)`,
    the default config) and with --mgpu-sweep a few configs around it (`mgpu_sweep_configs`). `check`: one layer
    of mgpu vs the reference (fraction of differing bf16 outputs, relative error)."""
    RESULTS.setdefault("scan_mgpu", {})
    L = 2 if DRY else SCAN_LAYERS
    f32 = jnp.float32
    for name in SCAN_SHAPES:
        K, N = SHAPES[name]
        key = jax.random.PRNGKey(K * 3 + N)
        w = (jax.random.normal(key, (L, K, N), f32) * K ** -0.5).astype(jnp.bfloat16) if DRY else \
            jax.random.normal(key, (L, K, N), jnp.bfloat16) * jnp.bfloat16(K ** -0.5)
        jax.block_until_ready(w)
        for M in rows:
            why = dm.supports(M, K, N)
            rec = {"K": K, "N": N, "M": M, "layers": L, "weight_MB": K * N * 2 / 1e6, "variants": {},
                   "default_config": dm.default_config(M, K, N), "plan": dm.plan(M, K, N) if not why else why}
            RESULTS["scan_mgpu"][f"{name}@M{M}"] = rec
            log(f"== scan {name} M={M} K={K} N={N}: {L} x {K * N * 2 / 1e6:.1f} MB, mgpu plan {rec['plan']}")
            x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.bfloat16)
            mk = lambda **kw: (lambda x, w, i: dm.dense_mgpu(x, w, layer=i, **kw, **IKW()))
            variants = {
                "xla_scan": lambda x, w, i: dn.dense_reference(x, w, layer=i),
                "xla_unrolled": None,
                "pallas_triton": (lambda x, w, i: dn.dense(x, w, layer=i, **IKW())) if M <= 256 else False,
                "mgpu": mk() if not why else False,
            }
            if sweep and not why:
                variants.update({k: mk(config=c) for k, c in mgpu_sweep_configs(M, K, N).items()})
            try:
                y0 = np.asarray(dm.dense_mgpu(x, w, layer=jnp.int32(L - 1), **IKW()), f32)
                r0 = np.asarray(dn.dense_reference(x, w, layer=L - 1), f32)
                rec["check"] = {"differ": float(np.mean(y0 != r0)), "rel_err": rel_err(y0, r0)}
                log(f"  check: {rec['check']}")
            except Exception as e:
                rec["check"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                log(f"  check FAILED {rec['check']['error'][:500]}")
            for vname, fn in variants.items():
                v = rec["variants"][vname] = {}
                if fn is False:
                    v["skipped"] = "not supported"
                    continue
                if time.perf_counter() > deadline and vname not in ("xla_scan", "xla_unrolled", "mgpu"):
                    v["skipped"] = "time budget"
                    continue
                if vname.startswith("mgpu_"):
                    v["config"] = str(mgpu_sweep_configs(M, K, N)[vname])
                try:
                    if fn is None:  # unrolled: L separate arrays
                        args = (x, [w[i] + 0 for i in range(L)])

                        def run(x, ws):
                            return sum(jnp.sum(dn.dense_reference(x, wl), dtype=f32) for wl in ws)
                    else:
                        args = (x, w)

                        def run(x, w, fn=fn):
                            body = lambda i, s: s + jnp.sum(fn(x, w, i), dtype=f32)
                            return jax.lax.fori_loop(0, L, body, jnp.zeros((), f32))
                    f = jax.jit(run)
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    v["compile_s"] = round(time.perf_counter() - t0, 2)
                    g, top = gpu_us(f, args, n=1 if DRY else 10, top=4, width=60)
                    if g is None:
                        v["wall_us"] = 1e3 * wall_ms(f, args) / L
                    else:
                        v["gpu_us"] = g / L
                        v["kernels"] = top
                    us = v.get("gpu_us") or v["wall_us"]
                    v["TBps"] = K * N * 2 / (us * 1e6)
                    log(f"  {vname:24s} {us:9.2f} us/layer  {v['TBps']:6.2f} TB/s  compile {v['compile_s']} s")
                except Exception as e:
                    v["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                    log(f"  {vname:24s} FAILED {v['error'][:500]}")
                    traceback.print_exc(limit=2)
                    args = None
                del args
            ok = {k: v for k, v in rec["variants"].items() if k.startswith("mgpu") and "TBps" in v}
            if ok:
                best = max(ok, key=lambda k: ok[k]["TBps"])
                rec["best_mgpu"] = best
                rec["best_config"] = (dataclasses_asdict(rec["default_config"]) if best == "mgpu"
                                      else dataclasses_asdict(mgpu_sweep_configs(M, K, N)[best]))
                rec["best_TBps"] = ok[best]["TBps"]
            save_json(ARGS_OUT[0], RESULTS)
        del w
    log("\n== scan summary (TB/s of the weight stream per layer)")
    for k, r in RESULTS["scan_mgpu"].items():
        tb = {n: round(v["TBps"], 2) for n, v in r["variants"].items() if "TBps" in v and not n.startswith("mgpu_")}
        log(f"  {k:20s} {tb}  best mgpu {r.get('best_mgpu')} {r.get('best_TBps') or 0:.2f}")


def dataclasses_asdict(c):
    import dataclasses
    return dataclasses.asdict(c)


def mgpu_table(smoke: bool) -> dict:
    """{"configs": {dense_mgpu table key: config}}: the best Config per (row tile, K, N) of the scan section."""
    out = {}
    for r in sorted(RESULTS.get("scan_mgpu", {}).values(), key=lambda r: -r["M"]):
        if r.get("best_config"):
            out[dm.table_key(r["M"], r["K"], r["N"])] = r["best_config"]
    return {"source": "benchmarks/bench_gemv.py --scan-mgpu --mgpu-sweep", "device": RESULTS.get("device"),
            "date": RESULTS.get("date"), "smoke": smoke, "configs": out}


ARGS_OUT = [""]


def main():
    global DRY, SHAPES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--dry", "--smoke", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--scan-mgpu", action="store_true", help="only the issue-40 section (bench_scan_mgpu)")
    ap.add_argument("--mgpu-sweep", action="store_true", help="with --scan-mgpu: a few dense_mgpu configs too")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="--scan-mgpu's M values (16 65 129)")
    ap.add_argument("--table-out", default="", help="--scan-mgpu --mgpu-sweep's winners "
                    "(kernels_pallas/dense_mgpu_configs.json: dense_mgpu.default_config reads it)")
    ap.add_argument("--time-budget-s", type=float, default=200.0)
    ap.add_argument("--chain-sets", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma list of 'name@M<m>' (e.g. w_in@M1,chain@M1)")
    ap.add_argument("--select", default=None, help="comma list of variant names to run (reference always)")
    args = ap.parse_args()
    plan = PLAN_27B
    if args.dry:
        DRY = gpu_timing.QUICK = True
        SHAPES = SHAPES_DRY
        plan = PLAN_DRY
        args.chain_sets = 2
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if f"{p[0]}@M{p[1]}" in keep]
    sel = None if not args.select else set(args.select.split(",")) | {"xla_reference"}
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dry=DRY,
                   method=__doc__.split("XLA reference first, then a few Pallas variants:")[1].strip())
    log(json.dumps({k: v for k, v in RESULTS.items() if k not in ("method", "shapes")}))
    ARGS_OUT[0] = args.out
    if args.scan_mgpu:
        rows = tuple(args.rows or ((5, 16) if DRY else (16, 65, 129)))
        bench_scan_mgpu(rows, args.mgpu_sweep, time.perf_counter() + args.time_budget_s)
        save_json(args.out, RESULTS)
        if args.table_out:
            with open(args.table_out, "w") as fh:
                json.dump(mgpu_table(DRY), fh, indent=1)
        return
    t_all = time.perf_counter()
    global_deadline = t_all + args.time_budget_s
    total_share = sum(p[2] for p in plan)
    best_by_shape = {}
    for i, (name, M, share) in enumerate(plan):
        now = time.perf_counter()
        left = global_deadline - now
        rest = sum(p[2] for p in plan[i:])
        deadline = now + left * share / rest
        try:
            if name == "chain":
                if now > global_deadline:
                    RESULTS["chain"] = {"skipped": "time budget"}
                else:
                    bench_chain(args.chain_sets, best_by_shape)
            else:
                best = bench_shape(name, M, deadline, global_deadline, sel)
                if M == 1 and best:
                    best_by_shape[name] = RESULTS["shapes"][f"{name}@M{M}"]["best_kwargs"]
        except Exception as e:
            RESULTS[f"{name}@{M}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            log(f"{name}@{M} FAILED: {e}")
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save_json(args.out, RESULTS)
    del total_share
    log("\n== summary (GB/s of weight stream; best Pallas vs XLA)")
    for k, r in RESULTS["shapes"].items():
        log(f"  {k:20s} best {r.get('best')}: {r.get('best_GBps') or 0:.0f} GB/s  XLA {r.get('xla_GBps') or 0:.0f} GB/s"
            f"  x{r.get('speedup_vs_xla') or 0:.2f}")
    ch = RESULTS.get("chain", {}).get("variants", {})
    for k, r in ch.items():
        log(f"  chain {k:24s} {r.get('gpu_ms_per_layer')} ms/layer  {r.get('GBps')} GB/s")
    log(f"  total {RESULTS.get('total_s')} s")
    save_json(args.out, RESULTS)


if __name__ == "__main__":
    main()
