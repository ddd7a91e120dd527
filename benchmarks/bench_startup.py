#!/usr/bin/env python
"""Start-up benchmark (issue 40): how long until the model answers.

    python benchmarks/bench_startup.py --layers 8,64 [--out FILE]   # first generate() call's time, tiny models
    python benchmarks/bench_startup.py --random-27b --compile-cache DIR [--out FILE]   # GPU: generate.py's path

--layers: tiny random targets (hidden 64, the 27B's repeating 3 GDN + 1 attention pattern) of each depth with a
random drafter; for each method (ar, ddtree) the first `generate` call (compilation included: the programs are
compiled once per model) and a second one (what remains: running), without a persistent compilation cache. Each
depth runs in fresh processes of its own (--repeats of them, alternating the depths' order; medians): in one
process the first depth measured paid the process's own first compilations, which moved the ratio 0.92-1.26 with
the order (2-core VM, 2026-12-08). The goal is the depth ratio of the first call, 64 / 8 layers ≤ 1.25 (one scanned
layer group, not every layer, is compiled).
--random-27b: scripts/generate.py's path at 27B shapes (random bf16 weights made on the device instead of a
checkpoint read: the load is not timed), from this process's start: imports, the pair (while it is made, the
warm-up's programs compile for its shapes, as generate.py compiles them while a checkpoint loads; --no-precompile:
neither that nor the side-by-side compile), generate.py's warm-up call (the same programs: every token a stop id,
so no round runs: the rounds go on compiling in the background) and its real call (ddtree, --budget auto, a
64-token prompt, loop "host"): the first token streamed (the prefill's), the second (the first round's, once the
rounds are compiled); with an empty --compile-cache DIR it is the cold start.
At 27B shapes, bench.py prints each program's first call with compilation ("AR step ... (8.3s with compilation)").
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # (before the imports: they are part of the start)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tiny_pair(layers: int, dtype="float32"):
    import dataclasses
    import jax.numpy as jnp
    from jaxddtree.checkpoint import builtin
    from jaxddtree.model.config import ATTENTION, GDN
    from jaxddtree.model.drafter import Drafter
    from jaxddtree.model.target import random_target

    cfg = dataclasses.replace(builtin.target_config(), num_hidden_layers=layers,
                              layer_types=tuple(ATTENTION if (i + 1) % 4 == 0 else GDN for i in range(layers)))
    target = random_target(cfg, dtype)
    dcfg = dataclasses.replace(builtin.drafter_config(), num_target_layers=layers,
                               target_layer_ids=(1, layers - 1))
    drafter = Drafter(config=dcfg, params=builtin.random_drafter_params(dcfg, jnp.float32, 1), path="builtin")
    return target, drafter


def first_calls(target, drafter, prompt_len=40, new=24):
    import numpy as np
    from jaxddtree.speculative.loop import generate

    ids = np.arange(1, prompt_len + 1) % 200
    out = {}
    for method, kw in (("ar", {}), ("ddtree", dict(drafter=drafter, tree_budget=16))):
        for call in ("first", "second"):
            t = time.perf_counter()
            generate(target, ids, method=method, max_new_tokens=new, loop="device", **kw)
            out[f"{method}_{call}_s"] = round(time.perf_counter() - t, 3)
    return out


def random_27b_first_token(cache_dir: str | None, smoke: bool = False, prompt_len: int = 64, new: int = 32,
                           precompile: bool = True) -> dict:
    """generate.py's start at 27B shapes (module docstring) -> seconds from the process start per stage."""
    import numpy as np
    from jaxddtree import compile_cache
    import jaxddtree as jd
    from jaxddtree.model.prefill import warmup_length
    from jaxddtree.speculative.loop import cache_positions
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench

    out = {"imports_s": time.perf_counter() - T_START}
    out["compile_cache"] = compile_cache.enable(cache_dir if cache_dir is not None else "none", "bench_startup.py")
    cfg, dcfg, dtype = bench.pair_configs(smoke)
    ids = np.random.default_rng(0).integers(cfg.vocab_size // 4, cfg.vocab_size, prompt_len)
    probe = ids[:warmup_length(len(ids))]
    early = None
    if precompile:  # as generate.py: the warm-up's programs compiled (for the pair's shapes) while the pair is made
        import threading

        import jax.numpy as jnp
        from jaxddtree.model.drafter import Drafter, abstract_params
        from jaxddtree.model.target import abstract_target
        from jaxddtree.speculative.loop import compile_call
        at = abstract_target(cfg, dtype)
        at.kernels = bench.kernels_here()
        ad = Drafter(config=dcfg, params=abstract_params(dcfg, jnp.dtype(dtype)), path="abstract")
        akw = dict(drafter=ad, method="ddtree", max_new_tokens=new, tree_budget="auto", loop="host",
                   cache_len=cache_positions(at, ad, "ddtree", "auto", len(ids), new))
        early = threading.Thread(target=compile_call, args=(at, probe), kwargs=dict(akw, stop_ids=range(cfg.vocab_size)),
                                 name="precompile-early", daemon=True)
        early.start()
    target, drafter = bench.random_pair(smoke)
    import jax
    jax.block_until_ready(jax.tree.leaves(target.leaves)[:1])
    out["pair_s"] = time.perf_counter() - T_START
    cache_len = cache_positions(target, drafter, "ddtree", "auto", len(ids), new)
    kw = dict(drafter=drafter, method="ddtree", max_new_tokens=new, tree_budget="auto", loop="host",
              cache_len=cache_len, precompile=precompile)
    out["precompile"] = precompile
    if early is not None:
        early.join()
        out["early_compile_done_s"] = time.perf_counter() - T_START
    jd.generate(target, probe, **kw, stop_ids=range(target.config.vocab_size))
    out["warmup_done_s"] = time.perf_counter() - T_START
    seen = []  # when each streamed piece came: the prefill's token, then the first round's (once compiled)
    g = jd.generate(target, ids, **kw, on_tokens=lambda t: seen.append(time.perf_counter() - T_START))
    out["first_token_s"] = seen[0]
    out["second_token_s"] = seen[1] if len(seen) > 1 else None
    out["done_s"] = time.perf_counter() - T_START
    out["tokens"] = len(g.tokens)
    out["token_ids"] = g.tokens  # (a cold and a warm start give the same: the same programs, compiled or loaded)
    out["compile_wait_s"] = g.stats["compile_wait_s"]  # the first round's wait for its program
    from jaxddtree.speculative import precompile as precompile_lib
    out = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
    out["slowest_programs"] = precompile_lib.slowest(since=T_START)  # the compile's critical path
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="8,64", help="tiny model depths (CPU mode; each in fresh processes)")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per depth (CPU mode; medians)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--random-27b", action="store_true", help="generate.py's start at 27B shapes (GPU)")
    p.add_argument("--compile-cache", default=None, metavar="DIR", help="--random-27b: the persistent compilation "
                   "cache (an empty directory: a cold start; default: none)")
    p.add_argument("--smoke", action="store_true", help="--random-27b at bench.py's tiny shapes (checks the script)")
    p.add_argument("--no-precompile", action="store_true", help="--random-27b: each program compiled at its first "
                   "call, in turn (the A/B of `speculative.precompile`)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        depths = [int(x) for x in args.layers.split(",")]
    except ValueError:
        p.error(f"--layers takes comma-separated integers, not '{args.layers}'")
    if min(depths) < 2:
        p.error("--layers: every depth must be at least 2 (the drafter taps layers 1 and depth - 1)")
    if args.random_27b:
        res = random_27b_first_token(args.compile_cache, args.smoke, precompile=not args.no_precompile)
        import jax
        res.update(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind)
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
    if len(depths) == 1 and os.environ.get("_BENCH_STARTUP_CHILD"):  # one depth, this process (a child run)
        target, drafter = tiny_pair(depths[0])
        print(json.dumps(first_calls(target, drafter)), flush=True)
        return 0
    import jax
    res = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "depths": {},
           "repeats": args.repeats}
    runs = {n: [] for n in depths}
    env = dict(os.environ, _BENCH_STARTUP_CHILD="1")
    for r in range(args.repeats):
        for n in (depths if r % 2 == 0 else depths[::-1]):
            p_ = subprocess.run([sys.executable, os.path.abspath(__file__), "--layers", str(n)], env=env,
                                capture_output=True, text=True)
            if p_.returncode != 0:
                errs = [ln for ln in p_.stderr.splitlines()  # the exception's line, not jax's traceback note
                        if ln and not ln[0].isspace() and not ln.startswith(("-", "For simplicity"))]
                last = (errs or [f"exit code {p_.returncode}"])[-1]
                print(f"error: the {n}-layer run failed: {last}", file=sys.stderr)
                return 1
            runs[n].append(json.loads(p_.stdout.strip().splitlines()[-1]))
            print(n, runs[n][-1], flush=True)
    for n in depths:
        res["depths"][str(n)] = {k: round(statistics.median(x[k] for x in runs[n]), 3) for k in runs[n][0]}
    d = res["depths"]
    if len(d) >= 2:
        lo, hi = d[min(d, key=int)], d[max(d, key=int)]
        res["ratio"] = {m: round(hi[f"{m}_first_s"] / lo[f"{m}_first_s"], 3) for m in ("ar", "ddtree")}
        print("first-call ratio deepest / shallowest:", res["ratio"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
