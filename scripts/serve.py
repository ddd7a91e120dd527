#!/usr/bin/env python
"""An OpenAI-compatible HTTP server over DDTree speculative decoding (FastAPI + uvicorn).
Run from the repository root without installing: `python scripts/serve.py --help`."""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import time

try:
    from jaxddtree import cli_args  # argparse types; light (no jax)
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxddtree import cli_args

EPILOG = """\
examples:
  # the demo pair in demo/ on http://127.0.0.1:8000
  python scripts/serve.py

  # any free port: the line "serve.py: serving ... on http://127.0.0.1:PORT/v1" names the one it took
  python scripts/serve.py --port 0

  # a real target + DFlash drafter, up to 16 requests decoded at once (continuous batching), 8K tokens each
  python scripts/serve.py --target ~/models/Qwen3.6-27B --drafter ~/models/Qwen3.6-27B-DFlash --budget 64 \\
      --max-batch 16 --max-context 8192

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0}'

  # only clients with a key (also from $JAXDDTREE_API_KEY, comma-separated); /health and /metrics stay open
  JAXDDTREE_API_KEY=k1,k2 python scripts/serve.py --host 0.0.0.0 --api-key k3
  curl http://127.0.0.1:8000/v1/models -H 'Authorization: Bearer k3'

honoured request fields: max_tokens / max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop,
n (1), stream, stream_options, chat_template_kwargs (e.g. {"enable_thinking": false}), tools / tool_choice
(chat; tool calls come back as tool_calls; with thinking on, the reasoning as reasoning_content). Other
sampling fields (frequency_penalty, logit_bias, logprobs, ...) get a 400 unless they carry their default
value. GET /metrics: Prometheus text format. See README.md, "Serving"."""

API_KEY_ENV = "JAXDDTREE_API_KEY"


positive_int, nonneg_float, port_arg = cli_args.positive_int, cli_args.non_negative_float, cli_args.port
budget_arg = max_batch_arg = cli_args.auto_or_positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description="Serve a Qwen3.5/3.6 target (+ DFlash drafter) "
                                "through the OpenAI API: /v1/completions, /v1/chat/completions (streaming "
                                "too), /v1/models, /health, /metrics. With no --target, the demo pair in demo/.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="target checkpoint directory (default: the demo pair)")
    p.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (default: none; the demo's with "
                   "the demo pair)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port_arg, default=8000, help="port (default: 8000; 0 = any free port, named "
                   "in the 'serving ... on http://HOST:PORT/v1' line). The port is taken before the model loads: "
                   "a busy one is a one-line error at once")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default=None, help="decoding method "
                   "(default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=budget_arg, default="auto", metavar="N|auto", help="DDTree node budget; auto: "
                   "chosen per round for the most expected tokens per second (see generate.py --help) "
                   "(default: auto)")
    p.add_argument("--budget-costs", metavar="FILE", default=None, help="--budget auto's round-time table (JSON "
                   "with 'round_ms_by_budget_context'; default: benchmarks/results/h200.json on an H200, else a "
                   "built-in model)")
    p.add_argument("--max-context", type=positive_int, default=None, metavar="N", help="prompt + completion "
                   "tokens at most (default: the model's max_position_embeddings)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256, metavar="N", help="completion "
                   "tokens of a chat request without max_tokens, capped by the context (default: 256; "
                   "/v1/completions defaults to 16 as in the OpenAI API)")
    p.add_argument("--max-batch", type=max_batch_arg, default="auto", metavar="N|auto", help="requests decoded "
                   "at once (continuous batching: each has a slot of caches for --max-context tokens; more wait in "
                   "the queue). auto: the largest of 16, 8, 4, 2, 1 whose slots fit in the device's free memory "
                   "(4 on the CPU); an N that does not fit is a one-line error at start naming the largest that "
                   "does (default: auto)")
    p.add_argument("--prefill-tokens", type=positive_int, default=2048, metavar="N", help="prompt tokens "
                   "prefilled per round while others decode (their stall per round; at least one chunk: 256 "
                   "tokens, 2048 past 8K); joining prompts of one shape prefill together in passes of up to N "
                   "rows (default: 2048)")
    p.add_argument("--prefix-cache-gb", type=nonneg_float, default=None, metavar="GB", help="device memory "
                   "for the prefix cache (GiB): a prompt that starts with a cached prefix (a previous prompt's end, "
                   "or a --prefix-cache-grid point of one) resumes its prefill there; least recently used "
                   "snapshots go first; 0: off (default: 80%% of the memory the slots leave; 1 on the CPU; off "
                   "with --tp > 1)")
    p.add_argument("--prefix-cache-grid", type=positive_int, default=8192, metavar="N", help="the prefix cache "
                   "also snapshots every N tokens inside long prompts (a GDN state, ~147 MiB at 27B, per point; "
                   "default: 8192)")
    p.add_argument("--draft-vocab", type=cli_args.draft_vocab, default=None, metavar="N|FILE", help="draft only "
                   "a subset of the token ids (see generate.py --help): N, the N most frequent ids of the drafter "
                   "directory's token_counts.json, or FILE, a JSON list or .npy array of ids; changes the acceptance, "
                   "never the output (default: off, every id)")
    p.add_argument("--drafter-fp8", action="store_true", help="the drafter's projections in FP8 (see generate.py "
                   "--help): about half of what its layers read; changes the acceptance, never the output (default: "
                   "off)")
    p.add_argument("--queue", type=positive_int, default=64, metavar="N", help="requests waiting for a slot at "
                   "most; more get 503 (default: 64)")
    p.add_argument("--model-name", default=None, help="the model id clients use (default: the target "
                   "directory's name, 'demo' for the demo pair)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: float32 on CPU, "
                   "bfloat16 on GPU")
    p.add_argument("--kernels", choices=("xla", "pallas"), default=None, help="default: pallas on GPU, xla on CPU")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor parallelism: split the target "
                   "over the first N devices (see generate.py --tp; default: 1)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY", help="every /v1 request must carry "
                   "'Authorization: Bearer KEY' (401 otherwise; /health and /metrics stay open); repeat for several "
                   f"keys; ${API_KEY_ENV} adds comma-separated ones (default: no key needed)")
    p.add_argument("--no-warmup", action="store_true", help="do not compile before listening")
    p.add_argument("--compile-cache", metavar="DIR|none", default=None, help="persistent XLA compilation cache "
                   "directory: a second start with the same settings loads the warm-up's programs instead of "
                   "compiling them; none: off (default: $JAXDDTREE_COMPILE_CACHE, else ~/.cache/jaxddtree/xla)")
    return p


SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")  # the `serve` extra of pyproject.toml
INSTALL_HINT = "pip install -e '.[serve]'"


def require_server_extra() -> None:
    """Exit 2 with one line on stderr naming the install command when the server's extra (fastapi, uvicorn,
    prometheus-client) is not importable; called before any model loads."""
    missing, why = [], None
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(name)
            why = why or e
    if missing:
        print(f"serve.py: error: the server needs {' and '.join(missing)} ({type(why).__name__}: {why}); install "
              f"the server's extra from the repository root: {INSTALL_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def compile_while_loading(args, cfg, dcfg, dtype, backend, costs, prompt_ids):
    """A thread compiling the warm-up's programs that do not depend on the slot count (every prefill width alone,
    the start, the single-slot round: `batch.single_slot_programs`) for a pair of cfg's / dcfg's shapes (dcfg None:
    no drafter) while the main thread loads or makes the weights; None without a warm-up or where the loaded pair's
    structure is not predicted (tensor parallelism, a draft vocabulary, an FP8 drafter; the caller leaves out FP8
    checkpoints). The warm-up does not wait for it: a program it meets in flight here is waited for, not compiled
    again (`precompile.compile_all`), and the rest (groups, batched rounds) compiles beside it. A wrong prediction
    costs only the thread's work."""
    import threading

    if args.no_warmup or args.tp > 1 or args.draft_vocab is not None or args.drafter_fp8:
        return None
    from jaxddtree.model.drafter import Drafter, abstract_params
    from jaxddtree.model.target import abstract_target, as_dtype
    from jaxddtree.speculative import precompile
    from jaxddtree.speculative.batch import single_slot_programs
    from jaxddtree.speculative.loop import capacity, resolve_budget
    method = args.method or ("ddtree" if dcfg is not None else "ar")
    dcfg = dcfg if method != "ar" else None
    target = abstract_target(cfg, dtype)
    target.kernels = args.kernels or ("xla" if backend == "cpu" else "pallas")
    drafter = Drafter(config=dcfg, params=abstract_params(dcfg, as_dtype(dtype)), path="abstract") if dcfg else None
    max_context = min(args.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)

    def run():
        try:  # as the Engine sizes its slots (serving/engine.py)
            widest, table = resolve_budget(args.budget, method, cfg.vocab_size, dcfg, costs)
            cache_len = capacity(target, dcfg, method, widest, max_context, 0)[1]
            precompile.compile_all(single_slot_programs(target, drafter, prompt_ids, method=method,
                                                        cache_len=cache_len, tree_budget=args.budget,
                                                        budget_costs=table))
        except Exception:  # noqa: BLE001 (the warm-up compiles what this could not)
            pass
    thread = threading.Thread(target=run, name="precompile-early", daemon=True)
    thread.start()
    return thread


def load_engine(args):
    """Load the pair and build the Engine (also used by tests and benchmarks with parsed args)."""
    try:
        import jaxddtree  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import jaxddtree as jd
    from jaxddtree.checkpoint import builtin
    from jaxddtree.checkpoint.hf_target import fp8_format
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.serving import Engine
    from jaxddtree.speculative import budget as budget_lib
    from jaxddtree.model.sharding import check_tp, replicate
    from jaxddtree.text import encode_text, has_tokenizer, load_hf_tokenizer

    def check(cfg):
        try:
            check_tp(cfg, args.tp)
        except ValueError as e:
            raise SystemExit(f"serve.py: error: --tp: {e}") from None

    costs = args.budget_costs
    if costs is not None:  # read before the models load: a bad file is one line, at once
        try:
            costs = budget_lib.load(costs)
        except ValueError as e:
            raise SystemExit(f"serve.py: error: argument --budget-costs: {e}") from None
    from jaxddtree import compile_cache
    cache_dir = compile_cache.enable(args.compile_cache, "serve.py")
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    if args.target is None and args.drafter is not None:
        raise SystemExit("serve.py: error: --drafter needs --target (the demo pair brings its own drafter)")
    vocab = args.draft_vocab
    if vocab is not None and args.method == "ar":
        raise SystemExit("serve.py: error: --draft-vocab restricts what the drafter drafts: it needs --method dflash "
                         "or ddtree")
    if args.drafter_fp8 and args.method == "ar":
        raise SystemExit("serve.py: error: --drafter-fp8 changes how the drafter drafts: it needs --method dflash or "
                         "ddtree")
    if isinstance(vocab, str):  # a file of ids
        from jaxddtree.model import draft_vocab
        try:
            vocab = draft_vocab.load(vocab)
        except ValueError as e:
            raise SystemExit(f"serve.py: error: argument --draft-vocab: {e}") from None
    demo = builtin.demo_dirs() if args.target is None else None
    early = None  # a thread compiling the warm-up's single-slot programs while the weights load
    if args.target is None and demo is None:  # the random pair built in code
        pair = builtin.load_random(dtype)
        target, drafter, tok, name = pair.target, pair.drafter, pair.tokenizer, "demo"
        check(target.config)
        target = target.shard(args.tp, consume=True)
        if args.method == "ar":
            drafter = None
        else:
            drafter.params = replicate(drafter.params, target.mesh)
            if vocab is not None:
                if isinstance(vocab, int):
                    raise SystemExit("serve.py: error: argument --draft-vocab: N needs a token frequency table (the "
                                     "built-in random pair has none); give a FILE of token ids")
                from jaxddtree.model import draft_vocab
                try:
                    ids = draft_vocab.check_ids(vocab, target.config.vocab_size)
                except ValueError as e:
                    raise SystemExit(f"serve.py: error: argument --draft-vocab: "
                                     f"{str(e).removeprefix('draft_vocab: ')}") from None
                drafter = drafter.with_draft_vocab(ids, target)
    else:
        tdir, ddir = demo or (args.target, args.drafter)
        name = "demo" if demo else os.path.basename(os.path.normpath(tdir))
        if args.method == "ar":
            ddir = None  # plain decoding: the drafter is not loaded
        if not has_tokenizer(tdir):
            raise SystemExit(f"serve.py: error: {tdir} has no tokenizer")
        try:
            tok = load_hf_tokenizer(tdir)
        except ValueError as e:
            raise SystemExit(f"serve.py: error: {e}") from None
        cfg = jd.load_config(tdir)
        check(cfg)
        if fp8_format(tdir) is None:
            dcfg = DrafterConfig.from_pretrained(ddir) if ddir else None
            early = compile_while_loading(args, cfg, dcfg, dtype, backend, costs, encode_text(tok, "Hello"))
        target = jd.load_target(tdir, dtype, tp=args.tp)
        if vocab is not None and not ddir:
            raise SystemExit("serve.py: error: --draft-vocab needs a drafter (--drafter DIR)")
        try:
            drafter = jd.load_drafter(ddir, target, dtype, draft_vocab=vocab) if ddir else None
        except ValueError as e:
            if vocab is None or "draft_vocab" not in str(e):
                raise
            raise SystemExit(f"serve.py: error: argument --draft-vocab: {str(e).removeprefix('draft_vocab: ')}") \
                from None
    target.kernels = args.kernels or ("xla" if backend == "cpu" else "pallas")
    method = args.method or ("ddtree" if drafter is not None else "ar")
    if args.drafter_fp8 and drafter is not None and method != "ar":
        drafter = drafter.to_fp8()
    if method != "ar" and drafter is None:
        raise SystemExit(f"serve.py: error: --method {method} needs --drafter")
    try:
        engine = Engine(target, drafter, tok, name=args.model_name or name, method=method, budget=args.budget,
                        budget_costs=costs, max_context=args.max_context, queue_size=args.queue,
                        default_max_tokens=args.default_max_tokens, max_batch=args.max_batch,
                        prefill_tokens=args.prefill_tokens, prefix_cache_gb=args.prefix_cache_gb,
                        prefix_cache_grid=args.prefix_cache_grid)
    except ValueError as e:  # e.g. the slots' caches for --max-context do not fit in the device's memory
        raise SystemExit(f"serve.py: error: {e}") from None
    print(f"serve.py: {engine.max_batch} slot(s) of {engine.cache_len} cache positions" + (
        f" ({engine.memory['slot_gib']:.2f} GiB each; {engine.memory['free_gib']:.1f} GiB free, "
        f"{engine.memory['fits']} slots would fit)" if engine.memory else "")
        + (f"; joining prompts prefill in groups of up to {engine.prefill_group}" if engine.prefill_group > 1 else "")
        + (f"; prefix cache {engine.prefix_cache_budget / (1 << 30):.1f} GiB" if engine.prefix_cache else
           "; prefix cache off")
        + (f"; draft vocabulary of {drafter.draft_vocab.size} ids" if drafter is not None and method != "ar"
           and drafter.draft_vocab is not None else "")
        + ("; FP8 drafter" if drafter is not None and method != "ar" and drafter.fp8 else ""),
        file=sys.stderr, flush=True)
    if not args.no_warmup:
        print("serve.py: warm-up: compiling every prefill width and slot count before listening, one line per "
              "stage (--no-warmup skips it" + (f"; compilation cache: {cache_dir}" if cache_dir else "") + ")",
              file=sys.stderr, flush=True)
        t = time.perf_counter()
        from jaxddtree.serving.engine import warmup_printer
        engine.warmup(encode_text(tok, "Hello"), progress=warmup_printer("serve.py"))
        if early is not None:  # (done: the warm-up waited for its programs; a duplicate jitted pass may be ending)
            early.join()
        print(f"serve.py: compiled (every prefill width, slot count, greedy and sampled) in "
              f"{time.perf_counter() - t:.1f} s" + (f" (compilation cache: {cache_dir})" if cache_dir else ""),
              file=sys.stderr, flush=True)
    return engine


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads: a busy port or a bad address is one
    line at once, not after the warm-up, and --port 0's free port is known. SystemExit(2) on failure."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"serve.py: error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def url(host: str, sock: socket.socket) -> str:
    """The base URL clients use: the bound port (the real one for --port 0)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}/v1"


def api_keys(args, environ=os.environ) -> list[str]:
    """The keys of --api-key and $JAXDDTREE_API_KEY (comma-separated), blanks dropped; exit 2 with one line when
    a --api-key is empty."""
    given = list(args.api_key or [])
    if any(not k.strip() for k in given):
        raise SystemExit("serve.py: error: argument --api-key: an empty key")
    return [k.strip() for k in given + environ.get(API_KEY_ENV, "").split(",") if k.strip()]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    keys = api_keys(args)
    require_server_extra()
    sock = bind(args.host, args.port)
    engine = load_engine(args)
    import uvicorn
    from jaxddtree.serving import create_app
    line = (f"serve.py: serving '{engine.name}' ({engine.method}) on {url(args.host, sock)}"
            + (f" ({len(keys)} API key(s) accepted)" if keys else " (no API key needed: see --api-key)"))

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):  # the line once the socket listens
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(line, file=sys.stderr, flush=True)

    Server(uvicorn.Config(create_app(engine, api_keys=keys), log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
