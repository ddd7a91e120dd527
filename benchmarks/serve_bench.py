#!/usr/bin/env python
"""Serving benchmark: time to first token and tokens/s for 1, 4 and 16 concurrent streaming clients against the
OpenAI-compatible server (scripts/serve.py, continuous batching over --max-batch slots), run in this process on a
free 127.0.0.1 port.

    python benchmarks/serve_bench.py                        # the demo pair (CPU is fine)
    python benchmarks/serve_bench.py --target DIR --drafter DDIR --clients 1 4 16 --max-tokens 256
    python benchmarks/serve_bench.py --random-27b --max-batch 16 --prompt-tokens 512 --out FILE  # GPU: 27B shapes
    python benchmarks/serve_bench.py --smoke --out FILE     # CPU: the demo pair, tiny levels (checks the script)
    python benchmarks/serve_bench.py --random-27b --warmup-only --max-batch 16 --max-context 8192 \
        --compile-cache DIR --out FILE   # GPU: scripts/serve.py's start (its full warm-up), nothing served

Each client sends one streamed completion (temperature 0, a distinct prompt of the same length: --prompt-tokens,
else a short one); TTFT is measured from sending the request to the first content delta, so it includes the time
spent waiting for a slot (queue) and the prefill. Aggregate tokens/s = all completion tokens / wall time. Per level
the responses' `speculative` fields give the budget per slot (the tree budget most of each request's rounds used,
counted over the requests; rounds per budget summed) and the most requests batched together.

With --random-27b the pair has random weights (a random drafter's tokens are almost never accepted: about one
token per round), so the figures measure the server + round time at 27B shapes, not DDTree's speed-up; every
token id decodes to one printable character so that each round emits text.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # (before the imports: --warmup-only times the start from here)

import argparse
import asyncio
import collections
import functools
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_module():
    spec = importlib.util.spec_from_file_location("serve_script", os.path.join(ROOT, "scripts", "serve.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def one(client, model, prompt, max_tokens, chat=True):
    t0 = time.perf_counter()
    ttft, usage, spec = None, None, None
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    if chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    async for chunk in stream:
        text = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) if chunk.choices else None
        if text and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
        if (chunk.model_extra or {}).get("speculative"):
            spec = chunk.model_extra["speculative"]
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "tokens": usage.completion_tokens, "spec": spec}


def prompt_text(i: int, n_tokens: int, tokenizer=None) -> str:
    """Client i's prompt: distinct per client; with n_tokens (and the server's tokenizer) padded with code lines
    to about n_tokens tokens (exactly for a byte tokenizer)."""
    head = f"def function_{i:02d}(x):"
    if not n_tokens:
        return head
    from jaxddtree.text import encode_text
    text, k = head, 0
    while len(encode_text(tokenizer, text)) < n_tokens:
        text += f"\n    y{k} = x * {k} + {i}"
        k += 1
    while len(encode_text(tokenizer, text)) > n_tokens and len(text) > len(head):
        text = text[:-1]
    return text


def percentile(values, q: float) -> float:
    """The nearest-rank q-th percentile of values (q in [0, 100])."""
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


async def level(base, model, clients, max_tokens, chat=True, prompt_tokens=0, tokenizer=None):
    import openai
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=3600)
    prompts = [prompt_text(i, prompt_tokens, tokenizer) for i in range(clients)]
    t0 = time.perf_counter()
    try:
        runs = await asyncio.gather(*(one(client, model, p, max_tokens, chat) for p in prompts))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in runs if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in runs)
    specs = [r["spec"] or {} for r in runs]
    budgets = collections.Counter(str(s.get("tree_budget")) for s in specs)
    rounds = collections.Counter()
    for s in specs:
        rounds.update(s.get("tree_budget_rounds") or {})
    return {"clients": clients, "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(ttfts), "ttft_p90_s": percentile(ttfts, 90), "ttft_max_s": ttfts[-1],
            "per_request_tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
            "budget_per_slot": dict(budgets), "budget_rounds": dict(rounds),
            "batch_max": max((s.get("batch", 1) for s in specs), default=1),
            "mean_acceptance_length": statistics.median(s.get("mean_acceptance_length", 0.0) for s in specs)}


def random_27b_engine(args, serve):
    """An Engine over random Qwen3.6-27B / DFlash-shaped bf16 weights (benchmarks/bench.py's shapes)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    sys.path.insert(0, ROOT)
    import bench
    from jaxddtree.checkpoint.builtin import ByteTokenizer
    from jaxddtree.serving import Engine
    from jaxddtree.speculative.batch import SlotPool
    from jaxddtree.text import encode_text

    class PrintableTokenizer(ByteTokenizer):
        def decode(self, ids, **_) -> str:
            return "".join(chr(32 + int(i) % 95) for i in ids)
    tok = PrintableTokenizer()

    from jaxddtree import compile_cache  # as serve.py: reuse compilations across runs
    compile_cache.enable(args.compile_cache, "serve_bench.py")
    args.max_context = args.max_context or 8192
    early = None
    if args.warmup_only and not args.no_precompile:  # as serve.py: the single-slot programs while the pair is made
        import jax
        cfg, dcfg, dtype = bench.pair_configs(args.smoke)
        early = serve.compile_while_loading(args, cfg, dcfg, dtype, jax.default_backend(), None,
                                            encode_text(tok, "Hello"))
    target, drafter = bench.random_pair(args.smoke, args.kernels)
    engine = Engine(target, drafter, tok, name="random-27b", method=args.method or "ddtree", budget=args.budget,
                    max_context=args.max_context, queue_size=args.queue,
                    default_max_tokens=args.default_max_tokens, max_batch=args.max_batch,
                    prefill_tokens=args.prefill_tokens,
                    pool_factory=functools.partial(SlotPool, precompile=False) if args.no_precompile else None)
    t = time.perf_counter()
    from jaxddtree.serving.engine import warmup_printer
    if args.warmup_only:  # serve.py's own warm-up (every prefill width, sampling too), timed from the start
        engine.warmup(encode_text(tok, "Hello"), progress=warmup_printer("serve_bench.py"))
        if early is not None:
            early.join()
        from jaxddtree.speculative import precompile as precompile_lib
        engine.startup = {"pair_s": round(t - T_START, 2), "warmup_s": round(time.perf_counter() - t, 2),
                          "serve_ready_s": round(time.perf_counter() - T_START, 2),
                          "cpu_s": round(time.process_time(), 1), "cores": os.cpu_count(),
                          "slowest_programs": precompile_lib.slowest(since=T_START)}
        return engine
    # this benchmark sends temperature 0 only, and its clients' prompts: only their prefill widths are compiled
    lengths = [len(encode_text(tok, prompt_text(i, args.prompt_tokens, tok))) for i in range(max(args.clients))]
    engine.warmup(encode_text(tok, "Hello"), progress=warmup_printer("serve_bench.py"),
                  lengths=lengths)
    print(f"serve_bench.py: random 27B pair compiled in {time.perf_counter() - t:.1f} s", flush=True)
    return engine


def generate_same(engine, max_tokens: int, chat: bool, prompt_tokens: int = 0) -> dict:
    """`jaxddtree.generate(loop="device")` on the 1-client level's request (same prompt ids, pair, method, budget,
    caches, stop ids, max_tokens, temperature 0), in this process: tokens_per_s (decode only, generate's own
    figure) and e2e_tokens_per_s (completion tokens / (time to first token + decode), what a client waits)."""
    import jaxddtree
    from jaxddtree.text import encode_chat, encode_text, ensure_chat_template
    prompt = prompt_text(0, prompt_tokens, engine.tokenizer)
    if chat:
        ensure_chat_template(engine.tokenizer)
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = encode_text(engine.tokenizer, prompt)
    kw = dict(drafter=engine.drafter if engine.method != "ar" else None, method=engine.method,
              tree_budget=engine.budget, max_new_tokens=max_tokens, stop_ids=engine.stop_ids,
              cache_len=engine.cache_len, loop="device")
    jaxddtree.generate(engine.target, ids, **kw)  # warm (compiled by the server already)
    runs = [jaxddtree.generate(engine.target, ids, **kw) for _ in range(3)]
    g = sorted(runs, key=lambda r: r.stats["decode_s"])[1]  # the median run
    st = g.stats
    return {"tokens": st["new_tokens"], "rounds": st["rounds"], "tokens_per_s": round(st["tokens_per_s"], 2),
            "e2e_tokens_per_s": round(st["new_tokens"] / (st["time_to_first_token_s"] + st["decode_s"]), 2),
            "ttft_s": round(st["time_to_first_token_s"], 4), "decode_s": round(st["decode_s"], 4)}


def main(argv=None) -> int:
    if ROOT not in sys.path:  # this checkout's jaxddtree, installed or not
        sys.path.insert(0, ROOT)
    serve = serve_module()
    p = serve.build_parser()
    p.prog = "serve_bench.py"
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--random-27b", action="store_true", help="random weights of the Qwen3.6-27B + DFlash shapes "
                   "(a GPU benchmark of the server at 27B; acceptance is about one token per round)")
    p.add_argument("--prompt-tokens", type=int, default=0, metavar="N", help="prompt length in tokens, about "
                   "(default: 0: a short prompt, 'def function_NN(x):')")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: --clients 1 3, --max-tokens 8, "
                   "--max-batch 2, --max-context 512; the demo pair, or with --random-27b bench.py's tiny shapes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--warmup-only", action="store_true", help="with --random-27b: time scripts/serve.py's start "
                   "(the pair made on the device instead of a checkpoint read, then serve.py's full warm-up: every "
                   "prefill width, greedy and sampled) and exit; with an empty --compile-cache DIR it is the cold "
                   "start")
    p.add_argument("--no-precompile", action="store_true", help="with --random-27b: the warm-up compiles each "
                   "program at its first call, in turn (the A/B of `speculative.precompile`: its programs side by side)")
    args = p.parse_args(argv)
    needed = ("uvicorn", "fastapi") + (() if args.warmup_only else ("openai",))  # the clients are openai's
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:  # before the model is built and compiled (minutes at 27B), not after
        p.error(f"needs {', '.join(missing)} (pip install -e '.[serve]'" + (" openai)" if "openai" in missing else ")"))
    if args.smoke:
        args.clients, args.max_tokens, args.max_context = [1, 3], 8, 512
        args.max_batch = 2 if args.max_batch == "auto" else args.max_batch
    if args.warmup_only and not args.random_27b:
        p.error("--warmup-only needs --random-27b (serve.py itself prints its warm-up time)")
    engine = random_27b_engine(args, serve) if args.random_27b else serve.load_engine(args)
    if args.warmup_only:
        import jax
        record = dict(engine.startup, precompile=not args.no_precompile, max_batch=engine.max_batch, max_context=engine.max_context,
                      compile_cache=args.compile_cache, date=time.strftime("%Y-%m-%d"),
                      device=jax.devices()[0].device_kind)
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        return 0
    import uvicorn
    from jaxddtree.serving import create_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}/v1"
    chat = not args.random_27b  # the random pair's tokenizer has no chat template: /v1/completions
    run_level = functools.partial(level, base, engine.name, max_tokens=args.max_tokens, chat=chat,
                                  prompt_tokens=args.prompt_tokens, tokenizer=engine.tokenizer)
    asyncio.run(run_level(1))  # a first request (anything left to set up)
    results = []
    for c in args.clients:
        r = asyncio.run(run_level(c))
        results.append(r)
        print(f"{c:3d} clients: {r['tokens_per_s']:8.1f} tokens/s aggregate, "
              f"{r['per_request_tokens_per_s']:8.1f} per request, TTFT median {r['ttft_median_s'] * 1e3:8.1f} ms, "
              f"p90 {r['ttft_p90_s'] * 1e3:8.1f} ms ({r['completion_tokens']} tokens in {r['wall_s']:.2f} s), "
              f"budget per slot {r['budget_per_slot']}, batched up to {r['batch_max']}", flush=True)
    one_rate = next((r["tokens_per_s"] for r in results if r["clients"] == 1), None)
    if one_rate:
        for r in results:
            r["over_1_client"] = round(r["tokens_per_s"] / one_rate, 3)
    srv.should_exit = True
    import jax
    same = generate_same(engine, args.max_tokens, chat, args.prompt_tokens) if 1 in args.clients else None
    if same:
        one_client = next(r for r in results if r["clients"] == 1)
        same["server_1_client_over_generate_e2e"] = round(one_client["tokens_per_s"] / same["e2e_tokens_per_s"], 3)
        same["server_1_client_over_generate_decode"] = round(one_client["tokens_per_s"] / same["tokens_per_s"], 3)
        print(f"generate (loop=device, same settings): {json.dumps(same)}", flush=True)
    record = {"model": engine.name, "endpoint": "chat/completions" if chat else "completions",
              "method": engine.method, "budget": engine.budget, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens or None, "max_batch": engine.max_batch,
              "slot_rows": engine.slot_rows, "prefill_tokens": engine.prefill_tokens,
              "prefill_group": engine.prefill_group, "memory": engine.memory,
              "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"), "levels": results,
              "generate_device": same}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
