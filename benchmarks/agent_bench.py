#!/usr/bin/env python
"""Agent benchmark (issue 39): time to first token of an agent step — the previous request's whole prompt + its
completion + N new tokens — with the prefix cache (the step resumes where the previous request ended) and without
(a conversation the server has never seen), at 32K and 128K tokens of history, through the OpenAI-compatible
server (scripts/serve.py's engine and app, on a free 127.0.0.1 port in this process, as benchmarks/serve_bench.py).

    python benchmarks/agent_bench.py --random-27b            # GPU: 27B shapes, writes results/agent_27b_h200.json
    python benchmarks/agent_bench.py --target DIR --drafter DDIR --histories 32768 --out FILE
    python benchmarks/agent_bench.py --smoke --out FILE      # CPU: tiny random shapes (checks the script)

Per history H: "fresh" sends a step prompt of H + new tokens that shares nothing with what the server has seen
(its whole prefill); "cached" first sends the previous request (H - --max-tokens prompt tokens, --max-tokens of
completion, untimed), then, --pause seconds after its last token, the step: that prompt + the completion's token
ids + new tokens (the server snapshots the end of the finished request while nothing else waits, so the step
resumes at its end). TTFT is measured by the client, from sending the request to the first streamed text, queue
and prefill included; `cached_tokens` is the server's `usage.prompt_tokens_details.cached_tokens`. Every prompt
is random token ids, distinct per conversation, sent to /v1/completions as text (--prompt text, the default with
--random-27b and --smoke: what an agent sends; their tokenizer maps each id to one code point and back, so the
server tokenizes the text into exactly these ids and the completion's ids are exact) or as a list of ids
(--prompt ids: the openai client then spends about 1.3 s preparing a 132K-id request on a 2-core CPU before it
sends anything, inside the measured TTFT). An untimed cycle at the
shortest history runs first (anything left to compile or allocate). The client is the `openai` package when it
is importable, else plain HTTP (urllib); --client picks one.

With --random-27b the pair has random weights (the figures measure prefill / restore time at 27B shapes, not
DDTree's speed-up). The results JSON: ttft_s {"32768": {"fresh", "cached"}, "131072": {...}} (the median of
--repeats runs), every run's figures, cached_tokens, the settings, date and device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "agent_27b_h200.json")
CODE_BASE = 0x10000  # IdTokenizer: token id i <-> the code point CODE_BASE + i (no surrogates below 248320 ids)


def serve_module():
    spec = importlib.util.spec_from_file_location("serve_script", os.path.join(ROOT, "scripts", "serve.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class IdTokenizer:
    """One code point per token id, both ways (so the client recovers the completion's exact ids from its text)."""

    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - CODE_BASE for c in text]

    def decode(self, ids, **_) -> str:
        return "".join(chr(CODE_BASE + int(i)) for i in ids if 0 <= int(i) < self.vocab_size)


