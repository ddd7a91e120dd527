#!/usr/bin/env python
"""jax.jit benchmarks at Qwen3.6-27B / Qwen3.6-27B-DFlash shapes with random bf16 weights made on the GPU.

Every figure is timed the way `jaxddtree.generate` runs it: decode steps and rounds are `loop.loop_fn` (the
very function generate calls), N of them inside one jitted call (time / N), on a state made by `loop.start_fn`
with caches sized by `loop.capacity` for a --context-token prompt; each part of a round (draft, tree build,
verify, accept + commit: loop's stage functions) runs N times inside one jitted loop of its own. The host's
share is its own figure: `host_overhead_ms` (one round per call, calls back to back, minus the device loop's
round) and `dispatch_ms` (the time a call takes to return). `e2e` runs `jaxddtree.generate` itself (AR,
DFlash, DDTree 64; loop="device", "host", "host" with sync_every=1) and records ms per round. Medians of
--runs calls after warm-up, one process. Results are merged into `--out` (default
benchmarks/results/h200.json); `--sections` picks what to run.

    python benchmarks/bench.py --sections bandwidth,ar,verify,round --kernels xla
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

try:
    import jaxddtree  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import ops

from jaxddtree.model import draft_vocab
from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.speculative import budget as budget_lib
from jaxddtree.speculative import loop as loop_lib
from jaxddtree.speculative import tree as tree_lib
from jaxddtree.model.cache import KVCache
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.drafter import Drafter, DrafterLayer, DrafterParams, init_draft_cache
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.prefill import round_up
from jaxddtree.model.target import random_target

QWEN36_27B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
DFLASH_27B = dict(hidden_size=5120, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
                  intermediate_size=17408, rms_norm_eps=1e-6, rope_theta=1e7, block_size=16,
                  target_layer_ids=(1, 16, 31, 46, 61), mask_token_id=248070, vocab_size=248320,
                  num_target_layers=64, layer_windows=(2048, 2048, 2048, 2048, None))
# --smoke (also benchmarks/profile_gpu.py): tiny shapes that run on a CPU
SMOKE_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                    linear_key_head_dim=16, linear_value_head_dim=16)
SMOKE_DFLASH = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                    target_layer_ids=(1, 5), mask_token_id=511, vocab_size=512, num_target_layers=8,
                    layer_windows=(16, None))


def median_ms(fn, n=20, warmup=3):
    """fn() -> something to block on; returns the median wall time in ms (warm-up excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def pair_configs(smoke: bool):
    """(target config, drafter config, dtype) of `random_pair`."""
    raw, dflash, dtype = dict(QWEN36_27B), dict(DFLASH_27B), "bfloat16"
    if smoke:  # the tiny shapes (the code path on the CPU)
        raw.update(SMOKE_TARGET)
        dflash.update(SMOKE_DFLASH)
        dtype = "float32"
    return text_config_from_dict(raw, where="Qwen3.6-27B shapes"), DrafterConfig(**dflash), dtype


def random_pair(smoke: bool, kernels: str | None = None):
    """(target, drafter) with random weights at the 27B / DFlash shapes (bf16), or at the smoke shapes in fp32:
    the servers' benchmarks (serve_bench.py, agent_bench.py). kernels: the target's (default "xla" on a CPU, else
    "pallas")."""
    cfg, dcfg, dtype = pair_configs(smoke)
    target = random_target(cfg, dtype)
    target.kernels = kernels or kernels_here()
    return target, random_drafter(dcfg, jnp.dtype(dtype))


def kernels_here() -> str:
    """The kernels a target gets by default on this backend."""
    return "xla" if jax.default_backend() == "cpu" else "pallas"


def random_drafter(cfg: DrafterConfig, dtype, seed=0) -> Drafter:
    key = jax.random.key(seed)
    H, nh, nkv, hd, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size

    def w(shape, fan_in):
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)

    layers = tuple(DrafterLayer(attn_norm=w((H,), 1), w_qkv=w((H, (nh + 2 * nkv) * hd), H),
                                wo=w((nh, hd, H), nh * hd), q_norm=w((hd,), 1), k_norm=w((hd,), 1),
                                mlp_norm=w((H,), 1), w_gate_up=w((H, 2, I), H), w_down=w((I, H), I))
                   for _ in range(cfg.num_layers))
    params = DrafterParams(fc=w((cfg.num_target_features * H, H), cfg.num_target_features * H),
                           hidden_norm=w((H,), 1), layers=layers, norm=w((H,), 1))
    return Drafter(config=cfg, params=params, path="random")


def fill_random(tree, key):
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        if x.ndim >= 2:
            out.append((0.5 * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype))
        else:
            out.append(x)
    return jax.tree.unflatten(treedef, out)


def make_plan(target, dcfg, method: str, budget: int = 0) -> loop_lib.Plan:
    """The Plan `generate` makes for (method, budget) at temperature 0."""
    return loop_lib.make_plan(target, dcfg if method != "ar" else None, method, budget)


def plan_for(target, dcfg, figure: str) -> loop_lib.Plan:
    """The Plan of a timed figure: "ar" (the AR step), "chain" (DFlash) or a DDTree budget ("64")."""
    if figure in ("ar", "chain"):
        return make_plan(target, dcfg, "ar" if figure == "ar" else "dflash")
    return make_plan(target, dcfg, "ddtree", int(figure))


