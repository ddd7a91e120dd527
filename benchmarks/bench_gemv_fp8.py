"""Weight-only fp8 GEMV / skinny GEMM (kernels_pallas.dense_fp8) at the Qwen3.6-27B fp8 projection shapes, on one
GPU: the sweep that picks its block sizes.

    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv_fp8.py --out $OUT/gemv_fp8.json [--time-budget-s 100]
    JAX_PLATFORMS=cpu python benchmarks/bench_gemv_fp8.py --dry     # tiny shapes, interpret mode: checks the script

Per shape [K, N] (fp8 columns, 128-row scale blocks) and M (1 = decode, 65 = verify at budget 64):
  * "xla_dequant": what the model runs without the kernel (Fp8Weight.dequantize to bf16, then XLA's dot);
  * Pallas variants ({} = `default_config`), most likely winners first (the budget may cut the tail);
  * gpu_us: GPU time of one call (all its kernels, split-K reduce included) from a profile, over R distinct
    weight copies per timed jit (R = clamp(256 MB / (K·N), 2, 16): nothing served from L2), gpu_us = total / R;
    GBps: (K·N fp8 + the fp32 scale rows) bytes / gpu_us; rel_err vs the fp32 product of the dequantized weight.
The JSON is rewritten after each shape; `best` per shape = the fastest variant with rel_err < 1e-2.
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

from kernels_pallas import dense_fp8 as df  # noqa: E402
from kernels_pallas._testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_us, wall_ms  # noqa: E402

# fp8 projections of a 27B layer [K, N] (GDN w_in without its bf16 b|a tail)
SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}
SHAPES_DRY = {"w_in": (256, 384), "w_down": (512, 256)}
BLOCK_IN = 128
RESULTS: dict = {"shapes": {}}
VARIANTS = ""  # --variants


def variants_for(M: int) -> dict:
    """Block shapes and the f16 probe. Session 5 (H200, 2026-11-30) also tried the swapped form (wᵀ @ xᵀ: the
    converted tile as the MMA's register operand) and CUDA-core FMAs at M = 1: both lost on every shape
    (gemv_fp8_h200.json) and were removed. ncu (w_in, M = 1): DRAM 38 %, SM 61 %, 96 registers — instruction-bound
    on the fp8 -> bf16 conversion; "f16" probes the one-instruction e4m3 -> f16 conversion (x in f16)."""
    if M == 1:
        return {"default": {},
                "f16_default": dict(mode="f16"),
                "bn256_bk128_w4_s4": dict(block_n=256, block_k=128, num_warps=4, num_stages=4),
                "bn128_bk128_w4_s4": dict(block_n=128, block_k=128, num_warps=4, num_stages=4),
                "bn64_bk128_w4_s4": dict(block_n=64, block_k=128, num_warps=4, num_stages=4),
                "bn256_bk128_w8_s3": dict(block_n=256, block_k=128, num_warps=8, num_stages=3),
                "default_tp2x": dict(target_programs=2 * df.N_SM)}
    return {"default": {},
            "f16_default": dict(mode="f16"),
            "bn128_bk64_w8_s3": dict(block_n=128, block_k=64, num_warps=8, num_stages=3),
            "bn128_bk128_w8_s3": dict(block_n=128, block_k=128, num_warps=8, num_stages=3),
            "bn64_bk128_w4_s3": dict(block_n=64, block_k=128, num_warps=4, num_stages=3),
            "bn32_bk64_w4_s4": dict(block_n=32, block_k=64, num_warps=4, num_stages=4)}


def xla_dequant(x, q, scale):
    return jnp.dot(x, df.dequantize(q, scale, BLOCK_IN, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def bench_shape(name, K, N, M, dry, deadline, log):
    R = 2 if dry else int(min(16, max(2, math.ceil((256 << 20) / (K * N)))))
    nb = -(-K // BLOCK_IN)
    keys = jax.random.split(jax.random.PRNGKey(K * 7 + N + M), 3 * R)
    xs = [jax.random.normal(keys[i], (M, K), jnp.bfloat16) for i in range(R)]
    qs = [jnp.clip(jax.random.normal(keys[R + i], (K, N), jnp.bfloat16) * 64, -448, 448).astype(df.FP8)
          for i in range(R)]
    ss = [jax.random.uniform(keys[2 * R + i], (nb, N), jnp.float32, 0.5, 1.5) / (64 * K ** 0.5) for i in range(R)]
    jax.block_until_ready((xs, qs, ss))
    exact = np.asarray(jnp.dot(xs[0].astype(jnp.float32), df.dequantize(qs[0], ss[0], BLOCK_IN),
                               precision=jax.lax.Precision.HIGHEST))
    nbytes = K * N + nb * N * 4
    rec = {"K": K, "N": N, "M": M, "copies": R, "MB": nbytes / 1e6,
           "default_config": df.default_config(M, K, N, BLOCK_IN), "variants": {}}
    RESULTS["shapes"][f"{name}@M{M}"] = rec
    log(f"== {name} M={M} K={K} N={N}: {nbytes / 1e6:.1f} MB, {R} copies per timed call")
    ikw = {"interpret": True} if dry else {}
    wanted = VARIANTS.split(",") if VARIANTS else None
    for vname, kw in {"xla_dequant": None, **variants_for(M)}.items():
        if wanted and vname not in wanted:
            continue
        r = rec["variants"][vname] = {"kwargs": kw}
        if time.perf_counter() > deadline and vname not in ("xla_dequant", "default"):
            r["skipped"] = "time budget"
            continue
        try:
            fn = xla_dequant if kw is None else functools.partial(df.dense_fp8, block_in=BLOCK_IN, **kw, **ikw)
            f = jax.jit(lambda xs, qs, ss: [fn(x, q, s) for x, q, s in zip(xs, qs, ss)])
            t0 = time.perf_counter()
            outs = jax.block_until_ready(f(xs, qs, ss))
            r["compile_s"] = round(time.perf_counter() - t0, 2)
            r["rel_err"] = rel_err(np.asarray(outs[0], np.float32), exact)
            g, top = gpu_us(f, (xs, qs, ss), n=1 if dry else 10, top=4, width=60)
            us = (g / R) if g is not None else 1e3 * wall_ms(f, (xs, qs, ss)) / R
            r["gpu_us" if g is not None else "wall_us"] = us
            r["kernels"] = top
            r["GBps"] = nbytes / (us * 1e3)
            log(f"  {vname:22s} {us:9.2f} us  {r['GBps']:7.0f} GB/s  err {r['rel_err']:.2g}  compile {r['compile_s']} s")
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            log(f"  {vname:22s} FAILED {r['error'][:500]}")
            traceback.print_exc(limit=2)
    ok = {k: v for k, v in rec["variants"].items() if v["kwargs"] is not None and "GBps" in v and v["rel_err"] < 1e-2}
    if ok:
        best = max(ok, key=lambda k: ok[k]["GBps"])
        rec.update(best=best, best_kwargs=ok[best]["kwargs"], best_GBps=ok[best]["GBps"],
                   xla_dequant_GBps=rec["variants"].get("xla_dequant", {}).get("GBps"))
        log(f"  -> best {best} {ok[best]['GBps']:.0f} GB/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--dry", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--time-budget-s", type=float, default=150.0)
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 65], help="M values")
    ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    args = ap.parse_args()
    shapes = SHAPES_DRY if args.dry else SHAPES_27B
    global VARIANTS
    VARIANTS = args.variants
    gpu_timing.QUICK = args.dry
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, dry=args.dry,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def log(*a):
        print(*a, flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(RESULTS, fh, indent=1, default=str)

    plan = [(n, M) for M in args.rows for n in (args.shapes.split(",") if args.shapes else shapes)]
    t_all = time.perf_counter()
    for i, (name, M) in enumerate(plan):
        left = t_all + args.time_budget_s - time.perf_counter()
        deadline = time.perf_counter() + left / (len(plan) - i)
        try:
            bench_shape(name, *shapes[name], M, args.dry, deadline, log)
        except Exception as e:
            RESULTS[f"{name}@M{M}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        save()
    log("\n== summary (GB/s of the fp8 weight + scale stream)")
    for k, r in RESULTS["shapes"].items():
        log(f"  {k:18s} best {r.get('best')}: {r.get('best_GBps') or 0:.0f} GB/s  "
            f"(dequant + XLA {r.get('xla_dequant_GBps') or 0:.0f})")
    log(f"  total {RESULTS['total_s']} s")


if __name__ == "__main__":
    main()