def build_parser() -> argparse.ArgumentParser:
    p = serve_module().build_parser()
    p.prog = "agent_bench.py"
    p.set_defaults(max_batch=1)  # one agent
    p.add_argument("--random-27b", action="store_true", help="random weights of the Qwen3.6-27B + DFlash shapes")
    p.add_argument("--histories", type=int, nargs="+", default=[32768, 131072], metavar="H",
                   help="tokens of history (previous prompt + its completion) (default: 32768 131072)")
    p.add_argument("--new-tokens", type=int, default=1024, help="tokens the step adds (default: 1024)")
    p.add_argument("--max-tokens", type=int, default=256, help="the previous request's completion (default: 256)")
    p.add_argument("--step-max-tokens", type=int, default=8, help="the step's completion (default: 8)")
    p.add_argument("--decode-tokens", type=int, default=128, metavar="N",
                   help="the decode-speed check's completion length (0: skip it; default: 128)")
    p.add_argument("--decode-repeats", type=int, default=5, metavar="R",
                   help="the decode-speed check's rounds of (hit, off, miss), order rotated (the median of the "
                   "rounds' off / on ratios is reported; default: 5)")
    p.add_argument("--pause", type=float, default=0.0, metavar="S", help="seconds between the previous request's "
                   "end and the step (the agent's tool time; default 0: the snapshot's prefill may be in the TTFT)")
    p.add_argument("--repeats", type=int, default=1, help="runs per history and kind (the median is reported)")
    p.add_argument("--client", choices=("auto", "openai", "urllib"), default="auto")
    p.add_argument("--prompt", choices=("auto", "text", "ids"), default="auto", help="send prompts as text (the "
                   "server tokenizes them) or as token id lists (default: text with --random-27b / --smoke, whose "
                   "tokenizer gives back exactly the ids; ids with a checkpoint's tokenizer)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny random shapes, histories "
                   "192 320, 48 new tokens, 8-token completions")
    p.add_argument("--out", default=None, help=f"results JSON (default with --random-27b: {DEFAULT_OUT}; none with "
                   "--smoke)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.smoke:
        args.random_27b = True
        args.histories, args.new_tokens, args.max_tokens, args.step_max_tokens = [192, 320], 48, 8, 4
        args.decode_tokens = min(args.decode_tokens, 16)
    if min(args.histories) <= args.max_tokens + 1 or args.new_tokens < 1 or args.max_tokens < 1 \
            or args.step_max_tokens < 1 or args.repeats < 1 or not (args.decode_tokens == 0 or args.decode_tokens > 2) or args.decode_repeats < 1:
        p.error("every history must exceed --max-tokens + 1; --new-tokens, --max-tokens, --step-max-tokens and "
                "--repeats and --decode-repeats must be >= 1; --decode-tokens 0 or > 2")
    if args.out is None and args.random_27b and not args.smoke:
        args.out = DEFAULT_OUT
    if args.prompt == "auto":
        args.prompt = "text" if args.random_27b else "ids"
    need = max(args.histories) + args.new_tokens + max(args.max_tokens, args.step_max_tokens, args.decode_tokens)
    args.max_context = max(args.max_context or 0, need)
    args.lengths = sorted({n for h in args.histories for n in (h - args.max_tokens, h, h + args.new_tokens)})
    return args


def build_engine(args):
    """The Engine: random 27B-shaped bf16 weights (bench.py's shapes; --smoke: its tiny ones in fp32) with an
    IdTokenizer, or scripts/serve.py's (a checkpoint, the demo pair); warmed up for this run's prompt lengths."""
    from jaxddtree.serving.engine import warmup_printer

    if not args.random_27b:
        engine = serve_module().load_engine(args)  # (its own warm-up)
        return engine
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench
    from jaxddtree import compile_cache
    from jaxddtree.serving import Engine

    compile_cache.enable(args.compile_cache, "agent_bench.py")
    target, drafter = bench.random_pair(args.smoke, args.kernels)
    tok = IdTokenizer(target.config.vocab_size)
    engine = Engine(target, drafter, tok, name="random-27b", method=args.method or "ddtree", budget=args.budget,
                    max_context=args.max_context, queue_size=args.queue, default_max_tokens=args.default_max_tokens,
                    max_batch=args.max_batch, prefill_tokens=args.prefill_tokens,
                    prefix_cache_gb=args.prefix_cache_gb, prefix_cache_grid=args.prefix_cache_grid)
    t = time.perf_counter()
    engine.warmup([1, 2, 3], progress=warmup_printer("agent_bench.py"), lengths=args.lengths)
    print(f"agent_bench.py: compiled in {time.perf_counter() - t:.1f} s; max_batch {engine.max_batch}, prefix cache "
          f"{engine.prefix_cache_budget / (1 << 30):.1f} GiB, memory {engine.memory}", flush=True)
    return engine


def start_server(engine):
    """uvicorn over the engine's app on a free 127.0.0.1 port, in a thread -> (base url, stop())."""
    import uvicorn
    from jaxddtree.serving import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)

    def stop():
        srv.should_exit = True
        thread.join(30)
        engine.close()
    return f"http://127.0.0.1:{port}/v1", stop


def _fields(usage) -> tuple[int, int]:
    """(cached_tokens, completion_tokens) of a usage object or dict."""
    if usage is None:
        return 0, 0
    if not isinstance(usage, dict):
        usage = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens") or 0)


def complete_openai(base: str, model: str, prompt, max_tokens: int) -> dict:
    """prompt: text, or a list of token ids."""
    import openai
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    ttft, parts, usage, spec = None, [], None, None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else None
        if text:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(text)
        if chunk.usage is not None:
            usage = chunk.usage
        spec = (chunk.model_extra or {}).get("speculative") or spec
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "text": "".join(parts), "usage": usage,
            "speculative": spec}