def loop_state(target, drafter, plan, context: int, max_new: int, cache=None, costs=None):
    """The decode state `generate` starts its rounds from after a `context`-token prompt (caches sized by
    `loop.capacity(context, max_new)`, made by `loop.start_fn`), with random cache contents (committed length
    = context) and random logits for the first token. `cache`: use this target cache instead (its length is
    set to context). costs: an auto plan's table (`budget_lib.padded`)."""
    cfg = target.config
    dcfg = drafter.config if plan.method != "ar" else None
    _, S = loop_lib.capacity(target, dcfg, plan.method, plan.budget, context, max_new)
    if cache is None:
        cache = fill_random(target.init_cache(S), jax.random.key(3))
    cache = cache.replace(length=jnp.int32(context))
    dcache = None
    if dcfg:
        dcache = fill_random(init_draft_cache(dcfg, 1, cache.max_len, jnp.bfloat16), jax.random.key(4))
        dcache = dataclasses.replace(dcache, length=jnp.int32(context))
    P = dcfg.block_size if dcfg else 1
    F = max(len(plan.feature_layers) * cfg.hidden_size, 1)
    logits = jax.random.normal(jax.random.key(5), (1, cfg.vocab_size), jnp.float32)
    start = loop_lib.start_fn(target, plan, P, F, round_up(max_new, 256))
    state = start(logits, sharding.place(cache, target.mesh), dcache, jnp.uint32(0),
                  jnp.zeros((cfg.vocab_size,), bool), jnp.float32(0.0), jnp.int32(max_new), jnp.int32(0),
                  jnp.float32(1.0), jnp.float32(0.0), costs)
    return sharding.place(state, target.mesh)


class Rounds:
    """`rounds_per_call` rounds of `plan` per call of `loop.loop_fn` (what `generate` calls) on a
    `loop_state`; `call()` enqueues one call and returns its Progress (nothing blocks)."""

    def __init__(self, target, drafter, plan, context: int, rounds_per_call: int, total_rounds: int, cache=None,
                 costs=None):
        dcfg = drafter.config if plan.method != "ar" else None
        P = dcfg.block_size if dcfg else 1
        self.fn = loop_lib.loop_fn(target, dcfg, plan)
        self.fn1 = loop_lib.loop_fn(target, dcfg, plan, 1)  # one round per call (the server's host loop)
        self.args = (target.leaves, drafter.params if dcfg else None)
        self.state = loop_state(target, drafter, plan, context, total_rounds * P, cache=cache, costs=costs)
        self.oracle = jnp.zeros((1,), jnp.int32)
        self.n = jnp.int32(rounds_per_call)
        self.rounds_per_call = rounds_per_call

    def call(self, n=None):
        self.state, prog = self.fn(*self.args, self.state, self.oracle, self.n if n is None else n)
        return prog

    def ms_per_round(self, runs: int) -> float:
        """Median over `runs` calls of (wall time of one call, blocked) / rounds it ran (checked)."""
        jax.block_until_ready(self.call())  # compile + warm up
        ts = []
        for _ in range(runs):
            before = int(self.state.n_rounds)
            t = time.perf_counter()
            prog = self.call()
            jax.block_until_ready(prog.n_rounds)
            dt = time.perf_counter() - t
            ran = int(prog.n_rounds) - before
            assert ran == self.rounds_per_call, f"ran {ran} rounds, not {self.rounds_per_call} (done early?)"
            ts.append(dt * 1e3 / ran)
        return statistics.median(ts)

    def temp_gb(self) -> float | None:
        """XLA's temporary buffer of the compiled rounds (GB; `memory_analysis`), None where it is not reported.
        Lowers and compiles again: run with JAX_COMPILATION_CACHE_DIR set so that this is a cache load."""
        try:
            c = self.fn.lower(*self.args, self.state, self.oracle, self.n).compile()
            return round(c.memory_analysis().temp_size_in_bytes / 1e9, 3)
        except Exception:  # noqa: BLE001  (a diagnostic: never fail the benchmark for it)
            return None

    def call1(self):
        self.state, prog = self.fn1(*self.args, self.state, self.oracle)
        return prog

    def host_figures(self, calls: int) -> dict:
        """One round per call (`loop_fn(chunk=1)`, as the host loop with sync_every=1 calls it): `calls` calls back
        to back (blocked once at the end) -> ms per round; the median time a call takes to return (dispatch);
        and one blocked call per round (how sessions 2-5 timed rounds)."""
        jax.block_until_ready(self.call1())
        t = time.perf_counter()
        disp = []
        for _ in range(calls):
            a = time.perf_counter()
            prog = self.call1()
            disp.append(time.perf_counter() - a)
        jax.block_until_ready(prog.n_rounds)
        back_to_back = (time.perf_counter() - t) * 1e3 / calls
        blocked = []
        for _ in range(calls):
            a = time.perf_counter()
            jax.block_until_ready(self.call1().n_rounds)
            blocked.append(time.perf_counter() - a)
        return {"back_to_back_ms_per_round": back_to_back, "dispatch_ms": statistics.median(disp) * 1e3,
                "blocking_call_ms_per_round": statistics.median(blocked) * 1e3}


def loop_ms(fn, carry, n: int, runs: int, consts=()) -> float:
    """ms per iteration of `fn(consts, carry) -> carry` run n times inside one jitted fori_loop (the carry
    donated, each iteration depending on the last, so nothing is hoisted out of the loop; `consts`: arrays the
    iterations read, passed as arguments — closed over they would be compiled in as constants); median of
    `runs` calls."""
    many = jax.jit(lambda k, c: jax.lax.fori_loop(0, n, lambda i, x: fn(k, x), c), donate_argnums=1)
    holder = [many(consts, jax.tree.map(jnp.copy, carry))]  # a copy: the caller's carry stays usable
    jax.block_until_ready(holder[0])

    def once():
        holder[0] = many(consts, holder[0])
        return holder[0]

    return median_ms(once, n=runs, warmup=1) / n


def random_tree(n_nodes: int, depth: int, seed: int):
    rs = np.random.RandomState(seed)
    parents, depths = [-1], [0]
    for i in range(1, n_nodes):
        while True:
            p = int(rs.randint(0, i))
            if depths[p] < depth:
                break
        parents.append(p)
        depths.append(depths[p] + 1)
    return np.asarray(parents, np.int32)


def decode_step(gd, td, K: int, kernels: str):
    """The greedy AR decode step (leaves, cache, tok [1, 1]) -> (next tok, cache) with these kernels (pure)."""
    def decode(leaves, cache, tok):
        model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
        lay = layout_lib.sequence(cache.length, 1, K, kernels=kernels)
        logits, cache, _, _ = model(tok, cache, lay, logits="all")
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], cache
    return decode


