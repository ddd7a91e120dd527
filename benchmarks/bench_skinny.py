"""Skinny GEMM (kernels_pallas.skinny_gemm: Mosaic GPU, plain and warp-specialized; the Pallas-Triton
kernels_pallas.dense as the fallback) vs XLA's dot for M = 17…257 rows at the Qwen3.6-27B weight shapes, on one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/bench_skinny.py --out $OUT/skinny.json [--time-budget-s 540]
    JAX_PLATFORMS=cpu python benchmarks/bench_skinny.py --dry     # tiny shapes, interpret mode: checks the script

Per (weight shape [K, N], M) — the XLA reference first (jnp.dot, bf16, preferred fp32, cast to bf16), then
`default_config`, then the sweep of `variants_for` (most promising first; the budget may cut the tail):
  * gpu_us: GPU time of ONE y = x @ w, summed over every kernel it launches (the x pad, split-K's reduce and the
    row slice included), from a jax.profiler trace. Each timed jit runs R calls on R DISTINCT weight copies
    (and x), R = clamp(256 MB / (K·N·2), 2, 16) ≥ 5x the 50 MB L2, so nothing is served from L2; gpu_us = total / R.
  * TBps: K·N·2 bytes of w / gpu_us (the M = 1 GEMV reaches ~4.5 TB/s on the H200); floor_us = max(weight
    bytes at 4.5 TB/s, 2·M·K·N flops at 790 TFLOP/s): M ≈ 257 is near the tensor-core bound.
  * rel_err vs the bf16 XLA reference and vs an fp32 product of the same bf16 inputs; > 2e-2 is flagged WRONG.
A config that fails (compile, SMEM, runtime) is recorded with its error and the sweep goes on. The JSON is
rewritten after each (shape, M); the summary table (best Mosaic, best Triton, XLA, speedups) ends the log.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from kernels_pallas import skinny_gemm as sg  # noqa: E402
from kernels_pallas._testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_us, wall_ms  # noqa: E402

DRY = False
RESULTS: dict = {"runs": {}}
L2_BYTES_MIN = 256 << 20
HBM_TBPS = 4.5  # the best M = 1 GEMV rate measured on the H200 (lm_head shape, 2026-11-29)
TC_TFLOPS = 790.0

# name -> (K, N): the model's weights [in, out] as stored
SHAPES_27B = {
    "gdn_in_proj": (5120, 16480),  # fused qkv | z | b | a
    "mlp_gate_up": (5120, 34816),  # fused gate | up ([5120, 2, 17408])
    "mlp_down": (17408, 5120),
    "gdn_out|attn_o": (6144, 5120),
    "attn_qkv": (5120, 14336),  # fused q(+gate) | k | v
    "lm_head": (5120, 248320),
}
SHAPES_DRY = {"gdn_in_proj": (256, 208), "mlp_down": (512, 128)}
MS = (65, 129, 17, 257)  # verify of 65 nodes first: the case the issue is about
PLAN_DRY = [("gdn_in_proj", 65), ("mlp_down", 17)]


def log(*a):
    print(*a, flush=True)


def save(path):
    if path:
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)


def cfg_dict(cfg):
    return None if cfg is None else dataclasses.asdict(cfg)


def _name(c: sg.SkinnyConfig) -> str:
    if c.backend == "triton":
        return "triton_" + "_".join(f"{k}{v}" for k, v in c.triton) if c.triton else "triton_default"
    s = "ws" if c.warp_specialized else "p"
    s += f"_bn{c.block_n}_bk{c.block_k}_st{c.stages}_k{c.split_k}"
    if c.warp_specialized:
        s += f"_wg{c.wgs}_cl{c.cluster}"
    return s


def variants_for(M: int, K: int, N: int, big: bool = False) -> dict:
    """{name: SkinnyConfig | None (XLA)}: the XLA reference, the default, then alternatives ranked by the kernel's
    own cost model, interleaved: warp-specialized (wgs 1-2, clusters 2/4 multicasting x), Triton (dense.py),
    plain pipelines (other block_n / CTAs per SM / split), block_k 128, no split. `big` (lm_head): fewer."""
    d = sg.default_config(M, K, N)
    rank = lambda cs: [c for c in sorted(cs, key=lambda c: sg.estimate_cost(M, K, N, c)) if c != d]  # noqa: E731
    plain = rank(sg.candidates(M, K, N))
    ws = rank(sg.candidates(M, K, N, warp_specialized=True))
    tri = [sg.SkinnyConfig(backend="triton"),
           sg.SkinnyConfig(backend="triton", triton=(("block_n", 128), ("block_k", 64), ("num_warps", 4),
                                                      ("num_stages", 4)))]
    bk128 = [d.replace(block_k=128, stages=max(2, d.stages // 2))] if d.block_k == 64 else []
    nosplit = [c.replace(split_k=1) for c in [d] + plain[:1] if c.split_k > 1]
    if DRY:  # interpret mode: a few
        picks = ws[-1:] + tri[:1]
    elif big:  # lm_head: 2.5 GB per copy, fewer
        picks = ws[:1] + tri[:1] + plain[:1] + ws[1:2]
    else:  # interleaved so that a budget cut still leaves one of each kind
        picks = (ws[:1] + tri[:1] + plain[:1] + ws[1:2] + bk128 + plain[1:2] + ws[2:3] + nosplit[:1] + ws[3:4]
                 + plain[2:3] + tri[1:] + nosplit[1:])
    v = {"xla_reference": None, "default": d}
    for c in picks:
        if c.backend == "mosaic" and sg.smem_bytes(M, c, 4 if c.split_k > 1 else 2) > sg.SMEM_BYTES:
            continue
        v.setdefault(_name(c), c)
    return v


def copies_for(K, N):
    if DRY:
        return 2
    return int(min(16, max(2, math.ceil(L2_BYTES_MIN / (K * N * 2)))))


def make_fn(cfg):
    if cfg is None:
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return functools.partial(sg.skinny_gemm, config=cfg, interpret=DRY)


def bench_one(name, K, N, M, deadline, global_deadline, select):
    R = copies_for(K, N)
    W = K * N * 2
    floor_us = max(W / (HBM_TBPS * 1e6), 2 * M * K * N / (TC_TFLOPS * 1e6))
    log(f"== {name} M={M} K={K} N={N}: {W / 1e6:.1f} MB of weights, {R} copies per timed call, "
        f"floor {floor_us:.1f} us")
    key = jax.random.PRNGKey(K * 7 + N + M)
    kx, kw_ = jax.random.split(key)
    xs = [(jax.random.normal(k, (M, K), jnp.float32) + 0.1).astype(jnp.bfloat16) for k in jax.random.split(kx, R)]
    ws = [(jax.random.normal(k, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
          if DRY else jax.random.normal(k, (K, N), jnp.bfloat16) * jnp.bfloat16(K ** -0.5)
          for k in jax.random.split(kw_, R)]
    jax.block_until_ready((xs, ws))
    ref = np.asarray(jax.jit(make_fn(None))(xs[0], ws[0]), np.float32)
    ref32 = np.asarray(jnp.dot(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST))
    rec_run = {"K": K, "N": N, "M": M, "copies": R, "weight_MB": W / 1e6, "floor_us": floor_us, "variants": {}}
    RESULTS["runs"][f"{name}@M{M}"] = rec_run
    variants = variants_for(M, K, N, big=W > (1 << 30))
    for vname, cfg in variants.items():
        rec = {"config": cfg_dict(cfg)}
        rec_run["variants"][vname] = rec
        now = time.perf_counter()
        if now > global_deadline or (now > deadline and vname not in ("xla_reference", "default")):
            rec["skipped"] = "time budget"
            log(f"  {vname:40s} skipped (budget)")
            continue
        if select is not None and vname not in select:
            rec["skipped"] = "--select"
            continue
        try:
            fn = make_fn(cfg)
            f = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
            t0 = time.perf_counter()
            outs = jax.block_until_ready(f(xs, ws))
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            rec["rel_err"] = rel_err(outs[0], ref)
            rec["rel_err_fp32"] = rel_err(outs[0], ref32)
            rec["wrong"] = bool(not np.isfinite(rec["rel_err"]) or rec["rel_err"] > 2e-2)
            g, top = (None, None) if DRY else gpu_us(f, (xs, ws), n=10, top=4, width=60)
            if g is None:
                rec["wall_us"] = 1e3 * wall_ms(f, (xs, ws)) / R
            else:
                rec["gpu_us"] = g / R
                rec["kernels"] = top
            us = rec.get("gpu_us") or rec["wall_us"]
            rec["us"] = us
            rec["TBps"] = W / (us * 1e6)
            rec["of_floor"] = floor_us / us
            log(f"  {vname:40s} {us:9.2f} us  {rec['TBps']:5.2f} TB/s  {100 * rec['of_floor']:5.1f}% of floor  "
                f"err {rec['rel_err']:.2g} (fp32 {rec['rel_err_fp32']:.2g})  compile {rec['compile_s']} s"
                + ("  WRONG" if rec["wrong"] else ""))
        except Exception as e:  # keep going: one failing config must not cost the rest of the sweep
            rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"  {vname:40s} FAILED {rec['error'][:400]}")
            traceback.print_exc(limit=2)
            try:
                from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
                gpu_callbacks.reset_gpu_interpret_mode_state()
            except Exception:
                pass
    ok = {k: v for k, v in rec_run["variants"].items() if "us" in v and not v["wrong"]}
    xla = ok.get("xla_reference")
    rec_run["xla_us"] = xla and xla["us"]
    for kind, pred in (("mosaic", lambda v: v["config"] and v["config"]["backend"] == "mosaic"),
                       ("triton", lambda v: v["config"] and v["config"]["backend"] == "triton")):
        cand = {k: v for k, v in ok.items() if pred(v)}
        if cand:
            best = min(cand, key=lambda k: cand[k]["us"])
            rec_run[f"best_{kind}"] = best
            rec_run[f"best_{kind}_us"] = cand[best]["us"]
            rec_run[f"best_{kind}_config"] = cand[best]["config"]
            if xla:
                rec_run[f"best_{kind}_vs_xla"] = xla["us"] / cand[best]["us"]
    log(f"  -> mosaic {rec_run.get('best_mosaic')} {rec_run.get('best_mosaic_us') or float('nan'):.2f} us, "
        f"triton {rec_run.get('best_triton_us') or float('nan'):.2f} us, XLA {rec_run.get('xla_us') or float('nan'):.2f} us")
    del xs, ws
    return rec_run


def summary():
    log("\n== summary: us (TB/s of weight bytes); x = XLA time / kernel time")
    log(f"  {'shape@M':24s} {'floor':>7s} {'XLA':>15s} {'best mosaic':>15s} {'x':>5s} {'best triton':>15s} {'x':>5s}  best mosaic config")
    for k, r in RESULTS["runs"].items():
        W = r["weight_MB"] * 1e6

        def fmt(us):
            return f"{us:7.1f} ({W / (us * 1e6):4.2f})" if us else f"{'-':>15s}"
        log(f"  {k:24s} {r['floor_us']:7.1f} {fmt(r.get('xla_us'))} {fmt(r.get('best_mosaic_us'))} "
            f"{r.get('best_mosaic_vs_xla') or 0:5.2f} {fmt(r.get('best_triton_us'))} {r.get('best_triton_vs_xla') or 0:5.2f}"
            f"  {r.get('best_mosaic')}")
    log(f"  total {RESULTS.get('total_s')} s")


def main():
    global DRY
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--time-budget-s", type=float, default=540.0)
    ap.add_argument("--ms", default=None, help="comma list of M (default 65,129,17,257)")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--select", default=None, help="comma list of variant names to run (reference always)")
    args = ap.parse_args()
    shapes, ms = SHAPES_27B, MS
    if args.dry:
        DRY = gpu_timing.QUICK = True
        shapes = SHAPES_DRY
    if args.ms:
        ms = tuple(int(m) for m in args.ms.split(","))
    names = list(shapes) if not args.shapes else args.shapes.split(",")
    select = None if not args.select else set(args.select.split(",")) | {"xla_reference"}
    plan = [(name, m) for m in ms for name in names]
    if args.dry and not (args.ms or args.shapes):
        plan = PLAN_DRY
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dry=DRY,
                   method=__doc__.split("then the sweep of `variants_for`")[1].strip())
    log(json.dumps({k: v for k, v in RESULTS.items() if k not in ("method", "runs")}))
    t_all = time.perf_counter()
    global_deadline = t_all + args.time_budget_s
    for i, (name, M) in enumerate(plan):
        now = time.perf_counter()
        deadline = now + (global_deadline - now) / (len(plan) - i)
        K, N = shapes[name]
        try:
            if now > global_deadline:
                RESULTS["runs"][f"{name}@M{M}"] = {"skipped": "time budget"}
            else:
                bench_one(name, K, N, M, deadline, global_deadline, select)
        except Exception as e:
            RESULTS["runs"][f"{name}@M{M}"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            log(f"{name}@M{M} FAILED: {e}")
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save(args.out)
    summary()
    save(args.out)


if __name__ == "__main__":
    main()