def complete_urllib(base: str, model: str, prompt, max_tokens: int) -> dict:
    """prompt: text, or a list of token ids."""
    import urllib.request
    prompt = prompt if isinstance(prompt, str) else [int(i) for i in prompt]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer none"})
    t0 = time.perf_counter()
    ttft, parts, usage, spec = None, [], None, None
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"the server failed the request: {obj['error']}")
            text = obj["choices"][0].get("text") if obj.get("choices") else None
            if text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(text)
            if obj.get("usage"):
                usage = obj["usage"]
            spec = obj.get("speculative") or spec
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "text": "".join(parts), "usage": usage,
            "speculative": spec}


def pick_client(name: str):
    if name == "openai" or (name == "auto" and importlib.util.find_spec("openai") is not None):
        return "openai", complete_openai
    return "urllib", complete_urllib


def agent_runs(complete, base, model, tok, H: int, args, seed: int) -> dict:
    """One history H: fresh (a never-seen step prompt) and cached (the previous request, then its step)."""
    import numpy as np
    vocab = tok.vocab_size if hasattr(tok, "vocab_size") else 32000
    rng = np.random.default_rng(seed)
    lo = min(1000, vocab // 4)  # (away from the lowest ids: special tokens of a real tokenizer)

    def rand(n):
        return rng.integers(lo, vocab, n).tolist()

    from jaxddtree.text import encode_text
    send = (lambda ids: tok.decode(ids)) if args.prompt == "text" else list  # noqa: E731
    fresh = complete(base, model, send(rand(H + args.new_tokens)), args.step_max_tokens)
    prev = rand(H - args.max_tokens)
    first = complete(base, model, send(prev), args.max_tokens)
    completion = encode_text(tok, first["text"])
    time.sleep(args.pause)
    step = prev + completion + rand(args.new_tokens)
    cached = complete(base, model, send(step), args.step_max_tokens)
    out = {"history": len(prev) + len(completion), "step_prompt_tokens": len(step)}
    for k, r in (("fresh", fresh), ("previous", first), ("cached", cached)):
        c, n = _fields(r["usage"])
        out[k] = {"ttft_s": r["ttft_s"], "wall_s": r["wall_s"], "cached_tokens": c, "completion_tokens": n}
    return out


def decode_check(complete, base, engine, H: int, args, seed: int) -> dict:
    """Decode speed with the prefix cache on vs off (the issue's ±2 % goal), at history H: ms per token after the
    first of an --decode-tokens completion: "on_hit" (an agent step served from the cache), "off" (the cache
    switched off in this server, as --prefix-cache-gb 0 runs: no lookups, snapshots or remembering; a never-seen
    prompt), then the cache back on and "on_miss" (a never-seen prompt). Same history, same programs; the server
    idle (the last request's end remembered) before each."""
    import jax
    import numpy as np
    tok = engine.tokenizer
    rng = np.random.default_rng(seed)
    lo = min(1000, tok.vocab_size // 4)
    rand = lambda n: rng.integers(lo, tok.vocab_size, n).tolist()  # noqa: E731
    send = (lambda ids: tok.decode(ids)) if args.prompt == "text" else list  # noqa: E731
    n = args.decode_tokens

    def idle():
        t = time.perf_counter()
        while (engine.busy or engine._remembering is not None or engine._to_remember) and time.perf_counter() - t < 60:
            time.sleep(0.05)
        jax.effects_barrier()

    def rate(prompt) -> dict:
        idle()
        r = complete(base, engine.name, send(prompt), n)
        _, got = _fields(r["usage"])
        s = r["speculative"] or {}
        rounds = s.get("rounds") or 0
        return {"ms_per_token": 1e3 * (r["wall_s"] - r["ttft_s"]) / max(got - 1, 1), "completion_tokens": got,
                "ttft_s": r["ttft_s"], "rounds": rounds, "mean_acceptance_length": s.get("mean_acceptance_length"),
                # the server's own decode time per round (its wall - TTFT): free of the acceptance's luck
                "ms_per_round": (1e3 * (s["wall_s"] - s["time_to_first_token_s"]) / rounds) if rounds else None}

    from jaxddtree.text import encode_text
    prev = rand(H - args.max_tokens)
    runs = {"on_hit": [], "off": [], "on_miss": []}
    pc = engine.prefix_cache
    def hit():
        first = complete(base, engine.name, send(prev), args.max_tokens)
        return rate(prev + encode_text(tok, first["text"]) + rand(args.new_tokens))

    def off():
        engine.prefix_cache = engine.pool.prefix_cache = None
        try:
            return rate(rand(H + args.new_tokens))
        finally:
            engine.prefix_cache = engine.pool.prefix_cache = pc

    kinds = {"on_hit": hit, "off": off, "on_miss": lambda: rate(rand(H + args.new_tokens))}
    order = list(kinds)
    for i in range(args.decode_repeats):  # interleaved, the order rotated: a drift of the machine hits all alike
        for k in order[i % 3:] + order[:i % 3]:
            runs[k].append(kinds[k]())
        prev = rand(H - args.max_tokens)
    out = {"history": H, "runs": runs}
    for k, rs in runs.items():
        out[k] = {m: statistics.median(r[m] for r in rs) if all(r[m] is not None for r in rs) else None
                  for m in ("ms_per_token", "ms_per_round")}
    m = "ms_per_round" if all(out[k]["ms_per_round"] for k in runs) else "ms_per_token"
    out["ratio_of"] = m
    for k in ("on_hit", "on_miss"):  # the median of the repeats' paired ratios (each repeat's three runs adjacent)
        out["off_over_" + k] = statistics.median(o[m] / r[m] for o, r in zip(runs["off"], runs[k]))
    return out


def main(argv=None) -> int:
    if ROOT not in sys.path:  # this checkout's jaxddtree, installed or not
        sys.path.insert(0, ROOT)
    args = parse_args(argv)
    missing = [m for m in ("uvicorn", "fastapi") if importlib.util.find_spec(m) is None]
    if missing:  # before the model is built and compiled (minutes at 27B)
        print(f"agent_bench.py: needs {', '.join(missing)} (pip install -e '.[serve]')", file=sys.stderr)
        return 2
    client_name, complete = pick_client(args.client)
    engine = build_engine(args)
    if engine.prefix_cache is None:
        print("agent_bench.py: warning: the server has no prefix cache (--prefix-cache-gb 0 or --tp > 1)",
              file=sys.stderr, flush=True)
    base, stop = start_server(engine)
    import jax
    try:
        agent_runs(complete, base, engine.name, engine.tokenizer, min(args.histories), args, seed=0)  # untimed
        runs = {str(h): [] for h in args.histories}
        for rep in range(args.repeats):
            for i, h in enumerate(args.histories):
                r = agent_runs(complete, base, engine.name, engine.tokenizer, h, args, seed=1 + rep * 100 + i)
                runs[str(h)].append(r)
                print(f"history {h:7d}: TTFT fresh {r['fresh']['ttft_s']:.3f} s, cached {r['cached']['ttft_s']:.3f} "
                      f"s ({r['cached']['cached_tokens']} of {r['step_prompt_tokens']} prompt tokens cached)",
                      flush=True)
        decode = None
        if args.decode_tokens and engine.prefix_cache is not None:
            decode = decode_check(complete, base, engine, min(args.histories), args, seed=999)
            m = decode["ratio_of"]
            print(f"decode at {decode['history']} ({m}, medians): {decode['on_hit'][m]:.2f} served from the cache, "
                  f"{decode['on_miss'][m]:.2f} cache on (miss), {decode['off'][m]:.2f} cache off (paired off / hit "
                  f"{decode['off_over_on_hit']:.3f}, off / miss {decode['off_over_on_miss']:.3f})", flush=True)
    finally:
        stop()
    med = lambda xs: statistics.median(xs)  # noqa: E731
    dev = jax.devices()[0]
    record = {
        "ttft_s": {h: {k: med([r[k]["ttft_s"] for r in rs]) for k in ("fresh", "cached")} for h, rs in runs.items()},
        "cached_tokens": {h: med([r["cached"]["cached_tokens"] for r in rs]) for h, rs in runs.items()},
        "decode": decode,
        "runs": runs,
        "settings": {"model": engine.name, "method": engine.method, "budget": engine.budget,
                     "new_tokens": args.new_tokens, "previous_max_tokens": args.max_tokens,
                     "step_max_tokens": args.step_max_tokens, "decode_tokens": args.decode_tokens,
                     "decode_repeats": args.decode_repeats, "pause_s": args.pause, "repeats": args.repeats,
                     "max_context": engine.max_context, "max_batch": engine.max_batch,
                     "prefill_tokens": engine.prefill_tokens, "prefix_cache_gib":
                     engine.prefix_cache_budget / (1 << 30), "prefix_cache_grid": args.prefix_cache_grid,
                     "client": client_name, "prompt": args.prompt, "smoke": args.smoke},
        "date": time.strftime("%Y-%m-%d"), "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"agent_bench.py: wrote {args.out}", flush=True)
    print(json.dumps({k: record[k] for k in ("ttft_s", "cached_tokens", "decode", "date", "device")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