def make_decode(target, kernels: str):
    """`decode_step` jitted, cache donated: for profile_gpu.py's decode-fusion A/B (kernels: a variant of "pallas",
    ops.VARIANTS); the AR figures of this script are `loop.loop_fn` rounds, as generate runs them."""
    step = decode_step(target.graphdef, target.treedef, target.config.linear_conv_kernel_dim, kernels)
    return jax.jit(step, donate_argnames=("cache",))


def stream_rate(d_model: int, cols: int, target_kernels: str, log, smoke=False) -> dict:
    """TB/s at which one [1, d_model] x [d_model, cols] bf16 GEMV streams its weight, for XLA and (on a GPU) our
    Pallas GEMV: the best is the floor's rate. Timed as the decode loop is: 4 distinct copies (nothing stays in L2)
    per iteration of a `fori_loop` inside one jitted call, each iteration's input made from the last one's outputs
    (so nothing is hoisted), at two iteration counts; the rate comes from the slope (time of the long call − the
    short one) ÷ the extra iterations, so a call's fixed cost (dispatch, launch, sync; 0.5–1 ms of a 2.6 ms single
    call on the H200, which made the floor above the AR step on some machines) is not in it."""
    from kernels_pallas import dense as dense_kernel
    Ws = [jax.random.normal(jax.random.key(10 + i), (d_model, cols), jnp.bfloat16) for i in range(4)]
    x = jax.random.normal(jax.random.key(2), (1, d_model), jnp.bfloat16)
    kernels = {"xla": lambda x, W: x @ W}
    if ops.is_pallas(target_kernels):
        kernels["pallas"] = dense_kernel.dense
    short, long = (1, 3) if smoke else (2, 10)

    def looped(gemv, n):
        def run(x, Ws):
            def body(i, x):
                ys = [gemv(x, W) for W in Ws]
                # a select the compiler cannot resolve: the next input depends on this iteration's outputs
                return jnp.where(i < 0, sum(y[:, :d_model] for y in ys).astype(x.dtype), x)
            return jax.lax.fori_loop(0, n, body, x)
        return jax.jit(run)

    out = {}
    for name, gemv in kernels.items():
        f_short, f_long = looped(gemv, short), looped(gemv, long)
        ms = (median_ms(lambda: f_long(x, Ws), n=5 if smoke else 15)
              - median_ms(lambda: f_short(x, Ws), n=5 if smoke else 15)) / (long - short)
        out[name] = float(f"{sum(W.size for W in Ws) * 2 / (max(ms, 1e-6) * 1e-3) / 1e12:.4g}")  # (not 0.0 on a CPU)
        log(f"GEMV [1,{d_model}] x [{d_model},{cols}] ({name}), {long} vs {short} iterations per call: {out[name]} TB/s")
    del Ws
    return out


def bench_fp8(args, cfg, dcfg: DrafterConfig, res: dict, save, log):
    """--weights fp8, keys fp8.*: a random fp8 target (`random_target(weights="fp8")`, made without a bf16 copy)
    + the bf16 drafter + caches for an 8K context (`loop.capacity(8192 - 256, 256)`), then, in this order:
      fp8.ar_step_ms     greedy decode step (loop rounds, --rounds-per-call per call) at --context tokens;
      fp8.chain_round_ms DFlash round (the drafter's argmax chain verified; same context);
      fp8.round_ms.64    DDTree round at budget 64 (same context; the decode state freed first);
      fp8.memory_gb_in_use_peak  [in use, peak so far, live jax arrays] after building the target, the drafter,
                         the decode loop and the rounds (where the peak comes from);
      fp8.peak_gb        jax peak_bytes_in_use after those (None where the backend keeps no memory stats);
      fp8.floor_ms       bytes streamed per decode step (every target leaf but the embedding) ÷ the best bf16
                         GEMV rate of `stream_rate` (measured last so that its 10 GB do not count in the peak)."""
    from jaxddtree.model.fp8 import FP8

    mem: dict = {}

    def memory(stage):  # (in use, peak so far, live arrays) in GB after each stage: where the peak comes from
        import gc
        gc.collect()
        st = jax.devices()[0].memory_stats() or {}
        live = sum(a.size * a.dtype.itemsize for a in jax.live_arrays())
        if st:
            mem[stage] = [round(st.get("bytes_in_use", 0) / 1e9, 3), round(st.get("peak_bytes_in_use", 0) / 1e9, 3),
                          round(live / 1e9, 3)]

    t0 = time.time()
    target = random_target(cfg, "bfloat16", seed=0, weights="fp8")
    target.kernels = args.kernels
    n_fp8 = sum(x.dtype == FP8 for x in target.leaves)
    streamed = sum(x.size * x.dtype.itemsize for x in target.leaves) - cfg.vocab_size * cfg.hidden_size * 2
    out = res.setdefault("fp8_dfp8" if args.drafter_fp8 else "fp8", {})
    out["weights_streamed_gb"] = round(streamed / 1e9, 3)
    out["memory_gb_in_use_peak"] = mem
    memory("target")
    log(f"fp8 target built in {time.time() - t0:.1f}s: {n_fp8} fp8 arrays, {streamed / 1e9:.2f} GB streamed/token")
    drafter = random_drafter(dcfg, jnp.bfloat16)
    if args.drafter_fp8:
        drafter = drafter.to_fp8()
    memory("drafter")
    L = args.context
    n = args.rounds_per_call
    ar = Rounds(target, drafter, make_plan(target, dcfg, "ar"), L, 4 * n, (args.runs + 2) * 4 * n)
    t = time.time()
    out["ar_step_ms"] = round(ar.ms_per_round(args.runs), 3)
    log(f"fp8 AR step {out['ar_step_ms']} ms ({time.time() - t:.1f}s with compilation)")
    temp = out.setdefault("xla_temp_gb", {})
    temp["ar"] = ar.temp_gb()
    memory("decode loop (+ its caches)")
    del ar
    save()
    chain = Rounds(target, drafter, make_plan(target, dcfg, "dflash"), L, n, (args.runs + 2) * n)
    out["chain_round_ms"] = round(chain.ms_per_round(args.runs), 3)
    temp["chain"] = chain.temp_gb()
    log(f"fp8 chain (DFlash) round {out['chain_round_ms']} ms; XLA temp buffers (GB) {temp}")
    memory("chain round (+ its caches)")
    del chain
    save()
    rnd = Rounds(target, drafter, make_plan(target, dcfg, "ddtree", 64), L, n, (args.runs + 2) * n)
    out["round_ms"] = {"64": round(rnd.ms_per_round(args.runs), 3)}
    temp["64"] = rnd.temp_gb()
    log(f"fp8 round budget 64: {out['round_ms']['64']} ms; XLA temp buffers (GB) {temp}")
    memory("round (+ its caches)")
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    out["peak_gb"] = None if peak is None else round(peak / 1e9, 3)
    out["peak_note"] = "peak_bytes_in_use: fp8 target + bf16 drafter + caches + the loops' temporaries"
    log(f"fp8 memory (GB in use, peak so far) by stage: {mem}; peak {out['peak_gb']} GB")
    del rnd
    save()
    if args.weights == "both":  # the bf16 sections of the same run follow: free the fp8 model first
        out["weights_streamed_gb"] = round(streamed / 1e9, 3)
        return
    rates = stream_rate(cfg.hidden_size, cfg.vocab_size if not args.smoke else 512, args.kernels, log, args.smoke)
    out["weight_stream_tb_s"] = max(rates.values())
    out["floor_ms"] = round(streamed / (out["weight_stream_tb_s"] * 1e12) * 1e3, 3)
    out["floor_over_ar"] = round(out["floor_ms"] / out["ar_step_ms"], 3)
    save()


