"""W8A8 block FP8 GEMM (kernels_pallas.w8a8) at the Qwen3.6-27B fp8 projection shapes on one GPU: the sweep that
fills its config table.

    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv_fp8.py --out $OUT/gemv_fp8.json \\
        --table-out $OUT/w8a8_configs.json                 # H200: < 4 min (--time-budget-s, default 170)
    JAX_PLATFORMS=cpu python benchmarks/bench_gemv_fp8.py --smoke   # tiny shapes, interpret mode: checks the script

Per shape [K, N] (fp8 weight, compact 128x128 scales) and M rows (1 = decode, 16, 65 = verify at budget 64, 129):
  * "xla_ref" (M 1 and 65): the jnp reference on XLA (what kernels="xla" runs);
  * Pallas variants ({} = `default_config`), the likeliest winners first (the per-shape budget may cut the tail),
    incl. "transposed" (the weight as [N, K], K-major: Hopper's fp8 wgmma operand layout; the model stores [K, N]);
  * gpu_us: GPU time of one call (act-quant fusion + kernel + split-K reduce) from a profile, over R distinct
    weight copies per timed jit (R = clamp(256 MB / (K·N), 2, 8): nothing served from L2), gpu_us = total / R;
    TBps: fp8 weight bytes (K·N) / gpu_us; rel_err vs the reference (same W8A8 function).
  * "act_quant": the activation quantization alone (one XLA fusion) at each (M, K).
The JSON is rewritten after each shape: `best` per (shape, M) = the fastest variant with rel_err < 1e-2;
`gemm_tb_s` = {M: the slowest 27B shape's best TB/s} (issue 25's `fp8.gemm_tb_s`). --table-out writes the
best [K, N]-layout config per (row tile, K, N) in the format of kernels_pallas/w8a8_configs.json (copy it
there: `default_config` reads it).
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

from kernels_pallas import w8a8 as k  # noqa: E402
from kernels_pallas._testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_us, wall_ms  # noqa: E402

# fp8 projections of a 27B layer [K, N] (GDN w_in without its bf16 b|a tail; jaxddtree/model: w_in = qkv 10240 |
# z 6144, attention w_qkv = q+gate 2·24·256 | k 4·256 | v 4·256, w_gate_up = 2·17408)
SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}
SHAPES_SMOKE = {"w_in": (256, 384), "w_down": (512, 256)}
ROWS = (1, 16, 65, 129)
ROWS_SMOKE = (1, 7)
BLOCK = 128
RESULTS: dict = {"shapes": {}, "act_quant": {}}


def variants_for(M: int, K: int, N: int) -> dict:
    """Pallas variants around the default config (explicit kwargs of `w8a8.w8a8`), likeliest first."""
    c = k.default_config(M, K, N, BLOCK, BLOCK)
    s, bn, ns, nw = c["split_k"], c["block_n"], c["num_stages"], c["num_warps"]
    v = {"default": {},
         "transposed": dict(transposed=True),
         "split_x2": dict(split_k=2 * s),
         "split_half": dict(split_k=max(1, s // 2)),
         "stages_m1": dict(num_stages=max(2, ns - 1)),
         "warps_alt": dict(num_warps=8 if nw == 4 else 4),
         "bn_half": dict(block_n=max(32, bn // 2), split_k=max(1, s // 2)),
         "transposed_split_x2": dict(transposed=True, split_k=2 * s)}
    if k.row_tile(M) <= 32:
        v["bn256"] = dict(block_n=256, split_k=2 * s, num_stages=3)
        v["stages_5"] = dict(num_stages=5)
    return v


def _weights(K, N, R, key):
    keys = jax.random.split(key, 2 * R)
    qs = [jnp.clip(jax.random.normal(keys[i], (K, N), jnp.bfloat16) * 64, -448, 448).astype(k.FP8) for i in range(R)]
    ss = [jax.random.uniform(keys[R + i], (-(-K // BLOCK), -(-N // BLOCK)), jnp.float32, 0.5, 1.5) / (64 * K ** 0.5)
          for i in range(R)]
    return qs, ss


def bench_shape(name, K, N, rows, smoke, deadline_total, log):
    R = 2 if smoke else int(min(8, max(2, math.ceil((256 << 20) / (K * N)))))
    qs, ss = _weights(K, N, R, jax.random.PRNGKey(K * 7 + N))
    qts = None
    nbytes = K * N
    ikw = {"interpret": True} if smoke else {}
    for i, M in enumerate(rows):
        deadline = time.perf_counter() + (deadline_total - time.perf_counter()) / (len(rows) - i)
        xs = [jax.random.normal(jax.random.PRNGKey(M * 31 + j), (M, K), jnp.bfloat16) for j in range(R)]
        ref = np.asarray(k.w8a8_reference(xs[0], qs[0], ss[0], block_in=BLOCK, block_out=BLOCK), np.float32)
        rec = {"K": K, "N": N, "M": M, "copies": R, "MB": nbytes / 1e6, "default_config": k.plan(M, K, N),
               "variants": {}}
        RESULTS["shapes"][f"{name}@M{M}"] = rec
        log(f"== {name} M={M} K={K} N={N}: {nbytes / 1e6:.1f} MB fp8, {R} copies per timed call")
        vs = ({"xla_ref": None} if M in (1, 65) or smoke else {}) | variants_for(M, K, N)
        if smoke:  # the script's paths, not a sweep: the reference, the default, one layout / split variant each
            vs = {a: vs[a] for a in ("xla_ref", "default", "transposed_split_x2")}
        for vname, kw in vs.items():
            r = rec["variants"][vname] = {"kwargs": kw}
            if time.perf_counter() > deadline and vname != "default":
                r["skipped"] = "time budget"
                continue
            try:
                tr = bool(kw and kw.get("transposed"))
                if tr and qts is None:
                    qts = [q.T.copy() for q in qs]
                if kw is None:
                    fn = functools.partial(k.w8a8_reference, block_in=BLOCK, block_out=BLOCK)
                else:
                    fn = functools.partial(k.w8a8, block_in=BLOCK, block_out=BLOCK, **kw, **ikw)
                f = jax.jit(lambda xs, qs, ss: [fn(x, q, s) for x, q, s in zip(xs, qs, ss)])
                args = (xs, qts if tr else qs, ss)
                t0 = time.perf_counter()
                outs = jax.block_until_ready(f(*args))
                r["compile_s"] = round(time.perf_counter() - t0, 2)
                r["rel_err"] = rel_err(np.asarray(outs[0], np.float32), ref)
                if kw is not None:
                    r["config"] = k.plan(M, K, N, **{a: b for a, b in kw.items() if a != "transposed"})
                g, top = gpu_us(f, args, n=1 if smoke else 10, top=4, width=60)
                us = (g / R) if g is not None else 1e3 * wall_ms(f, args) / R
                r["gpu_us" if g is not None else "wall_us"] = us
                r["kernels"] = top
                r["TBps"] = nbytes / (us * 1e6)
                log(f"  {vname:22s} {us:9.2f} us  {r['TBps']:6.3f} TB/s  err {r['rel_err']:.2g}  "
                    f"compile {r['compile_s']} s")
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                log(f"  {vname:22s} FAILED {r['error'][:500]}")
                traceback.print_exc(limit=2)
        ok = {a: v for a, v in rec["variants"].items() if v["kwargs"] is not None and "TBps" in v
              and v["rel_err"] < 1e-2}
        if ok:
            best = max(ok, key=lambda a: ok[a]["TBps"])
            kn = {a: v for a, v in ok.items() if not v["kwargs"].get("transposed")}
            best_kn = max(kn, key=lambda a: kn[a]["TBps"]) if kn else None
            rec.update(best=best, best_kwargs=ok[best]["kwargs"], best_TBps=ok[best]["TBps"],
                       best_kn=best_kn, best_kn_TBps=kn[best_kn]["TBps"] if best_kn else None,
                       best_kn_config=kn[best_kn]["config"] if best_kn else None,
                       xla_ref_TBps=rec["variants"].get("xla_ref", {}).get("TBps"))
            log(f"  -> best {best} {ok[best]['TBps']:.3f} TB/s ([K, N] layout: {best_kn} "
                f"{rec['best_kn_TBps'] or 0:.3f})")


def bench_act_quant(Ks, rows, smoke, log):
    for K in Ks:
        for M in rows:
            x = jax.random.normal(jax.random.PRNGKey(M + K), (M, K), jnp.bfloat16)
            f = jax.jit(functools.partial(k.act_quant, block_in=BLOCK, rows=k.row_tile(M) * -(-M // k.row_tile(M))))
            jax.block_until_ready(f(x))
            g, top = gpu_us(f, (x,), n=1 if smoke else 20, top=2, width=60)
            us = g if g is not None else 1e3 * wall_ms(f, (x,))
            RESULTS["act_quant"][f"K{K}@M{M}"] = {"us": us, "kernels": top}
            log(f"  act_quant K={K:6d} M={M:4d}: {us:8.2f} us")


def summary(log):
    tb = {}
    for key, r in RESULTS["shapes"].items():
        if r.get("best_TBps"):
            m = str(r["M"])
            tb[m] = min(tb.get(m, 1e9), r["best_TBps"])
    RESULTS["gemm_tb_s"] = tb
    log("\n== summary (TB/s of the fp8 weight stream; best / best in the model's [K, N] layout / XLA reference)")
    for key, r in RESULTS["shapes"].items():
        log(f"  {key:20s} {r.get('best')}: {r.get('best_TBps') or 0:.3f}  {r.get('best_kn')}: "
            f"{r.get('best_kn_TBps') or 0:.3f}  xla_ref {r.get('xla_ref_TBps') or 0:.3f}")
    log(f"  gemm_tb_s (slowest shape per M): {json.dumps({a: round(b, 3) for a, b in tb.items()})}")


def table(smoke: bool) -> dict:
    """{"configs": {table key: config}} of the best [K, N]-layout variant per (shape, M)."""
    out = {}  # M = 1 and 16 share the 16-row tile: the smallest M (decode) wins its entry
    for r in sorted(RESULTS["shapes"].values(), key=lambda r: -r["M"]):
        c = r.get("best_kn_config")
        if c:
            out[k.table_key(r["M"], r["K"], r["N"])] = {a: c[a] for a in k.CONFIG_KEYS}
    return {"source": "benchmarks/bench_gemv_fp8.py", "device": RESULTS.get("device"), "date": RESULTS.get("date"),
            "smoke": smoke, "configs": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--table-out", default="", help="write the winners as a kernels_pallas/w8a8_configs.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--time-budget-s", type=float, default=170.0, help="for the GEMM sweep (act_quant: ~10 s)")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="M values (default 1 16 65 129)")
    args = ap.parse_args()
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_27B
    rows = tuple(args.rows or (ROWS_SMOKE if args.smoke else ROWS))
    gpu_timing.QUICK = args.smoke
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, smoke=args.smoke, rows=rows,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def log(*a):
        print(*a, flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(RESULTS, fh, indent=1, default=str)
        if args.table_out:
            with open(args.table_out, "w") as fh:
                json.dump(table(args.smoke), fh, indent=1)

    t_all = time.perf_counter()
    log("== act_quant alone")
    bench_act_quant(sorted({K for K, _ in shapes.values()}), rows, args.smoke, log)
    names = args.shapes.split(",") if args.shapes else list(shapes)
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        left = t0 + args.time_budget_s - time.perf_counter()
        try:
            bench_shape(name, *shapes[name], rows, args.smoke, time.perf_counter() + left / (len(names) - i), log)
        except Exception as e:
            RESULTS[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc()
        RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
        summary(lambda *a: None)
        save()
    summary(log)
    log(f"  total {RESULTS['total_s']} s")
    save()


if __name__ == "__main__":
    main()
