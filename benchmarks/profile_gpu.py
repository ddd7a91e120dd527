#!/usr/bin/env python
"""Where the time goes: profile the AR decode step, a verify pass and a whole DDTree round at 27B shapes, run
as `generate` runs them (bench.py's `Rounds`: --rounds-per-call steps / rounds of `loop.loop_fn` per jitted
call), and summarise the GPU kernels per step: count and time by category (GEMM, Pallas, XLA fusion, copy),
busy time vs span, the top kernels, the copies of >= 1 MB, and for the round the GPU time by part (draft, tree
build, verify, accept + commit: the round's named scopes, read from the kernels' op names in the trace, else from
the optimized HLO XLA dumps while it compiles the rounds: a kernel is named after its fusion / custom call,
`hlo_parts`; sessions 6–9 found only the tree build's scope in the trace; in session 10 the dumps named the
one-slot round's parts; the batched round's scopes read "vmap(verify)" and are matched since). The jax profiler disables command
buffers: read the gaps with care, time unprofiled. `kernel_event_stats`: the stats the kernel events carry. Each
top kernel of a round or prefill profile carries the op name of its HLO instruction ("op": which jnp line) and, for a fusion, "body": its shapes and opcodes.

    python benchmarks/profile_gpu.py --out prof.json [--kernels xla|pallas] [--context 4096]
        [--merge-into benchmarks/results/h200.json]   # adds decode/verify/round_kernels_per_step
    python benchmarks/profile_gpu.py --smoke --parts round --out /tmp/prof.json   # CPU check of the script
    python benchmarks/profile_gpu.py --parts round,slots --slots 4 --budget 63 --out prof.json
        # the pool's batched round of 4 slots (speculative/batch.py slots_fn, greedy plan, the bucket's per-slot
        # budget) next to generate's round: which part grows with the slots
    python benchmarks/profile_gpu.py --parts prefill --context 32768 --prefill-chunk 2048 --out prefill.json
        # one 2048-row prefill pass over 32K committed rows: GEMMs vs the GDN chunk kernel vs attention (issue 27)
    python benchmarks/profile_gpu.py --parts decode --decode-fusions both --out ab.json
        # A/B of the decode-step fusions (kernels "pallas" vs the variant "pallas:unfused", ops.VARIANTS) in one
        # process: unprofiled step times, both profiles ("decode" fused, "decode_unfused") and the logits of one
        # step compared bitwise
    JAX_PLATFORMS=cpu python benchmarks/profile_gpu.py --smoke --parts decode --decode-fusions both  # the script
"""
from __future__ import annotations

import argparse, collections, glob, json, os, re, sys, tempfile, time

try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import ops
from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.target import random_target
from jaxddtree.speculative.verify import verify
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import (DFLASH_27B, QWEN36_27B, SMOKE_DFLASH, SMOKE_TARGET, Rounds, fill_random, make_decode,  # noqa: E402
                   make_plan, median_ms, random_drafter, random_tree)
from jaxddtree.model.drafter_config import DrafterConfig  # noqa: E402


PALLAS_NAMES = ("gdn_tree", "tree_attention", "gdn_decode", "gdn_prefill", "decode_attention",
                "pallas")