E2E_METHODS = {"ar": ("ar", 64), "dflash": ("dflash", 64), "ddtree64": ("ddtree", 64),
               "auto": ("ddtree", "auto")}  # name -> (method, tree_budget); "auto" is generate's default


def e2e(args, target, drafter, res, save, log):
    """`jaxddtree.generate` itself at these shapes: a --context-token random prompt, --e2e-tokens new tokens,
    --e2e-methods (AR / DFlash / DDTree(64) / DDTree with tree_budget="auto") x loop="device" / "host" (sync_every 4) / "host" with sync_every=1 (the server's);
    ms per round = stats["decode_s"] / stats["rounds"] (median of --e2e-runs; the first call compiles)."""
    import jaxddtree
    cfg = target.config
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, args.context).tolist()
    out = res.setdefault("e2e", {})
    out["note"] = (f"jaxddtree.generate, {args.context}-token random prompt, {args.e2e_tokens} new tokens, "
                   f"random weights (acceptance ~1); ms per round = decode_s / rounds, median of {args.e2e_runs}")
    loops = {"device": dict(loop="device"), "host": dict(loop="host"), "host1": dict(loop="host", sync_every=1)}
    for name in args.e2e_methods.split(","):
        method, budget = E2E_METHODS[name]
        rec = out.setdefault(name, {})
        kw = dict(drafter=drafter, method=method, tree_budget=budget, max_new_tokens=args.e2e_tokens)
        t = time.time()
        jaxddtree.generate(target, ids, loop="device", **kw)
        log(f"e2e {name}: compiled + first run in {time.time() - t:.1f}s")
        for lname, lkw in loops.items():
            jaxddtree.generate(target, ids, **kw, **lkw)  # this loop's executable compiled before it is timed
            ms, ttft = [], []
            for _ in range(args.e2e_runs):
                g = jaxddtree.generate(target, ids, **kw, **lkw)
                ms.append(g.stats["decode_s"] / max(g.stats["rounds"], 1) * 1e3)
                ttft.append(g.stats["time_to_first_token_s"])
            rec[f"{lname}_ms_per_round"] = round(statistics.median(ms), 3)
            rec[f"{lname}_ttft_s"] = round(statistics.median(ttft), 3)
            rec["rounds"] = g.stats["rounds"]
        rec["host_over_device"] = round(rec["host_ms_per_round"] / rec["device_ms_per_round"], 3)
        rec["host1_over_device"] = round(rec["host1_ms_per_round"] / rec["device_ms_per_round"], 3)
        log(f"e2e {name}: {json.dumps(rec)}")
        save()


