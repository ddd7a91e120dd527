"""W8A8 block FP8 projections at the Qwen3.6-27B shapes on one GPU: the fp8-wgmma Mosaic GPU kernel
(kernels_pallas/w8a8_mgpu.py) checked, swept and timed over a whole decode step's matrices in a device loop.

    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv_fp8.py --out $OUT/gemv_fp8.json \\
        --table-out $OUT/w8a8_mgpu_configs.json      # H200: check + sweep + step, ~5 min
    JAX_PLATFORMS=cpu python benchmarks/bench_gemv_fp8.py --smoke   # tiny shapes, interpret mode: checks the script

Sections (--sections, comma list; default all three):
  * check: per 27B shape and M in 1/7/16/65/129, the kernel (default config) vs the jnp reference
    (`w8a8.w8a8_reference`, the same W8A8 function): the fraction of bf16 outputs that differ and the relative
    error (fp8 wgmma accumulates one 128-deep block with reduced precision on the GPU; the interpreter is exact);
  * sweep: per shape and M in 1/16/65/129, `Config` variants (block_n, split_k, stages) and the Pallas-Triton
    kernel; gpu_us = GPU time of one call (act-quant fusion + kernel + split-K reduce) from a profile over R
    distinct weight copies (nothing served from L2); TBps = fp8 weight bytes / gpu_us. The fastest config per
    (row tile, K, N) goes to --table-out (kernels_pallas/w8a8_mgpu_configs.json: `default_config` reads it) and
    is used by the step section of the same run;
  * step: the 256 fp8 matrices of one 27B decode step (48 GDN layers: w_in, w_out, w_gate_up, w_down; 16
    attention layers: w_qkv, wo, w_gate_up, w_down; the bf16 lm_head left out) chained as the model chains them
    (each projection's input is the previous one's output, sliced), inside one jitted `fori_loop`: the time per
    step is the slope between 2 and 6 iterations (launch and host time cancel), `tb_s` = fp8 bytes / that time.
    One weight set per layer kind, reused by every layer of that kind (a layer streams ≈ 380 MB between two
    reads of one matrix, ≫ the 50 MB L2). `gemm_tb_s` = {M: tb_s} (issue 38's `fp8.gemm_tb_s`).
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

from kernels_pallas import w8a8 as k  # noqa: E402
from kernels_pallas import w8a8_mgpu as km  # noqa: E402
from kernels_pallas._testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402
from gpu_timing import gpu_us, wall_ms  # noqa: E402

# fp8 projections of a 27B layer [N, K] -> here as (K, N) (GDN w_in without its bf16 b|a tail: qkv 10240 | z 6144;
# attention w_qkv = q+gate 2·24·256 | k 4·256 | v 4·256; w_gate_up = 2·17408)
SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}
SHAPES_SMOKE = {"w_in": (256, 512), "w_down": (512, 256)}
ROWS = (1, 16, 65, 129)
CHECK_ROWS = (1, 7, 16, 65, 129)
BLOCK = 128
RESULTS: dict = {"check": {}, "shapes": {}, "step": {}}


def log(*a):
    print(*a, flush=True)


def weights(K, N, R, key):
    """R copies of a random fp8 weight [N, K] (the whole e4m3 range) and its scale grid [N/128, cols]."""
    keys = jax.random.split(key, 2 * R)
    nb = -(-K // BLOCK)
    qs = [jnp.clip(jax.random.normal(keys[i], (N, K), jnp.bfloat16) * 64, -448, 448).astype(k.FP8) for i in range(R)]
    ss = [km.pad_scale(jax.random.uniform(keys[R + i], (-(-N // BLOCK), nb), jnp.float32, 0.5, 1.5)
                       / (64 * K ** 0.5)) for i in range(R)]
    return qs, ss


def variants_for(M: int, K: int, N: int) -> dict:
    """Config variants around `default_config`, the likeliest first (the sweep's time budget cuts the tail), + the
    Pallas-Triton kernel."""
    d = km.default_config(M, K, N)
    Mc, _ = km.rows_plan(M)
    nkb = -(-K // BLOCK)
    cols = km.scale_cols(nkb)
    out = {"default": d}

    def add(name, **kw):
        c = dataclasses.replace(d, **kw)
        if c.split_k > 1 and nkb // c.split_k < 2:
            return
        st = c.num_stages
        while st > 2 and km.smem_bytes(Mc, dataclasses.replace(c, num_stages=st), cols, 4) > km.SMEM_LIMIT:
            st -= 1
        c = dataclasses.replace(c, num_stages=st)
        if km.smem_bytes(Mc, c, cols, 4) > km.SMEM_LIMIT:
            return
        if c not in out.values() and N % c.block_n == 0:
            out[name] = c
    add("kb2", k_per_step=2)
    add("kb2_st3", k_per_step=2, num_stages=3)
    add("kb4_st2", k_per_step=4, num_stages=2)
    add("kb2_split_x2", k_per_step=2, split_k=2 * d.split_k)
    add("kb2_split_half", k_per_step=2, split_k=max(1, d.split_k // 2))
    add("st3", num_stages=3)
    add("split_x2", split_k=2 * d.split_k)
    add("split_half", split_k=max(1, d.split_k // 2))
    add("bn_alt", block_n=64 if d.block_n == 128 else 128, split_k=max(1, d.split_k // 2) if d.block_n == 64
        else 2 * d.split_k)
    out["triton"] = None
    return out


def _fn(cfg, interpret):
    if cfg is None:  # the Pallas-Triton kernel on the same [N, K] weight
        return functools.partial(k.w8a8, block_in=BLOCK, block_out=BLOCK, interpret=interpret)
    return functools.partial(km.w8a8_mgpu, block_in=BLOCK, block_out=BLOCK, config=cfg, interpret=interpret)


def check(shapes, rows, smoke):
    for name, (K, N) in shapes.items():
        qs, ss = weights(K, N, 1, jax.random.PRNGKey(K + N))
        for M in rows:
            x = (jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32) + 0.1).astype(jnp.bfloat16)
            ref = np.asarray(k.w8a8_reference(x, qs[0], ss[0], block_in=BLOCK, block_out=BLOCK), np.float32)
            out = np.asarray(km.w8a8_mgpu(x, qs[0], ss[0], interpret=smoke), np.float32)
            r = RESULTS["check"][f"{name}@M{M}"] = dict(
                differ=float(np.mean(out != ref)), rel_err=rel_err(out, ref), finite=bool(np.isfinite(out).all()),
                config=km.plan(M, K, N))
            log(f"  check {name:10s} M={M:4d}: differ {r['differ']:.4f}  rel_err {r['rel_err']:.2e}")


def sweep(shapes, rows, smoke, deadline_total):
    for si, (name, (K, N)) in enumerate(shapes.items()):
        R = 2 if smoke else int(min(8, max(2, math.ceil((256 << 20) / (K * N)))))
        qs, ss = weights(K, N, R, jax.random.PRNGKey(K * 7 + N))
        nbytes = K * N
        for i, M in enumerate(rows):
            left = deadline_total - time.perf_counter()
            deadline = time.perf_counter() + left / ((len(shapes) - si) * len(rows) - i)
            xs = [jax.random.normal(jax.random.PRNGKey(M * 31 + j), (M, K), jnp.bfloat16) for j in range(R)]
            ref = np.asarray(k.w8a8_reference(xs[0], qs[0], ss[0], block_in=BLOCK, block_out=BLOCK), np.float32)
            rec = RESULTS["shapes"][f"{name}@M{M}"] = {"K": K, "N": N, "M": M, "copies": R, "MB": nbytes / 1e6,
                                                       "variants": {}}
            log(f"== {name} M={M} K={K} N={N}: {nbytes / 1e6:.1f} MB fp8, {R} copies per timed call")
            vs = variants_for(M, K, N)
            if smoke:
                vs = {a: vs[a] for a in ("default", "triton")}
            for vname, cfg in vs.items():
                r = rec["variants"][vname] = {"config": None if cfg is None else dataclasses.asdict(cfg)}
                if time.perf_counter() > deadline and vname != "default":
                    r["skipped"] = "time budget"
                    continue
                try:
                    fn = _fn(cfg, smoke)
                    f = jax.jit(lambda xs, qs, ss: [fn(x, q, s) for x, q, s in zip(xs, qs, ss)])
                    t0 = time.perf_counter()
                    outs = jax.block_until_ready(f(xs, qs, ss))
                    r["compile_s"] = round(time.perf_counter() - t0, 2)
                    r["rel_err"] = rel_err(np.asarray(outs[0], np.float32), ref)
                    g, top = gpu_us(f, (xs, qs, ss), n=1 if smoke else 10, top=3, width=50)
                    us = (g / R) if g is not None else 1e3 * wall_ms(f, (xs, qs, ss)) / R
                    r["gpu_us" if g is not None else "wall_us"] = us
                    r["kernels"] = top
                    r["TBps"] = nbytes / (us * 1e6)
                    log(f"  {vname:18s} {us:9.2f} us  {r['TBps']:6.3f} TB/s  err {r['rel_err']:.2g}  "
                        f"compile {r['compile_s']} s")
                except Exception as e:
                    r["error"] = f"{type(e).__name__}: {str(e)[:800]}"
                    log(f"  {vname:18s} FAILED {r['error'][:300]}")
            ok = {a: v for a, v in rec["variants"].items() if "TBps" in v and v["rel_err"] < 1e-2
                  and v["config"] is not None}
            if ok:
                best = max(ok, key=lambda a: ok[a]["TBps"])
                rec.update(best=best, best_config=ok[best]["config"], best_TBps=ok[best]["TBps"],
                           triton_TBps=rec["variants"].get("triton", {}).get("TBps"))
                log(f"  -> best {best} {ok[best]['TBps']:.3f} TB/s")


def table(smoke: bool) -> dict:
    """{"configs": {table key: config}}: the best Config per (row tile, K, N)."""
    out = {}
    for r in sorted(RESULTS["shapes"].values(), key=lambda r: -r["M"]):  # smaller M (decode) wins a shared key
        if r.get("best_config"):
            out[km.table_key(r["M"], r["K"], r["N"])] = r["best_config"]
    return {"source": "benchmarks/bench_gemv_fp8.py", "device": RESULTS.get("device"), "date": RESULTS.get("date"),
            "smoke": smoke, "configs": out}


def step(rows, smoke, layers: int = 64):
    """The decode step's fp8 matrices chained in a device loop (module docstring)."""
    shapes = SHAPES_SMOKE if smoke else SHAPES_27B
    if smoke:
        kinds = {"gdn": [shapes["w_in"], shapes["w_down"]], "attn": [shapes["w_in"], shapes["w_down"]]}
        layers = 4
    else:
        kinds = {"gdn": [shapes["w_in"], shapes["w_out|wo"], shapes["w_gate_up"], shapes["w_down"]],
                 "attn": [shapes["attn_w_qkv"], shapes["w_out|wo"], shapes["w_gate_up"], shapes["w_down"]]}
    ws = {kind: [weights(K, N, 1, jax.random.PRNGKey(7 * K + N + len(kind)))for K, N in mats]
          for kind, mats in kinds.items()}
    ws = {kind: [(q[0], s[0]) for q, s in v] for kind, v in ws.items()}
    order = ["attn" if (i % 4 == 3) else "gdn" for i in range(layers)]
    nbytes = sum(q.size for kind in order for q, _ in ws[kind])
    RESULTS["step"]["fp8_bytes"] = nbytes
    RESULTS["step"]["matrices"] = sum(len(ws[kind]) for kind in order)
    fn = functools.partial(km.w8a8_mgpu, interpret=smoke)

    @jax.jit
    def run(x, ws, n):
        def body(_, x):
            for kind in order:
                for q, s in ws[kind]:
                    x = fn(x[:, :q.shape[1]], q, s)
            return x
        return jax.lax.fori_loop(0, n, body, x)

    K0 = ws["gdn"][0][0].shape[1]
    for M in rows:
        x = jax.random.normal(jax.random.PRNGKey(M), (M, K0), jnp.bfloat16)
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(run(x, ws, 1))
            comp = time.perf_counter() - t0
            ts = {}
            for n in (2, 6):
                ts[n] = wall_ms(run, (x, ws, n), reps=1 if smoke else 5, warmup=0 if smoke else 1)
            per = (ts[6] - ts[2]) / 4
            tb = nbytes / (per * 1e9) if per > 0 else None
            RESULTS["step"][str(M)] = dict(ms=per, tb_s=tb, wall_ms=ts, compile_s=round(comp, 1))
            log(f"  step M={M:4d}: {per:8.3f} ms per step  {tb or 0:6.3f} TB/s  (2 it {ts[2]:.2f} ms, 6 it "
                f"{ts[6]:.2f} ms; compile {comp:.1f} s)")
        except Exception as e:
            RESULTS["step"][str(M)] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            traceback.print_exc(limit=3)
    RESULTS["gemm_tb_s"] = {m: RESULTS["step"][m]["tb_s"] for m in map(str, rows)
                            if RESULTS["step"].get(m, {}).get("tb_s")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--table-out", default="", help="write the sweep's winners (kernels_pallas/w8a8_mgpu_configs.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode on the CPU")
    ap.add_argument("--sections", default="check,sweep,step")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="for the sweep")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="M values (default 1 16 65 129)")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=None, help="M values of the sweep (default: --rows)")
    args = ap.parse_args()
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_27B
    if args.shapes:
        shapes = {a: shapes[a] for a in args.shapes.split(",")}
    rows = tuple(args.rows or ((1, 7) if args.smoke else ROWS))
    gpu_timing.QUICK = args.smoke
    dev = jax.devices()[0]
    RESULTS.update(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, smoke=args.smoke, rows=rows,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    sections = args.sections.split(",")

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(RESULTS, fh, indent=1, default=str)
        if args.table_out:
            with open(args.table_out, "w") as fh:
                json.dump(table(args.smoke), fh, indent=1)

    t_all = time.perf_counter()
    if "check" in sections:
        log("== check: kernel vs reference")
        check(shapes, (1, 7) if args.smoke else CHECK_ROWS, args.smoke)
        save()
    if "sweep" in sections:
        sweep(shapes, tuple(args.sweep_rows or rows), args.smoke, time.perf_counter() + args.time_budget_s)
        # the step below runs this run's winners
        km.CONFIGS.update({key: km.Config(**c) for key, c in table(args.smoke)["configs"].items()})
        save()
    if "step" in sections:
        log("== step: the decode step's fp8 matrices in a device loop")
        step(rows, args.smoke)
    RESULTS["total_s"] = round(time.perf_counter() - t_all, 1)
    log(f"  gemm_tb_s {json.dumps({a: round(b, 3) for a, b in RESULTS.get('gemm_tb_s', {}).items()})}  "
        f"total {RESULTS['total_s']} s")
    save()


if __name__ == "__main__":
    main()