def category(name: str) -> str:
    """Coarse kernel class: GEMMs, our Pallas kernels, XLA fusions (elementwise/reduction), copies, other."""
    n = name.lower()
    if any(p in n for p in ("nccl", "all_reduce", "allreduce", "all-reduce", "all_gather", "allgather")):
        return "collective"  # tensor parallelism (--tp): NCCL all-reduces / all-gathers
    if any(p in n for p in PALLAS_NAMES):
        return "pallas"
    if any(p in n for p in ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas", "matmul", "dot")):
        return "gemm"
    if any(p in n for p in ("memcpy", "memset", "copy")):
        return "copy"
    if any(p in n for p in ("fusion", "loop_", "input_", "reduce", "broadcast", "concatenate", "slice",
                            "transpose", "convert")):
        return "fusion"
    return "other"


def copy_bytes(ev):
    """A memcpy event's size from its stats (XLA GPU traces: `memcpy_details` = "... size:N ..."), else None."""
    for k, v in ev.stats:
        if "memcpy_details" in str(k) and "size:" in str(v):
            digits = str(v).split("size:")[1].split()[0].strip(",;")
            return int(digits) if digits.isdigit() else None
        if str(k) in ("bytes", "size", "num_bytes") and isinstance(v, int):
            return v
    return None


PARTS = ("draft", "tree_build", "verify", "accept_commit")  # loop._spec_round's named scopes


def scope_part(op_name: str) -> str | None:
    """The round part (named scope) in an XLA op name ("jit(run_rounds)/while/body/verify/...", under jax.vmap
    "jit(run_slots)/while/body/eval_jaxpr/vmap(verify)/..."), else None."""
    for p in PARTS:
        if re.search(rf"/(?:vmap\()*{p}\)*(?:/|$)", op_name):
            return p
    return None


def _norm(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]+)"')


def _hlo_map(files, value) -> dict:
    """{instruction name with '.' / '-' as '_' (as XLA names a kernel after its fusion / custom call):
    value(its op name)} over the optimized HLO text files XLA dumped (`--xla_dump_to`,
    "*after_optimizations.txt"); None values are skipped, names with different values in several modules dropped."""
    out, clash = {}, set()
    for fn in files:
        with open(fn) as f:
            for line in f:
                m = _INSTR.match(line)
                if not m or (val := value(m.group(2))) is None or (key := _norm(m.group(1))) in clash:
                    continue
                if out.setdefault(key, val) != val:
                    clash.add(key)
                    del out[key]
    return out


def hlo_parts(files) -> dict:
    """{kernel name: round part} from the dumped optimized HLO (`_hlo_map` of `scope_part`): the parts of kernels
    whose trace events carry no op name."""
    return _hlo_map(files, scope_part)


def hlo_op_names(files) -> dict:
    """{kernel name: op name (the jnp line's scope path)} from the dumped optimized HLO, for the top kernels of a
    profile (which jnp op a fusion came from)."""
    return _hlo_map(files, lambda op: op)