def default_out(device_kind: str, smoke: bool) -> str | None:
    """Where a run's figures go unless --out names a file: the H200's record only from an H200 (a CPU smoke run or
    another card once overwrote it), another card's under its own name, a smoke run nowhere."""
    if smoke:
        return None
    slug = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_")
    return "benchmarks/results/h200.json" if "h200" in slug else f"benchmarks/results/{slug}.json"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="bandwidth,ar,prefill,verify,parts,round,host,e2e",
                    help="comma list of: bandwidth, ar, prefill, verify, parts, round, host, e2e (default: all)")
    ap.add_argument("--kernels", default=None, choices=["xla", *ops.VARIANTS],
                    help="kernel path (default: pallas on a GPU, else xla; a variant of pallas: ops.VARIANTS, e.g. "
                         "pallas:unfused); keys of a non-default path get a suffix")
    ap.add_argument("--context", type=int, default=4096, help="committed context length for decode/verify")
    ap.add_argument("--verify-nodes", default="16,32,64,128,256", help="N (non-root) for the verify sweep")
    ap.add_argument("--budgets", default="16,64,256", help="DDTree budgets for the round timings")
    ap.add_argument("--runs", type=int, default=7, help="timed calls per measurement (median reported)")
    ap.add_argument("--rounds-per-call", type=int, default=16,
                    help="rounds (or loop iterations of a part) inside one jitted call; AR steps run 4x as many")
    ap.add_argument("--e2e-tokens", type=int, default=64, help="new tokens per generate call in the e2e section")
    ap.add_argument("--e2e-methods", default="ar,dflash,ddtree64,auto",
                    help=f"comma list of {', '.join(E2E_METHODS)} for the e2e section")
    ap.add_argument("--e2e-runs", type=int, default=3, help="generate calls per e2e figure (median)")
    ap.add_argument("--out", default=None, help="JSON file to merge results into (default: on an H200 "
                    "benchmarks/results/h200.json, on another GPU benchmarks/results/<device>.json; --smoke writes "
                    "nothing unless --out is given)")
    ap.add_argument("--config", default=None, help="HF config.json for other target shapes")
    ap.add_argument("--contexts", default="",
                    help="comma list of context lengths (e.g. 4096,32768,131072): AR step, DDTree round (budget 64) "
                         "and tree attention (16 layers, 65 nodes) at each, prefill of --prefill-contexts "
                         "(*_by_context keys)")
    ap.add_argument("--context-budgets", default="chain,15,31,63,127",
                    help="with --contexts: rounds timed at each context for the --budget auto cost table "
                         "(round_ms_by_budget_context; 'chain' = DFlash)")
    ap.add_argument("--auto-forced", default="on", choices=["on", "off"],
                    help="with --contexts: also time generate's tree_budget='auto' round forced to each of "
                         "--context-budgets (auto_round_ms_by_budget_context: it drafts and builds the largest "
                         "tree every round; bench_auto_budget.py's cost of auto)")
    ap.add_argument("--prefill-contexts", default="8192,32768,131072",
                    help="prompt lengths timed for prefill_s_by_context (with --contexts; 'none': no prefill)")
    ap.add_argument("--prefill-chunk", default="2048", help="rows per prefill call in the context sweep; a comma "
                    "list times each in this run (prefill_s_by_chunk_context; prefill_s_by_context takes the first)")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallelism over the first N GPUs; the results go "
                    "into the tp<N> object of --out (tp_ratios compares tp1 and tp2 when both are there)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few runs: check the script on a CPU")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="the drafter drafts only N token ids (its lm_head over the target's first N rows, "
                         "`Drafter.with_draft_vocab`; issue 41); keys get the suffix _dv<N>; bf16 only (0: all ids)")
    ap.add_argument("--drafter-fp8", action="store_true", help="the drafter's projections in FP8 W8A8 "
                    "(`Drafter.to_fp8`; issue 41): bf16 keys get the suffix _dfp8, the fp8 section goes to fp8_dfp8")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "both"],
                    help="fp8: random fp8 target weights; writes only the fp8.* keys (see bench_fp8); both: the fp8 keys "
                         "first (its memory peak), then the bf16 sections in the same process")
    ap.add_argument("--allreduce", default="nccl", choices=list(sharding.ALLREDUCE_MODES),
                    help="tp > 1: how the all-reduces run (sharding.ALLREDUCE_MODES: XLA_FLAGS set before the "
                         "backend starts); results go into tp<N> (nccl) or tp<N>_<mode>")
    args = ap.parse_args(argv)
    sharding.use_allreduce(args.allreduce)  # read when the backend starts: nothing above has touched a device
    if (args.tp or 1) > 1 and args.contexts:
        ap.error("--contexts runs at tp=1 only (its tree-attention timing calls the kernel outside the model)")
    sections = set(args.sections.split(","))

    raw = json.load(open(args.config)) if args.config else dict(QWEN36_27B)
    dflash = dict(DFLASH_27B)
    if args.smoke:
        raw.update(SMOKE_TARGET)
        dflash.update(SMOKE_DFLASH)
        args.runs, args.context, args.rounds_per_call, args.e2e_tokens, args.e2e_runs = 3, 64, 2, 6, 1
        if args.contexts:
            args.contexts, args.prefill_contexts = "64,192", "64,128"
            args.prefill_chunk = ",".join(dict.fromkeys(str(min(int(c), 32)) for c in args.prefill_chunk.split(",")))
    cfg = text_config_from_dict(raw, where=args.config or "built-in Qwen3.6-27B shapes")
    dev = jax.devices()[0]
    res = top = {}
    args.out = args.out or default_out(dev.device_kind, args.smoke)
    if args.out and os.path.exists(args.out):
        res = top = json.load(open(args.out))
    if args.tp is not None:
        res = top.setdefault(f"tp{args.tp}" + ("" if args.allreduce == "nccl" else f"_{args.allreduce}"), {})
        res["allreduce"] = args.allreduce
    tp = args.tp or 1
    default_kernels = "pallas" if dev.platform == "gpu" else "xla"
    args.kernels = args.kernels or default_kernels
    key = "" if args.kernels == default_kernels else f"_{args.kernels}"
    if args.draft_vocab:
        if args.weights != "bf16" or not 0 < args.draft_vocab <= cfg.vocab_size:
            ap.error(f"--draft-vocab needs --weights bf16 and 1 <= N <= {cfg.vocab_size}")
        key += f"_dv{args.draft_vocab}"
    if args.drafter_fp8:
        key += "_dfp8"
    res["kernels"] = f"{default_kernels} (default here); keys ending in _xla/_pallas[:variant]: another path"
    res.update({"device": dev.device_kind, "date": datetime.date.today().isoformat(), "jax": jax.__version__})

    def save():
        if not args.out:
            return
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        f8 = res.get("fp8", {})
        if args.weights == "both" and f8:  # issue 38's ratios, fp8 over bf16 of this run
            f8["over_bf16"] = {k: round(a / b, 3) for k, a, b in (
                ("ar_step", f8.get("ar_step_ms"), res.get("ar_step_ms")),
                ("chain_round", f8.get("chain_round_ms"), res.get("chain_round_ms")),
                ("round_64", f8.get("round_ms", {}).get("64"), res.get("round_ms", {}).get("64"))) if a and b}
        for tp2 in [k for k in top if k.startswith("tp2") and not k.endswith("_ratios")]:  # issue 18's goals
            if "tp1" in top and tp2 in top:
                top[f"{tp2}_ratios"] = {f"{k}_tp2_over_tp1": round(v2 / v1, 3) for k, v1, v2 in (
                    ("ar_step_ms", top["tp1"].get("ar_step_ms"), top[tp2].get("ar_step_ms")),
                    ("round_ms_64", top["tp1"].get("round_ms", {}).get("64"),
                     top[tp2].get("round_ms", {}).get("64"))) if v1 and v2}
        with open(args.out, "w") as f:
            json.dump(top, f, indent=1, sort_keys=True)

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.weights in ("fp8", "both"):
        bench_fp8(args, cfg, DrafterConfig(**dflash), res, save, log)
        if args.weights == "fp8":
            print(json.dumps(res, indent=1, sort_keys=True))
            return
        import gc
        gc.collect()

    res["method_note"] = (
        "device loop: N rounds (AR steps) per jitted call of loop.loop_fn, time / N; parts: N iterations of "
        "loop's stage functions in one jitted fori_loop; caches sized by loop.capacity(context, rounds * rows); "
        "host_overhead_ms = round(64) at one round per call (calls back to back) - the device-loop round")
    if "bandwidth" in sections:
        cols = raw.get("text_config", raw)["vocab_size"] if not args.smoke else 512
        d_model = raw.get("text_config", raw)["hidden_size"]
        rates = stream_rate(d_model, cols, args.kernels, log, args.smoke)
        res["weight_stream_tb_s_by_kernel"] = rates
        res["weight_stream_tb_s"] = max(rates.values())
        res["weight_stream_note"] = (f"x[1,{d_model}] @ w[{d_model},{cols}] bf16, 4 distinct copies per iteration of a "
                                     "fori_loop in one jit, the slope between two iteration counts per call, per kernel "
                                     "(xla, pallas GEMV); the floor uses the best")
        save()

    t0 = time.time()
    target = random_target(cfg, "bfloat16", seed=0, tp=tp)
    target.kernels = args.kernels
    n_bytes = sum(x.size * x.dtype.itemsize for x in target.leaves)
    embed_bytes = cfg.vocab_size * cfg.hidden_size * 2
    streamed = n_bytes - embed_bytes
    res["weights_streamed_gb"] = round(streamed / 1e9, 3)
    if "weight_stream_tb_s" in res:
        res["floor_ms"] = round(streamed / tp / (res["weight_stream_tb_s"] * 1e12) * 1e3, 3)  # per device
    log(f"target built in {time.time() - t0:.1f}s: {n_bytes / 1e9:.2f} GB ({streamed / 1e9:.2f} GB streamed/token)")
    gd, td = target.graphdef, target.treedef
    L, n, runs = args.context, args.rounds_per_call, args.runs
    dcfg = DrafterConfig(**dflash)
    drafter = random_drafter(dcfg, jnp.bfloat16)
    drafter.params = sharding.replicate(drafter.params, target.mesh)
    if args.draft_vocab:  # (random weights: which ids does not matter to the time)
        drafter = drafter.with_draft_vocab(np.arange(args.draft_vocab), target)
    if args.drafter_fp8:
        drafter = drafter.to_fp8()

    if "ar" in sections:
        ar = Rounds(target, drafter, make_plan(target, dcfg, "ar"), L, 4 * n, (runs + 2) * 4 * n)
        t = time.time()
        res["ar_step_ms" + key] = round(ar.ms_per_round(runs), 3)
        log(f"AR step {res['ar_step_ms' + key]} ms ({time.time() - t:.1f}s with compilation)")
        del ar
        save()

    if "prefill" in sections:
        chunk = 2048 if not args.smoke else 64

        def prefill_all():
            c = target.init_cache(4 * chunk + chunk)
            for _ in range(4):
                lg, c, _, _ = target.prefill(c, ids, chunk)
            return lg

        ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, chunk)), jnp.int32)
        t = time.time()
        jax.block_until_ready(prefill_all())
        log(f"prefill compiled+run in {time.time() - t:.1f}s")
        res["prefill_8k_s" + key] = round(median_ms(prefill_all, n=3, warmup=1) / 1e3, 3)
        log(f"prefill 8K {res['prefill_8k_s' + key]} s")
        save()

    def verify_fn(plan):
        """stage fn: tokens [1, N] -> next tokens (the argmax of the verify's logits), the cache unchanged."""
        def step(leaves, carry):
            cache, tokens, tree = carry
            model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
            tree = dataclasses.replace(tree, tokens=tokens[0])
            logits, feats, _ = loop_lib.verify_stage(model, cache, tree, tree_lib.ancestor_mask(tree), plan)
            nxt = jnp.argmax(logits, -1).astype(jnp.int32) + (feats[..., :1, 0] > 1e30).astype(jnp.int32)
            return cache, nxt, tree
        return step

    def a_tree(n_nodes, seed):
        parents = jnp.asarray(random_tree(n_nodes, 15, seed))
        depths = jnp.asarray(_depths(np.asarray(parents)), jnp.int32)
        tokens = jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, n_nodes), jnp.int32)
        return tree_lib.Tree(tokens=tokens, parents=parents, depths=depths, valid=jnp.ones((n_nodes,), bool),
                             max_depth=15)

    if "verify" in sections:
        out = res.setdefault("verify_ms" + key, {})
        plan = make_plan(target, dcfg, "ddtree", 64)
        for nn in [int(v) for v in args.verify_nodes.split(",")]:
            tree = a_tree(nn + 1, nn)
            _, S = loop_lib.capacity(target, dcfg, "ddtree", nn, L, 0)
            cache = fill_random(target.init_cache(S), jax.random.key(3)).replace(length=jnp.int32(L))
            t = time.time()
            out[str(nn + 1)] = round(loop_ms(verify_fn(plan), (cache, tree.tokens[None], tree), n, runs,
                                             target.leaves), 3)
            log(f"verify N={nn + 1}: {out[str(nn + 1)]} ms ({time.time() - t:.1f}s with compilation)")
            del cache
            save()

    if "parts" in sections:
        plan = make_plan(target, dcfg, "ddtree", 64)
        state = loop_state(target, drafter, plan, L, (runs + 2) * n * dcfg.block_size)
        embed, head = target.embedding, target.lm_head
        dparams = drafter.params

        def draft(consts, st):  # the drafter on the state's context rows + the root; next root from its argmax
            dparams, embed, head = consts
            dl, dcache = loop_lib.draft_stage(dparams, dcfg, st, embed, head, plan)
            root = draft_vocab.ids_of(dparams.vocab, jnp.argmax(dl[0]).astype(jnp.int32))[None]
            # keep the committed context where it was (each call appends ctx_n rows): the capacity is not outgrown
            dcache = dataclasses.replace(dcache, length=st.dcache.length)
            return st.replace(dcache=dcache, root=root)

        res["draft_ms" + key] = round(loop_ms(draft, state, n, runs, (dparams, embed, head)), 3)
        log(f"draft {res['draft_ms' + key]} ms")
        state = loop_state(target, drafter, plan, L, (runs + 2) * n * dcfg.block_size)
        dl0 = jax.jit(lambda dp, st, e, h: loop_lib.draft_stage(dp, dcfg, st, e, h, plan)[0])(
            dparams, state, embed, head)

        vocab = dparams.vocab  # (a draft vocabulary: dl holds its columns; its maps are small constants here)

        def build(_, carry):  # the draft logits nudged by the last tree (a data dependence; nothing hoisted)
            dl, root = carry
            tree, mask = loop_lib.tree_stage(root, dl, plan, vocab=vocab)
            nxt = tree.tokens[1] + mask[-1, 0].astype(jnp.int32)
            return dl + jnp.float32(1e-30) * nxt.astype(jnp.float32), nxt

        res["tree_build_ms" + key] = round(loop_ms(build, (dl0, jnp.int32(1)), n, runs), 3)
        log(f"tree build (budget 64) {res['tree_build_ms' + key]} ms")

        # accept + commit of a verify's outputs (fixed: computed once), the cache carried (length grows)
        tree, mask = jax.jit(lambda r, d: loop_lib.tree_stage(r, d, plan, vocab=vocab))(jnp.int32(1), dl0)
        vout = jax.jit(lambda lv, c, t, m: loop_lib.verify_stage(
            nnx.merge(gd, jax.tree.unflatten(td, lv)), c, t, m, plan))(target.leaves, state.cache, tree, mask)
        logits, feats, stashes = vout

        def accept_commit(consts, st):
            tree, mask, logits, feats, stashes = consts
            return loop_lib.commit_stage(st, st.dcache, tree, mask, logits, feats, stashes, plan)

        res["commit_ms" + key] = round(loop_ms(accept_commit, state, n, runs, (tree, mask) + tuple(vout)), 3)
        res["parts_note"] = ("draft / tree build / accept + commit: loop's stage functions, " f"{n} per jitted "
                             "fori_loop (each iteration depends on the last); verify: verify_ms['65']")
        log(f"accept + commit {res['commit_ms' + key]} ms")
        del state, vout, logits, feats, stashes
        save()

    if "round" in sections or "host" in sections:
        out = res.setdefault("round_ms" + key, {})
        budgets = [int(v) for v in args.budgets.split(",")] if "round" in sections else []
        if "host" in sections and 64 not in budgets:  # host_overhead_ms is the budget-64 round's
            budgets.append(64)
        plans = [("ddtree", b) for b in budgets] + ([("dflash", 15)] if "round" in sections else [])
        for method, budget in plans:
            rnd = Rounds(target, drafter, make_plan(target, dcfg, method, budget), L, n, (runs + 2) * n + 2 * 64)
            t = time.time()
            ms = round(rnd.ms_per_round(runs), 3)
            if method == "ddtree":
                out[str(budget)] = ms
            else:
                res["chain_round_ms" + key] = ms
            log(f"{method} round budget {budget}: {ms} ms ({time.time() - t:.1f}s with compilation)")
            if "host" in sections and method == "ddtree" and budget == 64:
                h = rnd.host_figures(calls=min(32, runs * 4))
                res["host_overhead_ms" + key] = round(max(h["back_to_back_ms_per_round"] - ms, 0.0), 3)
                res["host" + key] = {k: round(v, 3) for k, v in h.items()}
                res["host_note"] = ("round(64), one round per call: back_to_back = calls enqueued one after the "
                                    "other (blocked once) / calls; dispatch_ms = time for a call to return; "
                                    "blocking_call = one blocked call per round (how sessions 2-5 timed rounds)")
                log(f"host: {res['host' + key]} -> host_overhead_ms {res['host_overhead_ms' + key]}")
            del rnd
            save()
        ar = res.get("ar_step_ms" + key)
        verify65 = res.get("verify_ms" + key, {}).get("65")
        if verify65 and "64" in out:
            res["round_overhead_ms" + key] = round(out["64"] - verify65, 3)
        if ar:  # the goals' ratios, all from this run
            res["ratios" + key] = {k: round(v / ar, 3) for k, v in (
                ("verify65_over_ar", verify65), ("verify129_over_ar", res.get("verify_ms" + key, {}).get("129")),
                ("round64_over_ar", out.get("64")), ("chain_round_over_ar", res.get("chain_round_ms" + key)))
                if v}
            if "64" in out:
                res["round64_minus_ar_ms" + key] = round(out["64"] - ar, 3)
            if res.get("floor_ms"):
                res["ratios" + key]["floor_over_ar"] = round(res["floor_ms"] / ar, 3)
        if "64" in out:
            res["projected_tokens_per_s" + key] = {
                str(tau): round(tau / (out["64"] * 1e-3), 1) for tau in (4, 6, 6.5, 8, 10)}
            res["projection_note"] = "projected tokens/s = tau / DDTree round time at budget 64 (projection)"
        save()
    if "e2e" in sections:
        e2e(args, target, drafter, res, save, log)
        rnd64 = res.get("round_ms" + key, {}).get("64")
        dev = res["e2e"].get("ddtree64", {}).get("device_ms_per_round")
        if rnd64 and dev:
            res["round64_over_e2e_device"] = round(rnd64 / dev, 3)
        save()
    if args.contexts:
        contexts(args, res, key, target, drafter, dcfg, save, log)
    print(json.dumps(res, indent=1, sort_keys=True))


