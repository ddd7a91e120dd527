#!/usr/bin/env python
"""jax.jit benchmarks at Qwen3.6-27B / Qwen3.6-27B-DFlash shapes with random bf16 weights made on the GPU.

Measures (median of many runs after warm-up, one process): weight-streaming bandwidth and the floor per
token, AR decode step at a 4K context, 8K prefill, verify of N tree nodes, drafter step, tree build,
commit, full DDTree rounds at several budgets and a chain-DFlash round. Results are merged into
`--out` (default benchmarks/results/h200.json); `--sections` picks what to run.

    python benchmarks/bench.py --sections bandwidth,ar,verify,round --kernels xla
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
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

from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.speculative import loop as loop_lib
from jaxddtree.speculative import tree as tree_lib
from jaxddtree.model.cache import KVCache
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.drafter import Drafter, DrafterLayer, DrafterParams, draft_logits, init_draft_cache
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.target import random_target
from jaxddtree.speculative.verify import commit, verify

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


def make_decode(target, kernels: str):
    """Jitted greedy decode step (leaves, cache, tok [1, 1]) -> (next tok [1, 1], cache), cache donated."""
    gd, td, K = target.graphdef, target.treedef, target.config.linear_conv_kernel_dim

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def decode(leaves, cache, tok):
        model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
        lay = layout_lib.sequence(cache.length, 1, K, kernels=kernels)
        logits, cache, _, _ = model(tok, cache, lay, logits="all")
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], cache

    return decode


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


def make_round(target, drafter: Drafter, plan, cache, rounds: int = 1, runner=None):
    """A closure running `rounds` rounds of `plan` (loop.run_rounds, state donated) on a random state whose
    target cache is `cache` (committed length = cache.length) and whose drafter cache holds as many random
    context rows; returns the emitted-token count to block on. `runner`: another run_rounds (A/B timing)."""
    dcfg, cfg = drafter.config, target.config
    F, P = dcfg.num_target_features * cfg.hidden_size, dcfg.block_size
    dcache = fill_random(init_draft_cache(dcfg, 1, cache.max_len, jnp.bfloat16), jax.random.key(4))
    state = loop_lib.DecodeState(
        cache=cache, dcache=dataclasses.replace(dcache, length=jnp.copy(cache.length)), ctx=jnp.zeros((1, P, F), jnp.bfloat16),
        ctx_n=jnp.int32(1), root=jnp.ones((1,), jnp.int32), out=jnp.zeros((1, 100000 + P), jnp.int32),
        n_out=jnp.int32(1), done=jnp.asarray(False), key=jax.random.key(0), acc=jnp.zeros((100000,), jnp.int32),
        n_rounds=jnp.int32(0), stop_mask=jnp.zeros((cfg.vocab_size,), bool))
    holder = [sharding.place(state, target.mesh)]
    oracle = jnp.zeros((1,), jnp.int32)

    def one():
        holder[0] = (runner or loop_lib.run_rounds)(target.leaves, drafter.params, holder[0], oracle,
                                                    graphdef=target.graphdef, treedef=target.treedef, dcfg=dcfg,
                                                    plan=plan, rounds=rounds)
        return holder[0].n_out

    return one


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


def bench_fp8(args, cfg, dcfg: DrafterConfig, res: dict, save, log):
    """--weights fp8 (issue 17 goals), keys fp8.*: a random fp8 target (`random_target(weights="fp8")`, made
    without a bf16 copy) + the bf16 drafter + target and drafter caches for an 8K context (max_len 8192 + 256),
    then, in this order:
      fp8.ar_step_ms     greedy decode step at --context committed tokens;
      fp8.round_ms.64    DDTree round at budget 64 (same context; the decode cache freed first);
      fp8.memory_gb_in_use_peak  [in use, peak so far] after building the target, the drafter, the decode
                         step and the round (where the peak comes from);
      fp8.peak_gb        jax peak_bytes_in_use after those (model + drafter + caches + the jits' temporaries;
                         None where the backend keeps no memory stats, e.g. the CPU);
      fp8.floor_ms       bytes streamed per decode step (every target leaf but the embedding: fp8 q, fp32
                         scales, plain tails, bf16 lm_head / norms / GDN tensors) ÷ the GEMV bandwidth measured
                         now (as the bandwidth section: 4 distinct bf16 lm_head-shaped copies, XLA; measured last
                         so its 10 GB do not count in the peak), fp8.weight_stream_tb_s, fp8.weights_streamed_gb."""
    from jaxddtree.model.fp8 import FP8

    mem: dict = {}

    def memory(stage):  # (in use, peak so far) in GB after each stage: where the peak comes from
        st = jax.devices()[0].memory_stats() or {}
        if st:
            mem[stage] = [round(st.get("bytes_in_use", 0) / 1e9, 3), round(st.get("peak_bytes_in_use", 0) / 1e9, 3)]

    t0 = time.time()
    target = random_target(cfg, "bfloat16", seed=0, weights="fp8")
    target.kernels = args.kernels
    n_fp8 = sum(x.dtype == FP8 for x in target.leaves)  # the q of each Fp8Weight (a pytree: q, scale, tail)
    streamed = sum(x.size * x.dtype.itemsize for x in target.leaves) - cfg.vocab_size * cfg.hidden_size * 2
    out = res.setdefault("fp8", {})
    out["weights_streamed_gb"] = round(streamed / 1e9, 3)
    out["memory_gb_in_use_peak"] = mem
    memory("target")
    log(f"fp8 target built in {time.time() - t0:.1f}s: {n_fp8} fp8 projections, {streamed / 1e9:.2f} GB streamed/token")
    drafter = random_drafter(dcfg, jnp.bfloat16)
    memory("drafter")
    S = (8192 if not args.smoke else 256) + 256
    L = args.context

    def fresh_cache(length):
        c = fill_random(target.init_cache(S), jax.random.key(3))
        return c.replace(length=jnp.int32(length))

    decode = make_decode(target, args.kernels)
    state = [jnp.ones((1, 1), jnp.int32), fresh_cache(L)]

    def step():
        state[0], state[1] = decode(target.leaves, state[1], state[0])
        return state[0]

    t = time.time()
    jax.block_until_ready(step())
    log(f"fp8 decode compiled in {time.time() - t:.1f}s")
    out["ar_step_ms"] = round(median_ms(step, n=args.runs * 2), 3)
    log(f"fp8 AR step {out['ar_step_ms']} ms")
    memory("decode (+ its cache)")
    del state
    save()

    plan = loop_lib.Plan(method="ddtree", budget=64, max_new=100000, sampling=False, kernels=args.kernels,
                         conv_kernel=cfg.linear_conv_kernel_dim, feature_layers=dcfg.target_layer_ids)
    one = make_round(target, drafter, plan, fresh_cache(L))
    t = time.time()
    jax.block_until_ready(one())
    log(f"fp8 ddtree round (budget 64) compiled in {time.time() - t:.1f}s")
    out["round_ms"] = {"64": round(median_ms(one, n=args.runs), 3)}
    log(f"fp8 round budget 64: {out['round_ms']['64']} ms")
    memory("round (+ its caches)")
    log(f"fp8 memory (GB in use, peak so far) by stage: {mem}")
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    out["peak_gb"] = None if peak is None else round(peak / 1e9, 3)
    out["peak_note"] = (f"peak_bytes_in_use: fp8 target + bf16 drafter + target/drafter caches of {S} rows "
                        f"+ the decode / round jits' temporaries")
    log(f"fp8 peak device memory {out['peak_gb']} GB")
    del one
    save()

    d_model, cols = cfg.hidden_size, cfg.vocab_size
    Ws = [jax.random.normal(jax.random.key(10 + i), (d_model, cols), jnp.bfloat16) for i in range(4)]
    x = jax.random.normal(jax.random.key(2), (1, d_model), jnp.bfloat16)
    chain = jax.jit(lambda x, Ws: [x @ W for W in Ws])
    ms = median_ms(lambda: chain(x, Ws), n=30)
    bw = sum(W.size for W in Ws) * 2 / (ms * 1e-3) / 1e12
    del Ws
    out["weight_stream_tb_s"] = round(bw, 3)
    out["floor_ms"] = round(streamed / (bw * 1e12) * 1e3, 3)
    out["floor_over_ar"] = round(out["floor_ms"] / out["ar_step_ms"], 3)
    log(f"GEMV bandwidth {bw:.2f} TB/s: fp8 floor {out['floor_ms']} ms ({out['floor_over_ar']} of the AR step)")
    save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="bandwidth,ar,prefill,verify,parts,round",
                    help="comma list of: bandwidth, ar, prefill, verify, parts, round (default: all)")
    ap.add_argument("--kernels", default=None, choices=["xla", "pallas"],
                    help="kernel path (default: pallas on a GPU, else xla); keys of a non-default path get a suffix")
    ap.add_argument("--context", type=int, default=4096, help="committed context length for decode/verify")
    ap.add_argument("--verify-nodes", default="16,32,64,128,256", help="N (non-root) for the verify sweep")
    ap.add_argument("--budgets", default="16,64,256", help="DDTree budgets for the round timings")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per measurement (median reported)")
    ap.add_argument("--out", default="benchmarks/results/h200.json", help="JSON file to merge results into")
    ap.add_argument("--config", default=None, help="HF config.json for other target shapes")
    ap.add_argument("--contexts", default="",
                    help="comma list of context lengths (e.g. 4096,32768,131072): AR step, DDTree round (budget 64) "
                         "and tree attention (16 layers, 65 nodes) at each, prefill of --prefill-contexts "
                         "(*_by_context keys)")
    ap.add_argument("--prefill-contexts", default="8192,32768,131072",
                    help="prompt lengths timed for prefill_s_by_context (with --contexts)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="rows per prefill call in the context sweep")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallelism over the first N GPUs; the results go "
                    "into the tp<N> object of --out (tp_ratios compares tp1 and tp2 when both are there)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few runs: check the script on a CPU")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"],
                    help="fp8: random fp8 target weights (issue 17); writes only the fp8.* keys (see bench_fp8)")
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
        args.runs, args.context = 3, 64
        if args.contexts:
            args.contexts, args.prefill_contexts, args.prefill_chunk = "64,192", "64,128", 32
    cfg = text_config_from_dict(raw, where=args.config or "built-in Qwen3.6-27B shapes")
    dev = jax.devices()[0]
    res = top = {}
    if os.path.exists(args.out):
        res = top = json.load(open(args.out))
    if args.tp is not None:
        res = top.setdefault(f"tp{args.tp}" + ("" if args.allreduce == "nccl" else f"_{args.allreduce}"), {})
        res["allreduce"] = args.allreduce
    tp = args.tp or 1
    default_kernels = "pallas" if dev.platform == "gpu" else "xla"
    args.kernels = args.kernels or default_kernels
    key = "" if args.kernels == default_kernels else f"_{args.kernels}"
    res["kernels"] = f"{default_kernels} (default here); keys ending in _xla/_pallas: the other path"
    res.update({"device": dev.device_kind, "date": datetime.date.today().isoformat(), "jax": jax.__version__})

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
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

    if args.weights == "fp8":
        bench_fp8(args, cfg, DrafterConfig(**dflash), res, save, log)
        print(json.dumps(res, indent=1, sort_keys=True))
        return

    if "bandwidth" in sections:
        # the largest GEMV of a decode step (the lm_head shape, 2.54 GB), over 4 distinct copies in ONE jit
        # (nothing stays in L2, one dispatch): the best weight-streaming rate XLA reaches on this GPU
        cols = raw.get("text_config", raw)["vocab_size"] if not args.smoke else 512
        d_model = raw.get("text_config", raw)["hidden_size"]
        Ws = [jax.random.normal(jax.random.key(10 + i), (d_model, cols), jnp.bfloat16) for i in range(4)]
        x = jax.random.normal(jax.random.key(2), (1, d_model), jnp.bfloat16)
        chain = jax.jit(lambda x, Ws: [x @ W for W in Ws])
        ms = median_ms(lambda: chain(x, Ws), n=30)
        bw = sum(W.size for W in Ws) * 2 / (ms * 1e-3) / 1e12
        res["weight_stream_tb_s"] = round(bw, 3)
        res["weight_stream_note"] = f"x[1,{d_model}] @ w[{d_model},{cols}] bf16 (XLA), 4 distinct copies in one jit"
        del Ws
        log(f"GEMV bandwidth {bw:.2f} TB/s")
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
    L = args.context
    S = L + (8192 if not args.smoke else 512) + 512

    def fresh_cache(length):
        c = fill_random(target.init_cache(S), jax.random.key(3))
        return sharding.place(c.replace(length=jnp.int32(length)), target.mesh)

    if "ar" in sections:
        decode = make_decode(target, args.kernels)
        cache = fresh_cache(L)
        tok = jnp.ones((1, 1), jnp.int32)
        t = time.time()
        tok, cache = decode(target.leaves, cache, tok)
        jax.block_until_ready(tok)
        log(f"decode compiled in {time.time() - t:.1f}s")
        state = [tok, cache]

        def step():
            state[0], state[1] = decode(target.leaves, state[1], state[0])
            return state[0]

        res["ar_step_ms" + key] = round(median_ms(step, n=args.runs * 2), 3)
        log(f"AR step {res['ar_step_ms' + key]} ms")
        del state, cache
        save()

    if "prefill" in sections:
        chunk = 2048 if not args.smoke else 64
        cache = target.init_cache(4 * chunk + chunk)
        ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, chunk)), jnp.int32)

        def prefill_all():
            c = target.init_cache(4 * chunk + chunk)
            for _ in range(4):
                lg, c, _, _ = target.prefill(c, ids, chunk)
            return lg

        t = time.time()
        jax.block_until_ready(prefill_all())
        log(f"prefill compiled+run in {time.time() - t:.1f}s")
        res["prefill_8k_s" + key] = round(median_ms(prefill_all, n=3, warmup=1) / 1e3, 3)
        log(f"prefill 8K {res['prefill_8k_s' + key]} s")
        del cache
        save()

    if "verify" in sections:
        @jax.jit
        def run_verify(leaves, cache, tokens, parents):
            model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
            lay = layout_lib.tree(cache.length, parents, cfg.linear_conv_kernel_dim, kernels=args.kernels)
            logits, feats, stashes = verify(model, cache, tokens, lay, feature_layers=dflash["target_layer_ids"])
            return jnp.argmax(logits, -1), feats

        cache = fresh_cache(L)
        out = res.setdefault("verify_ms" + key, {})
        for n in [int(v) for v in args.verify_nodes.split(",")]:
            parents = jnp.asarray(random_tree(n + 1, 15, n))
            tokens = jnp.asarray(np.random.RandomState(n).randint(0, cfg.vocab_size, (1, n + 1)), jnp.int32)
            t = time.time()
            jax.block_until_ready(run_verify(target.leaves, cache, tokens, parents))
            log(f"verify N={n + 1} compiled in {time.time() - t:.1f}s")
            out[str(n + 1)] = round(median_ms(lambda: run_verify(target.leaves, cache, tokens, parents),
                                              n=args.runs), 3)
            log(f"verify N={n + 1}: {out[str(n + 1)]} ms")
            save()
        del cache

    dcfg = DrafterConfig(**dflash)
    drafter = random_drafter(dcfg, jnp.bfloat16)
    drafter.params = sharding.replicate(drafter.params, target.mesh)

    if "parts" in sections:
        dcache = fill_random(init_draft_cache(dcfg, 1, S, jnp.bfloat16), jax.random.key(4))
        dcache = dataclasses.replace(dcache, length=jnp.int32(L))
        F = dcfg.num_target_features * cfg.hidden_size
        ctx = jax.random.normal(jax.random.key(5), (1, dcfg.block_size, F), jnp.bfloat16)
        embed, head = target.embedding, target.lm_head

        @jax.jit  # embed / head are arguments: closed over, they would be 2.5 GB constants in the HLO
        def draft(dp, dc, ctx, embed, head):
            lg, _ = draft_logits(dp, dcfg, dc, ctx, jnp.int32(8), jnp.ones((1,), jnp.int32), embed, head,
                                 args.kernels)
            return lg

        t = time.time()
        jax.block_until_ready(draft(drafter.params, dcache, ctx, embed, head))
        log(f"draft compiled in {time.time() - t:.1f}s")
        res["draft_ms" + key] = round(median_ms(lambda: draft(drafter.params, dcache, ctx, embed, head),
                                                n=args.runs), 3)
        log(f"draft {res['draft_ms' + key]} ms")
        dl = draft(drafter.params, dcache, ctx, embed, head)[0]
        # tree build and commit with and without their Pallas kernels (A/B in one run; the defaults are
        # ops.PALLAS_TREE_SELECT / PALLAS_GDN_COMMIT): "_xla" / "_pallas" keys for the non-default variant
        paths = ["pallas", "xla"] if dev.platform == "gpu" else [args.kernels]
        default_variant = "pallas" if args.kernels == "pallas" and ops.PALLAS_GDN_COMMIT else "xla"
        suffix = {kp: "" if kp == default_variant else f"_{kp}" for kp in paths}

        def with_kernels(kp, fn):  # trace fn with the Pallas tree/commit kernels on (kp == "pallas") or off
            flags = ops.PALLAS_TREE_SELECT, ops.PALLAS_GDN_COMMIT
            ops.PALLAS_TREE_SELECT = ops.PALLAS_GDN_COMMIT = kp == "pallas"
            try:
                return jax.block_until_ready(fn())
            finally:
                ops.PALLAS_TREE_SELECT, ops.PALLAS_GDN_COMMIT = flags

        for kp in paths:
            build = jax.jit(lambda r, d, kp=kp: tree_lib.build_tree(r, d, 64, kernels=args.kernels))
            with_kernels(kp, lambda: build(jnp.int32(1), dl))
            jax.block_until_ready(build(jnp.int32(1), dl))
            res["tree_build_ms" + suffix[kp]] = round(median_ms(lambda: build(jnp.int32(1), dl), n=args.runs), 3)
            log(f"tree build (budget 64, {kp}) {res['tree_build_ms' + suffix[kp]]} ms")

        cache = fresh_cache(L)
        parents = jnp.asarray(random_tree(65, 15, 1))
        tokens = jnp.ones((1, 65), jnp.int32)

        @jax.jit
        def stashes_of(leaves, cache):
            model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
            lay = layout_lib.tree(cache.length, parents, cfg.linear_conv_kernel_dim, kernels=args.kernels)
            return verify(model, cache, tokens, lay)[2]

        st = stashes_of(target.leaves, cache)
        path = jnp.asarray([[0] + [int(i) for i in np.nonzero(np.asarray(parents) == 0)[0][:1]] + [0] * 14], jnp.int32)
        # the cache is donated, as in the round (otherwise every call copies the whole ~1 GB cache)
        held = [cache]
        for kp in paths:
            do_commit = jax.jit(lambda c, s, kp=kp: commit(c, s, path, jnp.asarray([2], jnp.int32),
                                                             kernels=args.kernels, mesh=target.mesh),
                                donate_argnums=0)

            def commit_once():
                held[0] = do_commit(held[0], st)
                return held[0].length

            with_kernels(kp, commit_once)
            res["commit_ms" + suffix[kp]] = round(median_ms(commit_once, n=args.runs), 3)
            log(f"commit ({kp}) {res['commit_ms' + suffix[kp]]} ms")
        del held, st, dcache
        save()

    if "round" in sections:
        out = res.setdefault("round_ms" + key, {})
        plans = [("ddtree", b) for b in [int(v) for v in args.budgets.split(",")]] + [("dflash", 15)]
        for method, budget in plans:
            plan = loop_lib.Plan(method=method, budget=budget, max_new=100000, sampling=False,
                                 kernels=args.kernels, conv_kernel=cfg.linear_conv_kernel_dim,
                                 feature_layers=dcfg.target_layer_ids, mesh=target.mesh)
            one = make_round(target, drafter, plan, fresh_cache(L))
            t = time.time()
            jax.block_until_ready(one())
            log(f"{method} round (budget {budget}) compiled in {time.time() - t:.1f}s")
            ms = round(median_ms(one, n=args.runs), 3)
            if method == "ddtree":
                out[str(budget)] = ms
            else:
                res["chain_round_ms" + key] = ms
            log(f"{method} round budget {budget}: {ms} ms")
            del one
            save()
        ar = res.get("ar_step_ms" + key)
        verify65 = res.get("verify_ms" + key, {}).get("65")
        if verify65 and "64" in out:
            res["round_overhead_ms" + key] = round(out["64"] - verify65, 3)
            log(f"round overhead (round 64 - verify 65): {res['round_overhead_ms' + key]} ms")
        if ar:  # the goals' ratios, all from this run
            res["ratios" + key] = {k: round(v / ar, 3) for k, v in (
                ("verify65_over_ar", verify65), ("verify129_over_ar", res.get("verify_ms" + key, {}).get("129")),
                ("round64_over_ar", out.get("64")), ("chain_round_over_ar", res.get("chain_round_ms" + key)))
                if v}
            if res.get("floor_ms"):
                res["ratios" + key]["floor_over_ar"] = round(res["floor_ms"] / ar, 3)
        if ar and "64" in out:
            res["projected_tokens_per_s" + key] = {
                str(tau): round(tau / (out["64"] * 1e-3), 1) for tau in (4, 6, 8, 10)}
            res["projection_note"] = "projected tokens/s = tau / DDTree round time at budget 64 (projection)"
        save()
    if args.contexts:
        contexts(args, res, key, target, drafter, dcfg, save, log)
    print(json.dumps(res, indent=1, sort_keys=True))


def contexts(args, res, key, target, drafter, dcfg, save, log):
    """Issue 16's sweep over the committed context length: AR step, DDTree round (budget 64), tree attention of
    65 nodes over the 16 attention layers' caches (one jit), and chunked prefill of whole prompts."""
    cfg = target.config
    ctxs = [int(v) for v in args.contexts.split(",")]
    slack = 8192 if not args.smoke else 64
    ar, rnd, att = (res.setdefault(k + key, {}) for k in
                    ("ar_step_ms_by_context", "round_ms_by_context", "tree_attention_ms_by_context"))
    decode = make_decode(target, args.kernels)
    plan = loop_lib.Plan(method="ddtree", budget=64, max_new=100000, sampling=False, kernels=args.kernels,
                         conv_kernel=cfg.linear_conv_kernel_dim, feature_layers=dcfg.target_layer_ids)
    n = 65
    parents = jnp.asarray(random_tree(n, 15, 1))
    mask = layout_lib.ancestor_mask(parents, jnp.ones((n,), bool), n - 1)[None]  # [1, T, T]
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (1, n, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
    kn, vn = (jax.random.normal(k, (1, n, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16) for k in ks[1:])

    @jax.jit
    def tree_attn(kv, start):  # every attention layer's cache, one jit
        return [ops.tree_attention(q, c.k, c.v, start, kn, vn, mask, args.kernels) for c in kv]

    S = max(ctxs) + slack  # one capacity for all: one compilation each (the kernels read the committed rows only)
    for ctx in ctxs:
        cache = fill_random(target.init_cache(S), jax.random.key(3)).replace(length=jnp.int32(ctx))
        kv = [c for c in cache.layers if isinstance(c, KVCache)]
        jax.block_until_ready(tree_attn(kv, jnp.int32(ctx)))
        att[str(ctx)] = round(median_ms(lambda: tree_attn(kv, jnp.int32(ctx)), n=args.runs), 3)
        del kv
        state = [jnp.ones((1, 1), jnp.int32), cache]

        def step():
            state[0], state[1] = decode(target.leaves, state[1], state[0])
            return state[0]

        jax.block_until_ready(step())
        ar[str(ctx)] = round(median_ms(step, n=args.runs), 3)
        cache = state[1].replace(length=jnp.int32(ctx))
        del state
        one = make_round(target, drafter, plan, cache)
        jax.block_until_ready(one())
        rnd[str(ctx)] = round(median_ms(one, n=args.runs), 3)
        del one, cache
        log(f"context {ctx}: AR step {ar[str(ctx)]} ms, round(64) {rnd[str(ctx)]} ms, "
            f"tree attention x{cfg.layer_types.count('full_attention')} {att[str(ctx)]} ms")
        save()

    # prefill: whole prompts in chunks of --prefill-chunk into one cache sized for the longest (one compilation;
    # the attention kernels read the committed rows only, so the capacity does not change the work)
    pre = res.setdefault("prefill_s_by_context" + key, {})
    chunk = args.prefill_chunk
    res["prefill_chunk_by_context"] = chunk
    lengths = [int(v) for v in args.prefill_contexts.split(",")]
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
        log(f"prefill {length} tokens (chunks of {chunk}): {pre[str(length)]} s")
        save()
    del cache


if __name__ == "__main__":
    main()
