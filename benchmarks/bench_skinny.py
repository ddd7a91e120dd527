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
A config that fails (compile, SMEM, runtime) is recorded with its error and the sweep goes on; with --isolate
(the default on a GPU) the runs execute in a child process, and a config that kills it (illegal address, abort)
or hangs (> VARIANT_TIMEOUT_S) is recorded as such while a new child carries on with what is left. The JSON is
rewritten as the sweep goes; the summary table (best Mosaic, best Triton, XLA, speedups) ends the log.
`--ms 65 --shapes gdn_in_proj,mlp_down` narrows the sweep; `--select default,p_bn128_bk64_st9_k1` picks variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
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
CHILD = False
RESULTS: dict = {"runs": {}}
L2_BYTES_MIN = 256 << 20
VARIANT_TIMEOUT_S = 120.0  # a variant still running after this (compile included) is taken as hung
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
    if c.epilogue != "t":
        s += f"_{c.epilogue}"
    return s


def variants_for(M: int, K: int, N: int, big: bool = False) -> dict:
    """{name: SkinnyConfig | None (XLA)}: the XLA reference, the default, then alternatives ranked by the kernel's
    own cost model, interleaved: warp-specialized (wgs 1-2, clusters 2/4 multicasting x), Triton (dense.py),
    the default with the y^T epilogue, plain pipelines (other block_n / CTAs per SM / split), block_k 128, no
    split. `big` (lm_head): fewer."""
    d = sg.default_config(M, K, N)
    rank = lambda cs: [c for c in sorted(cs, key=lambda c: sg.estimate_cost(M, K, N, c)) if c != d]  # noqa: E731
    plain = rank(sg.candidates(M, K, N))
    ws = rank(sg.candidates(M, K, N, warp_specialized=True))
    tri = [sg.SkinnyConfig(backend="triton"),
           sg.SkinnyConfig(backend="triton", triton=(("block_n", 128), ("block_k", 64), ("num_warps", 4),
                                                      ("num_stages", 4)))]
    bk128 = [d.replace(block_k=128, stages=max(2, d.stages // 2))] if d.block_k == 64 else []
    nosplit = [c.replace(split_k=1) for c in [d] + plain[:1] if c.split_k > 1]
    yT = [d.replace(epilogue="yT")]  # the fallback epilogue: y^T from the kernel, XLA transposes
    if DRY:  # interpret mode: a few
        picks = ws[-1:] + tri[:1]
    elif big:  # lm_head: 2.5 GB per copy, fewer
        picks = ws[:1] + tri[:1] + yT + plain[:1] + ws[1:2]
    else:  # interleaved so that a budget cut still leaves one of each kind
        picks = (ws[:1] + tri[:1] + yT + plain[:1] + ws[1:2] + bk128 + plain[1:2] + ws[2:3] + nosplit[:1]
                 + ws[3:4] + plain[2:3] + tri[1:] + nosplit[1:])
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


def bench_one(name, K, N, M, deadline, global_deadline, select, skip=(), out=""):
    """Times every variant of (name, M) into RESULTS["runs"]["name@M<M>"]["variants"]; RESULTS["in_flight"] names
    the variant running (saved first: a parent sees which one killed or hung the process)."""
    R = copies_for(K, N)
    W = K * N * 2
    floor_us = max(W / (HBM_TBPS * 1e6), 2 * M * K * N / (TC_TFLOPS * 1e6))
    run_key = f"{name}@M{M}"
    variants = variants_for(M, K, N, big=W > (1 << 30))
    rec_run = {"K": K, "N": N, "M": M, "copies": R, "weight_MB": W / 1e6, "floor_us": floor_us, "variants": {}}
    RESULTS["runs"][run_key] = rec_run
    if set(variants) <= set(skip):  # an earlier process did them all
        rec_run["done"] = True
        return rec_run
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
    for vname, cfg in variants.items():
        if vname in skip:  # done (or crashed) in an earlier process
            continue
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
        RESULTS["in_flight"] = [run_key, vname]
        save(out)
        watchdog = threading.Timer(VARIANT_TIMEOUT_S, _hung, (run_key, vname))
        watchdog.daemon = True
        watchdog.start()
        try:
            if os.environ.get("BENCH_SKINNY_CRASH") == vname:  # tests: a variant that kills the process
                os._exit(7)
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
        finally:
            watchdog.cancel()
            RESULTS.pop("in_flight", None)
    rec_run["done"] = True
    if not CHILD:  # a child's parent merges the runs of its children first
        finalize_run(rec_run)
    del xs, ws
    return rec_run


def _hung(run_key, vname):
    log(f"  {vname:40s} still running after {VARIANT_TIMEOUT_S} s: exiting (the parent records it as hung)")
    os._exit(3)


def finalize_run(rec_run):
    """best Mosaic / Triton variant (correct ones only) and the speedups vs XLA."""
    ok = {k: v for k, v in rec_run["variants"].items() if "us" in v and not v.get("wrong")}
    xla = ok.get("xla_reference")
    rec_run["xla_us"] = xla and xla["us"]
    for kind in ("mosaic", "triton"):
        cand = {k: v for k, v in ok.items() if v["config"] and v["config"]["backend"] == kind}
        for f in ("", "_us", "_config", "_vs_xla"):
            rec_run.pop(f"best_{kind}{f}", None)
        if cand:
            best = min(cand, key=lambda k: cand[k]["us"])
            rec_run[f"best_{kind}"] = best
            rec_run[f"best_{kind}_us"] = cand[best]["us"]
            rec_run[f"best_{kind}_config"] = cand[best]["config"]
            if xla:
                rec_run[f"best_{kind}_vs_xla"] = xla["us"] / cand[best]["us"]
    nan = float("nan")
    log(f"  -> mosaic {rec_run.get('best_mosaic')} {rec_run.get('best_mosaic_us') or nan:.2f} us, "
        f"triton {rec_run.get('best_triton_us') or nan:.2f} us, XLA {rec_run.get('xla_us') or nan:.2f} us")


def summary():
    log("\n== summary: us (TB/s of weight bytes); x = XLA time / kernel time")
    log(f"  {'shape@M':24s} {'floor':>7s} {'XLA':>15s} {'best mosaic':>15s} {'x':>5s} {'best triton':>15s} {'x':>5s}  best mosaic")
    for k, r in RESULTS["runs"].items():
        if "weight_MB" not in r:
            log(f"  {k:24s} {r.get('skipped') or r.get('error', '')[:100]}")
            continue
        W = r["weight_MB"] * 1e6

        def fmt(us):
            return f"{us:7.1f} ({W / (us * 1e6):4.2f})" if us else f"{'-':>15s}"
        log(f"  {k:24s} {r['floor_us']:7.1f} {fmt(r.get('xla_us'))} {fmt(r.get('best_mosaic_us'))} "
            f"{r.get('best_mosaic_vs_xla') or 0:5.2f} {fmt(r.get('best_triton_us'))} {r.get('best_triton_vs_xla') or 0:5.2f}"
            f"  {r.get('best_mosaic')}")
    bad = [(k, v) for k, r in RESULTS["runs"].items() for v, rec in r.get("variants", {}).items()
           if rec.get("error") or rec.get("wrong")]
    if bad:
        log(f"  {len(bad)} variants failed or WRONG: " + ", ".join(f"{k}/{v}" for k, v in bad[:40]))
    log(f"  total {RESULTS.get('total_s')} s")


def run_inprocess(plan, shapes, global_deadline, select, skip, out):
    for i, (name, M) in enumerate(plan):
        now = time.perf_counter()
        deadline = now + (global_deadline - now) / (len(plan) - i)
        K, N = shapes[name]
        run_key = f"{name}@M{M}"
        try:
            if now > global_deadline:
                RESULTS["runs"][run_key] = {"skipped": "time budget"}
            else:
                bench_one(name, K, N, M, deadline, global_deadline, select, skip.get(run_key, ()), out)
        except Exception as e:
            RESULTS["runs"][run_key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "done": True}
            log(f"{run_key} FAILED: {e}")
            traceback.print_exc()
        save(out)


def run_isolated(plan, args, t_all, global_deadline):
    """Each batch of runs in a child process (one GPU context): a config that crashes the process (illegal
    address, abort) or hangs (watchdog) costs only itself — the parent records it and starts a new child on
    what is left, skipping the variants already done."""
    pending = [f"{n}@M{m}" for n, m in plan]
    skip: dict = {}
    deaths = 0
    tmp = tempfile.mkdtemp(prefix="bench_skinny_")
    while pending and time.perf_counter() < global_deadline and deaths < 12:
        child_out, skip_file = os.path.join(tmp, "child.json"), os.path.join(tmp, "skip.json")
        if os.path.exists(child_out):
            os.remove(child_out)
        with open(skip_file, "w") as fh:
            json.dump({k: sorted(v) for k, v in skip.items()}, fh)
        left = global_deadline - time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(pending), "--out", child_out,
               "--skip-file", skip_file, "--time-budget-s", str(round(left, 1))]
        if args.dry:
            cmd.append("--dry")
        if args.select:
            cmd += ["--select", args.select]
        try:
            rc = subprocess.run(cmd, timeout=left + 2 * VARIANT_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        child = {}
        if os.path.exists(child_out):
            with open(child_out) as fh:
                child = json.load(fh)
        for k in ("device", "platform", "jax"):
            if k in child:
                RESULTS[k] = child[k]
        for key, run in child.get("runs", {}).items():
            prev = RESULTS["runs"].get(key, {})
            merged = dict(run, variants={**prev.get("variants", {}), **run.get("variants", {})})
            RESULTS["runs"][key] = merged
            if run.get("done"):
                finalize_run(merged)
        done = {k for k, r in child.get("runs", {}).items() if r.get("done")}
        pending = [k for k in pending if k not in done]
        if rc != 0:
            deaths += 1
            inflight = child.get("in_flight")
            if inflight:
                key, v = inflight
                run = RESULTS["runs"].setdefault(key, {"variants": {}})
                run.setdefault("variants", {})[v] = {
                    "config": run.get("variants", {}).get(v, {}).get("config"),
                    "error": f"the process died or hung in this variant (exit {rc}); the sweep went on without it"}
                skip.setdefault(key, set()).update(run["variants"])
                log(f"!! {key}/{v}: process exit {rc}; restarting on {len(pending)} runs left")
            elif pending:  # died outside a variant (e.g. allocating the weights): drop that run
                key = pending.pop(0)
                RESULTS["runs"][key] = {"error": f"the process died (exit {rc}) outside a variant", "done": True}
                log(f"!! {key}: process exit {rc} outside a variant; dropped")
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save(args.out)
    for key in pending:
        RESULTS["runs"].setdefault(key, {"skipped": "time budget"})


def main():
    global DRY, CHILD
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--time-budget-s", type=float, default=540.0)
    ap.add_argument("--ms", default=None, help="comma list of M (default 65,129,17,257)")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--select", default=None, help="comma list of variant names to run (reference always)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="run in child processes that may crash or hang (default: on, off with --dry)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # name@M<m>,... (run by --isolate)
    ap.add_argument("--skip-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = SHAPES_27B
    if args.dry:
        DRY = gpu_timing.QUICK = True
        shapes = SHAPES_DRY
    ms = MS if not args.ms else tuple(int(m) for m in args.ms.split(","))
    names = list(shapes) if not args.shapes else args.shapes.split(",")
    select = None if not args.select else set(args.select.split(",")) | {"xla_reference"}
    plan = [(name, m) for m in ms for name in names]
    if args.dry and not (args.ms or args.shapes):
        plan = PLAN_DRY
    if args.child:
        CHILD = True
        plan = [(k.split("@M")[0], int(k.split("@M")[1])) for k in args.child.split(",")]
    t_all = time.perf_counter()
    global_deadline = t_all + args.time_budget_s
    RESULTS.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), dry=DRY,
                   method=__doc__.split("then the sweep of `variants_for`")[1].strip())
    isolate = (not args.dry) if args.isolate is None else args.isolate
    if isolate and not args.child:  # the parent: no GPU context of its own
        log(json.dumps({"plan": [f"{n}@M{m}" for n, m in plan], "isolate": True}))
        run_isolated(plan, args, t_all, global_deadline)
    else:
        dev = jax.devices()[0]
        RESULTS.update(device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__)
        log(json.dumps({k: v for k, v in RESULTS.items() if k not in ("method", "runs")}))
        skip = {}
        if args.skip_file:
            with open(args.skip_file) as fh:
                skip = {k: set(v) for k, v in json.load(fh).items()}
        run_inprocess(plan, shapes, global_deadline, select, skip, args.out)
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        if args.child:
            save(args.out)
            return
    summary()
    save(args.out)


if __name__ == "__main__":
    main()
