#!/usr/bin/env python
"""Serving benchmark: time to first token and tokens/s for 1, 4 and 16 concurrent streaming clients against the
OpenAI-compatible server (scripts/serve.py), run in this process on a free 127.0.0.1 port.

    python benchmarks/serve_bench.py                        # the demo pair (CPU is fine)
    python benchmarks/serve_bench.py --target DIR --drafter DDIR --clients 1 4 16 --max-tokens 256
    python benchmarks/serve_bench.py --random-27b     # GPU: Qwen3.6-27B + DFlash shapes, random bf16 weights

Each client sends one streamed chat completion (temperature 0, a distinct prompt of the same length); TTFT is
measured from sending the request to the first content delta, so with several clients it includes the time
spent waiting in the queue (one request runs at a time). Aggregate tokens/s = all completion tokens / wall time.

With --random-27b the pair has random weights (a random drafter's tokens are almost never accepted: about one
token per round), so the figures measure the server + round time at 27B shapes, not DDTree's speed-up; every
token id decodes to one printable character so that each round emits text.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_module():
    spec = importlib.util.spec_from_file_location("serve_script", os.path.join(ROOT, "scripts", "serve.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def one(client, model, prompt, max_tokens, chat=True):
    t0 = time.perf_counter()
    ttft, usage = None, None
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
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "tokens": usage.completion_tokens}


async def level(base, model, clients, max_tokens, chat=True):
    import openai
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=3600)
    prompts = [f"def function_{i:02d}(x):" for i in range(clients)]
    t0 = time.perf_counter()
    try:
        runs = await asyncio.gather(*(one(client, model, p, max_tokens, chat) for p in prompts))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in runs if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in runs)
    return {"clients": clients, "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "per_request_tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs)}


def random_27b_engine(args):
    """An Engine over random Qwen3.6-27B / DFlash-shaped bf16 weights (benchmarks/bench.py's shapes)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    sys.path.insert(0, ROOT)
    import jax.numpy as jnp
    import bench
    from jaxddtree.checkpoint.builtin import ByteTokenizer
    from jaxddtree.model.config import text_config_from_dict
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.model.target import random_target
    from jaxddtree.serving import Engine
    from jaxddtree.text import encode_text

    class PrintableTokenizer(ByteTokenizer):
        def decode(self, ids, **_) -> str:
            return "".join(chr(32 + int(i) % 95) for i in ids)

    target = random_target(text_config_from_dict(dict(bench.QWEN36_27B), where="Qwen3.6-27B shapes"), "bfloat16")
    target.kernels = args.kernels or "pallas"
    drafter = bench.random_drafter(DrafterConfig(**bench.DFLASH_27B), jnp.bfloat16)
    tok = PrintableTokenizer()
    engine = Engine(target, drafter, tok, name="random-27b", method=args.method or "ddtree", budget=args.budget,
                    max_context=args.max_context or 8192, queue_size=args.queue,
                    default_max_tokens=args.default_max_tokens)
    t = time.perf_counter()
    engine.warmup(encode_text(tok, "Hello"), temperatures=[0.0])
    print(f"serve_bench.py: random 27B pair compiled in {time.perf_counter() - t:.1f} s", flush=True)
    return engine


def generate_same(engine, max_tokens: int, chat: bool) -> dict:
    """`jaxddtree.generate(loop="device")` on the 1-client level's request (same prompt ids, pair, method, budget,
    caches, stop ids, max_tokens, temperature 0), in this process: tokens_per_s (decode only, generate's own
    figure) and e2e_tokens_per_s (completion tokens / (time to first token + decode), what a client waits)."""
    import jaxddtree
    from jaxddtree.text import encode_chat, encode_text, ensure_chat_template
    prompt = "def function_00(x):"
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
    serve = serve_module()
    p = serve.build_parser()
    p.prog = "serve_bench.py"
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--random-27b", action="store_true", help="random weights of the Qwen3.6-27B + DFlash shapes "
                   "(a GPU benchmark of the server at 27B; acceptance is about one token per round)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    engine = random_27b_engine(args) if args.random_27b else serve.load_engine(args)
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
    asyncio.run(level(base, engine.name, 1, args.max_tokens, chat))  # compile the prompt's prefill shape
    results = []
    for c in args.clients:
        r = asyncio.run(level(base, engine.name, c, args.max_tokens, chat))
        results.append(r)
        print(f"{c:3d} clients: {r['tokens_per_s']:8.1f} tokens/s aggregate, "
              f"{r['per_request_tokens_per_s']:8.1f} per request, TTFT median {r['ttft_median_s'] * 1e3:8.1f} ms, "
              f"max {r['ttft_max_s'] * 1e3:8.1f} ms ({r['completion_tokens']} tokens in {r['wall_s']:.2f} s)",
              flush=True)
    srv.should_exit = True
    import jax
    same = generate_same(engine, args.max_tokens, chat) if 1 in args.clients else None
    if same:
        one_client = next(r for r in results if r["clients"] == 1)
        same["server_1_client_over_generate_e2e"] = round(one_client["tokens_per_s"] / same["e2e_tokens_per_s"], 3)
        same["server_1_client_over_generate_decode"] = round(one_client["tokens_per_s"] / same["tokens_per_s"], 3)
        print(f"generate (loop=device, same settings): {json.dumps(same)}", flush=True)
    record = {"model": engine.name, "endpoint": "chat/completions" if chat else "completions", "method": engine.method, "budget": engine.budget, "max_tokens": args.max_tokens,
              "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"), "levels": results,
              "generate_device": same}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