_COMP = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\((?:[^()]|\([^()]*\))*\)|\S+)\s+([\w\-]+)\((.*)$')
_SHAPE = re.compile(r'\b((?:pred|s8|s16|s32|s64|u8|u16|u32|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[[\d,]*\])')


def hlo_fusion_bodies(files, limit: int = 400) -> dict:
    """{fusion name (as `_hlo_map`): a one-line account of it} from the dumped optimized HLO: its result shape, its
    operands' shapes and the opcodes (with shapes) of the computation it calls, parameters left out, e.g.
    "f32[1,48,2048,128] <- (bf16[1,2048,48,128]): reduce_precision f32[1,2048,48,128], transpose f32[1,48,2048,128]"
    -- what a fusion moves, where the op name alone ("reduce_precision") does not say. Names met in several modules
    with different bodies are dropped."""
    comps, fusions = {}, {}  # computation -> [(opcode, shape)]; fusion -> (shape, operand shapes, callee)
    for fn in files:
        cur, shapes = None, {}  # instruction name -> its shapes (operands print as names)
        with open(fn) as f:
            for line in f:
                if not line.startswith((" ", "\t")) and (m := _COMP.match(line)):
                    cur = comps.setdefault(m.group(1), [])
                    continue
                if line.startswith("}"):
                    cur = None
                    continue
                m = _LINE.match(line)
                if not m:
                    continue
                name, shape, opcode, rest = m.groups()
                shapes[name] = ",".join(_SHAPE.findall(shape)) or shape
                if cur is not None and opcode != "parameter":
                    cur.append((opcode, ",".join(_SHAPE.findall(shape)) or shape))
                if opcode == "fusion" and (callee := re.search(r'calls=%?([\w.\-]+)', rest)):
                    args = rest.split(")", 1)[0]
                    args = ", ".join(_SHAPE.findall(args)) or ", ".join(
                        shapes.get(a, "?") for a in re.findall(r'%([\w.\-]+)', args))
                    fusions.setdefault(fn, {})[_norm(name)] = (shapes[name], args, callee.group(1))
    out, clash = {}, set()
    for per in fusions.values():
        for key, (shape, args, callee) in per.items():
            body = ", ".join(f"{op} {sh}" for op, sh in comps.get(callee, []))
            text = f"{shape} <- ({args}): {body}"[:limit]
            if key in clash:
                continue
            if out.setdefault(key, text) != text:
                clash.add(key)
                del out[key]
    return out


def op_of(ev, ops: dict | None) -> str | None:
    """The op name of a kernel event: an op-name stat, else the HLO instruction its name or a stat value names."""
    for _, v in ev.stats:
        if isinstance(v, str) and v.startswith("jit("):
            return v
    if ops:
        for v in [ev.name] + [v for _, v in ev.stats if isinstance(v, str)]:
            if (hit := ops.get(_norm(v))):
                return hit
    return None


def part_of(ev, names: dict | None = None) -> str | None:
    """The round part of a kernel event: the named scope in its op-name stats; else (names: `hlo_parts`) the part
    of the HLO instruction its name or a stat value names; else None."""
    for _, v in ev.stats:
        if isinstance(v, str) and "/" in v and (part := scope_part(v)):
            return part
    if names:
        for v in [ev.name] + [v for _, v in ev.stats if isinstance(v, str)]:
            hit = names.get(_norm(v))
            if hit:
                return hit
    return None


def summarise(trace_dir, n_steps, names: dict | None = None, ops: dict | None = None, bodies: dict | None = None):
    """names: `hlo_parts` of the profiled function (the parts of kernels whose events carry no op name); ops:
    `hlo_op_names` (each top kernel's op name, "op" in "top"); bodies: `hlo_fusion_bodies` ("body" in "top")."""
    from jax.profiler import ProfileData
    fn = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    pd = ProfileData.from_file(fn)
    per = collections.defaultdict(lambda: [0.0, 0])
    op_names = {}  # kernel name -> the op name of its first event that has one
    starts, ends, busy = [], [], 0.0
    big_copies = collections.Counter()
    by_part = collections.defaultdict(float)
    stat_names = collections.Counter()  # what the kernel events carry (for reading the part attribution)
    for plane in pd.planes:
        if plane.name != "/device:GPU:0":  # the first GPU (with --tp, every GPU runs the same step)
            continue
        for line in plane.lines:
            if "Stream" not in line.name and "stream" not in line.name:
                continue
            for ev in line.events:
                per[ev.name][0] += ev.duration_ns / 1e3
                per[ev.name][1] += 1
                if ev.name not in op_names and (op := op_of(ev, ops)):
                    op_names[ev.name] = op
                if category(ev.name) == "copy":
                    nbytes = copy_bytes(ev)
                    if nbytes is None or nbytes >= 1 << 20:  # unknown size counts as big: look at it
                        big_copies[f"{ev.name} ({'?' if nbytes is None else f'{nbytes / 2**20:.1f} MiB'})"] += 1
                busy += ev.duration_ns / 1e3
                by_part[part_of(ev, names) or "other"] += ev.duration_ns / 1e3
                stat_names.update(str(k) for k, _ in ev.stats)
                starts.append(ev.start_ns)
                ends.append(ev.start_ns + ev.duration_ns)
    span = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:40]
    cats = collections.defaultdict(lambda: [0.0, 0])
    for k, v in per.items():
        cats[category(k)][0] += v[0]
        cats[category(k)][1] += v[1]
    return {"kernel_busy_us_per_step": busy / n_steps, "span_us_per_step": span / n_steps,
            "gaps_us_per_step": (span - busy) / n_steps,
            "by_category": {c: {"us_per_step": round(v[0] / n_steps, 1), "kernels_per_step": v[1] / n_steps}
                            for c, v in sorted(cats.items(), key=lambda kv: -kv[1][0])},
            "kernels_per_step": sum(v[1] for v in per.values()) / n_steps,
            "gpu_us_by_part": ({k: round(v / n_steps, 1) for k, v in sorted(by_part.items())}
                               if set(by_part) - {"other"} else None),
            "copies_ge_1mb_per_step": {k: v / n_steps for k, v in big_copies.most_common(20)},
            "kernel_event_stats": dict(stat_names.most_common(12)),
            "top": [{"name": k[:120], "us_per_step": round(v[0] / n_steps, 1), "count_per_step": v[1] / n_steps,
                     **({"op": op_names[k][:200]} if k in op_names else {}),
                     **({"body": bodies[_norm(k)]} if bodies and _norm(k) in bodies else {})} for k, v in top]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="prof.json")
    ap.add_argument("--kernels", default="pallas", choices=["xla", *ops.VARIANTS],
                    help="the target's kernels: xla, pallas or one of its benchmark variants (kernels_pallas.ops)")
    ap.add_argument("--nodes", type=int, default=65, help="tree nodes of the verify pass")
    ap.add_argument("--budget", type=int, default=64, help="DDTree budget of the profiled round")
    ap.add_argument("--context", type=int, default=4096, help="committed context length")
    ap.add_argument("--parts", default="decode,verify,round", help="comma list of: decode, verify, round, slots, "
                    "prefill")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="rows of the profiled prefill pass (--parts "
                    "prefill: one chunk of a prompt continuing --context committed rows, as generate's prefill runs it)")
    ap.add_argument("--slots", type=int, default=4, help="slots of the batched round (--parts slots)")
    ap.add_argument("--slot-rows", type=int, default=128, help="the pool's verify rows (per-slot budget: "
                    "batch.bucket_budget)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism over the first N GPUs (profiles GPU 0; "
                    "NCCL kernels are the 'collective' category)")
    ap.add_argument("--merge-into", default=None,
                    help="also write <part>_kernels_per_step into this bench JSON (e.g. benchmarks/results/h200.json)")
    ap.add_argument("--decode-fusions", default="on", choices=["on", "off", "both"],
                    help="decode step with the fused gate/residual/partials/attention-prologue kernels (kernels "
                         "'pallas'; off: the benchmark variant 'pallas:unfused', ops.VARIANTS), "
                         "without, or both (A/B: 'decode' and 'decode_unfused', plus 'decode_ab')")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"], help="fp8: random fp8 target weights "
                    "(`random_target(weights='fp8')`, issue 17)")
    ap.add_argument("--allreduce", default="nccl", choices=list(sharding.ALLREDUCE_MODES),
                    help="tp > 1: how the all-reduces run (sharding.ALLREDUCE_MODES)")
    ap.add_argument("--rounds-per-call", type=int, default=8, help="decode steps / rounds per jitted call (a "
                    "profiled step is one round; the per-step figures divide by it)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (bench.py's), xla: check the script on a CPU")
    args = ap.parse_args()
    sharding.use_allreduce(args.allreduce)  # read when the backend starts
    parts = args.parts.split(",")
    dump = None
    if {"round", "slots", "prefill"} & set(parts):  # the optimized HLO: parts of kernels (hlo_parts), op names
        dump = tempfile.mkdtemp(prefix="hlo_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                                   " --xla_dump_hlo_module_re=.*(run_rounds|run_slots|_prefill).*").strip()
    raw, dflash = dict(QWEN36_27B), dict(DFLASH_27B)
    if args.smoke:
        raw.update(SMOKE_TARGET)
        dflash.update(SMOKE_DFLASH)
        args.context, args.kernels, args.rounds_per_call = 64, "xla", 2
    cfg = text_config_from_dict(raw)
    target = random_target(cfg, "bfloat16", 0, tp=args.tp, weights=args.weights)
    target.kernels = args.kernels
    gd, td = target.graphdef, target.treedef
    L, S = args.context, args.context + 1024

    def fresh_cache():
        return sharding.place(fill_random(target.init_cache(S), jax.random.key(3)).replace(length=jnp.int32(L)),
                              target.mesh)

    parents = jnp.asarray(random_tree(args.nodes, 15, 0))
    tokens = jnp.ones((1, args.nodes), jnp.int32)

    @jax.jit
    def run_verify(leaves, cache):
        model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
        lay = layout_lib.tree(cache.length, parents, cfg.linear_conv_kernel_dim, kernels=args.kernels)
        logits, feats, _ = verify(model, cache, tokens, lay, feature_layers=dflash["target_layer_ids"])
        return jnp.argmax(logits, -1), feats

    dcfg = DrafterConfig(**dflash)
    drafter = random_drafter(dcfg, jnp.bfloat16)
    drafter.params = sharding.replicate(drafter.params, target.mesh)
    R = args.rounds_per_call
    per_call = {}  # steps per call of each profiled function

    def make_decode_step(fused: bool):
        if fused:  # the default kernels: the decode step exactly as generate runs it (loop rounds)
            rounds = Rounds(target, drafter, make_plan(target, dcfg, "ar"), L, R, 20 * R)
            return lambda: rounds.call().n_out
        decode = make_decode(target, step_kernels(fused))  # A/B only: a plain step without the fusions
        holder = [jnp.ones((1, 1), jnp.int32), fresh_cache()]

        def decode_step():
            holder[0], holder[1] = decode(target.leaves, holder[1], holder[0])
            return holder[0]
        return decode_step

    def step_kernels(fused: bool) -> str:
        """The decode step's kernels: the fusions off is the benchmark variant "pallas:unfused" (ops.VARIANTS)."""
        return args.kernels if fused or args.kernels != "pallas" else "pallas:unfused"

    def decode_logits(fused: bool):
        """fp32 logits of one decode step from the same random cache (compiled with/without the fusions)."""
        @jax.jit
        def step(leaves, cache, tok):
            model = nnx.merge(gd, jax.tree.unflatten(td, leaves))
            lay = layout_lib.sequence(cache.length, 1, cfg.linear_conv_kernel_dim, kernels=step_kernels(fused))
            return model(tok, cache, lay, logits="all")[0]
        return np.asarray(step(target.leaves, fresh_cache(), jnp.full((1, 1), 7, jnp.int32)))

    steps = {}
    if "decode" in parts:
        variants = {"on": [True], "off": [False], "both": [True, False]}[args.decode_fusions]
        for fused in variants:
            name = "decode" if fused or args.decode_fusions == "off" else "decode_unfused"
            steps[name] = make_decode_step(fused)
            per_call[name] = R if fused else 1
    if "verify" in parts:
        vcache = fresh_cache()
        steps["verify"] = lambda: run_verify(target.leaves, vcache)
    if "round" in parts:
        rounds = Rounds(target, drafter, make_plan(target, dcfg, "ddtree", args.budget), L, R, 20 * R)
        steps["round"] = lambda: rounds.call().n_out
        per_call["round"] = R

    if "prefill" in parts:  # one chunk of a long prompt's prefill (Target.prefill, as loop.Prefill calls it)
        pcache = [fresh_cache() if args.prefill_chunk <= S - L else sharding.place(fill_random(
            target.init_cache(L + args.prefill_chunk), jax.random.key(3)).replace(length=jnp.int32(L)), target.mesh)]
        pids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, args.prefill_chunk)), jnp.int32)

        def prefill_chunk():
            lg, c, _, _ = target.prefill(pcache[0], pids, args.prefill_chunk)
            pcache[0] = c.replace(length=jnp.int32(L))  # the same committed rows for every profiled pass
            return lg
        steps["prefill"] = prefill_chunk

    if "slots" in parts:  # the pool's batched round: vmap of loop's per-slot round over B slots (greedy requests)
        from bench import loop_state
        from jaxddtree.speculative import batch as batch_lib
        B = args.slots
        sb = batch_lib.bucket_budget(B, args.slot_rows)
        splan = batch_lib.batch_plan(target, dcfg, "ddtree", sb)
        one = loop_state(target, drafter, splan, L, 40 * R * dcfg.block_size)
        holder = [jax.tree.map(lambda x: jnp.stack([x] * B), one).replace(budget=jnp.full((B,), sb, jnp.int32))]
        del one
        sfn = batch_lib.slots_fn(target, dcfg, splan, B, R)
        soracle = jnp.zeros((B, 1), jnp.int32)

        def slots_round():
            holder[0], prog = sfn(target.leaves, drafter.params, holder[0], soracle)
            return prog.n_out
        steps["slots"] = slots_round
        per_call["slots"] = R

    res = {"context": L, "kernels": args.kernels, "slot_count": args.slots if "slots" in parts else None, "tp": args.tp, "weights": args.weights, "allreduce": args.allreduce, "nodes": args.nodes, "budget": args.budget,
           "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
           "decode_fusions": args.decode_fusions}
    if "decode_unfused" in steps:  # A/B, unprofiled: step times (alternating blocks) and one step's logits
        ms = {"decode": [], "decode_unfused": []}
        for _ in range(3):
            for name in ms:
                ms[name].append(median_ms(steps[name], n=10 if args.smoke else 30))
        la, lb = decode_logits(True), decode_logits(False)
        res["decode_ab"] = {
            "fused_ms": round(min(ms["decode"]), 3), "unfused_ms": round(min(ms["decode_unfused"]), 3),
            "fused_ms_blocks": [round(x, 3) for x in ms["decode"]],
            "unfused_ms_blocks": [round(x, 3) for x in ms["decode_unfused"]],
            "logits_bitwise_equal": bool(np.array_equal(la, lb)),
            "logits_max_abs_diff": float(np.max(np.abs(la - lb))),
            "logits_elems_differing": int(np.sum(la != lb)),
            "argmax_equal": bool(np.array_equal(la.argmax(-1), lb.argmax(-1)))}
        print("decode_ab", json.dumps(res["decode_ab"]), flush=True)
    def dumped():
        return set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) if dump else set()

    for name, fn in steps.items():
        before = dumped()
        for _ in range(3):  # compile + warm up
            jax.block_until_ready(fn())
        new_hlo = sorted(dumped() - before)  # the modules this step compiled
        d = tempfile.mkdtemp()
        n = 5
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(n):
                jax.block_until_ready(fn())
        res[name] = summarise(d, n * per_call.get(name, 1), hlo_parts(new_hlo) if new_hlo else None,
                              hlo_op_names(new_hlo) if new_hlo else None, hlo_fusion_bodies(new_hlo) if new_hlo else None)
        res[name]["wall_ms_per_step_profiled"] = (time.perf_counter() - t) * 1e3 / (n * per_call.get(name, 1))
        res[name]["steps_per_call"] = per_call.get(name, 1)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "top"}), flush=True)
        for e in res[name]["top"][:25]:
            print("   ", e, flush=True)
    json.dump(res, open(args.out, "w"), indent=1)
    if args.merge_into:
        merged = json.load(open(args.merge_into)) if os.path.exists(args.merge_into) else {}
        suffix = "" if args.context == 4096 else f"_{args.context // 1024}k"
        for name in steps:
            merged[f"{name}_kernels_per_step{suffix}"] = res[name]["kernels_per_step"]
        json.dump(merged, open(args.merge_into, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