def _depths(parents: np.ndarray) -> np.ndarray:
    d = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def contexts(args, res, key, target, drafter, dcfg, save, log):
    """Issues 16 / 27's sweep over the committed context length: AR step, DDTree round (budget 64) and the rounds of
    --context-budgets (the --budget auto cost table) on the device loop (one cache capacity for all), tree attention of 65 nodes over the 16 attention
    layers' caches (a jitted loop of --rounds-per-call passes), and chunked prefill of whole prompts."""
    cfg = target.config
    ctxs = [int(v) for v in args.contexts.split(",")]
    ar, rnd, att = (res.setdefault(k + key, {}) for k in
                    ("ar_step_ms_by_context", "round_ms_by_context", "tree_attention_ms_by_context"))
    n, runs = args.rounds_per_call, args.runs
    nn = 65
    parents = jnp.asarray(random_tree(nn, 15, 1))
    mask = layout_lib.ancestor_mask(parents, jnp.ones((nn,), bool), nn - 1)[None]  # [1, T, T]
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (1, nn, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
    kn, vn = (jax.random.normal(k, (1, nn, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16) for k in ks[1:])

    budgets = [b for b in args.context_budgets.split(",") if b]
    table = res.setdefault(budget_lib.TABLE_KEY + key, {})
    auto_plan = auto_tab = None
    if args.auto_forced == "on":  # generate's tree_budget="auto" round, forced to each candidate
        cands = budget_lib.candidates_for(cfg.vocab_size, tuple(budget_lib.parse(b) for b in budgets))
        auto_plan = loop_lib.make_plan(target, dcfg, "ddtree", max(cands), budgets=cands)
        auto_tab = res.setdefault(budget_lib.AUTO_TABLE_KEY + key, {})
    # one capacity for every context (the kernels read the committed rows only): one compilation per plan
    _, S = loop_lib.capacity(target, dcfg, "ddtree", 128, max(ctxs), (runs + 2) * n * dcfg.block_size)
    for ctx in ctxs:
        cache = fill_random(target.init_cache(S), jax.random.key(3)).replace(length=jnp.int32(ctx))
        kv = tuple(c for c in cache.layers if isinstance(c, KVCache))

        def attn(kv, qq, ctx=ctx):  # every attention layer's cache; q of the next pass from the last output
            outs = [ops.tree_attention(qq, c.k, c.v, jnp.int32(ctx), kn, vn, mask, args.kernels) for c in kv]
            return qq + (sum(o[..., :1].astype(jnp.float32).sum() for o in outs) * 0).astype(qq.dtype)

        att[str(ctx)] = round(loop_ms(attn, q, n, runs, kv), 3)
        del kv
        arr = Rounds(target, drafter, make_plan(target, dcfg, "ar"), ctx, 4 * n, (runs + 2) * 4 * n, cache=cache)
        del cache
        ar[str(ctx)] = round(arr.ms_per_round(runs), 3)
        cache = arr.state.cache
        del arr
        for b in sorted(set(budgets) | {"64"}, key=lambda v: (v != "chain", int(v) if v.isdigit() else 0)):
            one = Rounds(target, drafter, plan_for(target, dcfg, b), ctx, n, (runs + 2) * n, cache=cache)
            del cache
            ms = round(one.ms_per_round(runs), 3)
            cache = one.state.cache
            del one
            if b in budgets:
                table.setdefault(b, {})[str(ctx)] = ms
            if b == "64":
                rnd[str(ctx)] = ms
        if auto_plan is not None:  # one compilation: the forcing table is data
            for b in cands:
                one = Rounds(target, drafter, auto_plan, ctx, n, (runs + 2) * n, cache=cache,
                             costs=budget_lib.padded(budget_lib.forcing(cands, b)))
                del cache
                auto_tab.setdefault(budget_lib.name(b), {})[str(ctx)] = round(one.ms_per_round(runs), 3)
                chosen = np.asarray(one.state.auto.chosen)[:int(one.state.n_rounds)]
                assert chosen.size and np.all(chosen == b), f"auto forced to {budget_lib.name(b)} chose {chosen}"
                cache = one.state.cache
                del one
        del cache
        log(f"context {ctx}: AR step {ar[str(ctx)]} ms, round(64) {rnd[str(ctx)]} ms, rounds by budget "
            f"{ {b: table.get(b, {}).get(str(ctx)) for b in budgets} }, "
            + (f"auto rounds forced to each { {b: v.get(str(ctx)) for b, v in auto_tab.items()} }, "
               if auto_plan is not None else "")
            + f"tree attention x{cfg.layer_types.count('full_attention')} {att[str(ctx)]} ms")
        save()

    # prefill: whole prompts in chunks of each --prefill-chunk into one cache sized for the longest (one compilation
    # per chunk width; the attention kernels read the committed rows only, so the capacity does not change the work)
    if args.prefill_contexts in ("", "none"):
        return
    chunks = [int(c) for c in args.prefill_chunk.split(",")]
    res["prefill_chunk_by_context"] = chunks[0]
    first = res.setdefault("prefill_s_by_context" + key, {})
    by_chunk = res.setdefault("prefill_s_by_chunk_context" + key, {})
    lengths = [int(v) for v in args.prefill_contexts.split(",")]
    for chunk in chunks:
        pre = by_chunk.setdefault(str(chunk), {})
        cache = target.init_cache(max(lengths) + chunk)
        ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, chunk)), jnp.int32)
        lg, cache, _, _ = target.prefill(cache, ids, chunk)
        jax.block_until_ready(lg)
        for length in lengths:
            cache = cache.replace(length=jnp.int32(0))
            t = time.perf_counter()
            for _ in range(-(-length // chunk)):
                lg, cache, _, _ = target.prefill(cache, ids, chunk)
            jax.block_until_ready(lg)
            pre[str(length)] = round(time.perf_counter() - t, 3)
            if chunk == chunks[0]:
                first[str(length)] = pre[str(length)]
            log(f"prefill {length} tokens (chunks of {chunk}): {pre[str(length)]} s")
            save()
        del cache, lg


if __name__ == "__main__":
    main()
