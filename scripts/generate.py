#!/usr/bin/env python
"""Generate text with a Qwen3.5/3.6 target: autoregressive, DFlash (chain) or DDTree (tree) speculative
decoding. Run from the repository root without installing: `python scripts/generate.py --help`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    from jaxddtree import cli_args  # argparse types; light (no jax)
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxddtree import cli_args

PROG = "generate.py"

EPILOG = """\
examples:
  # the demo pair in demo/ (a tiny target trained on Python source + its trained DFlash drafter)
  python scripts/generate.py
  python scripts/generate.py --max-new-tokens 32 --json

  # a real target + DFlash drafter (HF directories or `python -m convert` outputs)
  python scripts/generate.py --target ~/models/Qwen3.6-27B --drafter ~/models/Qwen3.6-27B-DFlash \\
      --prompt "Write a haiku about trees." --budget 64 --max-new-tokens 256

  # a chat turn: the tokenizer's chat template, a system turn, Qwen's thinking mode off
  python scripts/generate.py --target DIR --drafter DDIR --chat --system "Be brief." --no-think \\
      --prompt "What is speculative decoding?"

  # token ids in, JSON out (the JSON object is the last stdout line)
  python scripts/generate.py --target DIR --prompt-ids 1,2,3 --method ar --json

  # sampling, stop at token 151645
  python scripts/generate.py --target DIR --drafter DDIR --prompt "Hi" --temperature 1.0 --seed 7 \\
      --stop-ids 151645

  # Qwen's thinking-mode sampling: temperature 0.6, nucleus 0.95, top 20 tokens
  python scripts/generate.py --target DIR --drafter DDIR --chat --prompt "Hi" --temperature 0.6 \\
      --top-p 0.95 --top-k 20

exit codes: 0 success, 2 bad arguments or unusable inputs (one error line on stderr)."""


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UsageError(message)


positive_int, non_negative_int, finite_non_negative = (
    cli_args.positive_int, cli_args.non_negative_int, cli_args.finite_non_negative)
top_p_value = cli_args.checked(float, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")
min_p_value = cli_args.checked(float, lambda v: 0 <= v < 1, "in [0, 1) (0 = off)")


budget_arg = cli_args.auto_or_positive_int
draft_vocab_arg = cli_args.draft_vocab
COUNTS_FILE = "token_counts.json"  # a drafter directory's token frequency table (jaxddtree.model.draft_vocab)

def id_list(text: str) -> list[int]:
    parts = [p for p in text.replace(" ", ",").split(",") if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Generate tokens with a Qwen3.5/3.6 target: autoregressive (ar), DFlash "
               "chain (dflash) or DDTree tree (ddtree) speculative decoding; at temperature 0 all three give the "
               "same tokens. Text is streamed as it is accepted, then a summary (tokens/s, mean acceptance "
               "length tau, rounds, time to first token) goes to stderr. With no --target, the demo pair in demo/ "
               "runs: a tiny Qwen3.6-style target trained on Python source and its trained DFlash drafter (a "
               "random pair if demo/ is absent).", epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="target checkpoint: HF directory (config.json + safetensors, "
                   "wrapper or text-only) or a converted directory. Default: the demo pair's target, demo/target.")
    p.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (config.json + model.safetensors). "
                   "Default: none; demo/drafter with the demo pair.")
    g = p.add_argument_group("prompt (exactly one; the demo pair has a default prompt)")
    g.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenised with the target directory's tokenizer "
                   "and, when it has one, its chat template (a single user turn)")
    g.add_argument("--prompt-ids", metavar="IDS", type=id_list, help="prompt token ids, comma-separated "
                   "(e.g. 1,2,3); no tokenizer or template is applied")
    g.add_argument("--chat", action="store_true", help="apply the chat template to --prompt as one user turn; a "
                   "tokenizer without one (the demo's) gets a minimal ChatML template (default: applied when the "
                   "tokenizer has a template)")
    g.add_argument("--system", metavar="TEXT", help="a system turn before the user turn (implies --chat)")
    think = g.add_mutually_exclusive_group()
    think.add_argument("--no-think", action="store_true", help="pass enable_thinking=False to the chat template: "
                       "Qwen3.6 answers without a thinking block first (implies --chat; default: neither flag, the "
                       "template's own default, which thinks for Qwen3.6)")
    think.add_argument("--enable-thinking", action="store_true", help="pass enable_thinking=True to the chat "
                       "template (implies --chat)")
    g.add_argument("--no-chat-template", action="store_true", help="tokenise --prompt as plain text "
                   "(default: apply the chat template when the tokenizer has one)")
    d = p.add_argument_group("decoding")
    d.add_argument("--method", choices=("ar", "dflash", "ddtree"), default=None, help="ar: autoregressive; "
                   "dflash: verify the drafter's block as a chain; ddtree: verify the best tree of --budget "
                   "drafted tokens (default: ddtree when a drafter is available, else ar; with --budget auto on a "
                   "device without a round-time table, ar when the warm-up, or an earlier run's (see --budget-costs), "
                   "measured it faster than every candidate)")
    d.add_argument("--budget", type=budget_arg, default="auto", metavar="N|auto", help="DDTree node budget: "
                   "drafted tokens verified per round, 1 <= N < vocab size; auto: each round takes the budget "
                   "(15, 31, 63, 127: trees of 16 / 32 / 64 / 128 rows) or the chain with the most expected tokens per second, from the drafter's "
                   "probabilities and a round-time table (--budget-costs; README: '--budget auto') (default: auto)")
    d.add_argument("--budget-costs", metavar="FILE", default=None, help="--budget auto's round times: a JSON "
                   "file with 'round_ms_by_budget_context' ({'chain'|'16'|...: {'<context>': ms}}, as "
                   "benchmarks/bench.py writes it) (default: benchmarks/results/h200.json on an H200; elsewhere each "
                   "candidate and AR timed at warm-up, printed, and kept in the --compile-cache directory "
                   "(budget-auto/): a later run with the same model, device and settings reuses it and compiles "
                   "only the method it chose; with --no-warmup a built-in model linear in tree rows and context)")
    d.add_argument("--drafter-fp8", action="store_true", help="the drafter's projections in FP8 (128 x 128 block "
                   "scales, as FP8 checkpoints store theirs; the target's W8A8 product): about half of what its "
                   "layers read; only the acceptance changes, never the output. dflash / ddtree only (default: off)")
    d.add_argument("--draft-vocab", type=draft_vocab_arg, default=None, metavar="N|FILE", help="draft only a "
                   "subset of the token ids: N, the N most frequent ids of the drafter directory's "
                   f"{COUNTS_FILE} (a frequency table: scripts/count_tokens.py writes one, the demo pair ships one), "
                   "or FILE, a JSON list or .npy array of token ids. The drafter scores only those, with the target's "
                   "lm_head weights of those ids gathered once at load (at Qwen3.6-27B the full lm_head is ~2.5 GB "
                   "of the ~6 GB a drafter call reads); the target still verifies every token, so only the "
                   "acceptance changes, never the output. dflash / ddtree only (default: off, every id)")
    d.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N", help="tokens to generate "
                   "at most (default: 256; 64 for the demo pair)")
    d.add_argument("--temperature", type=finite_non_negative, default=0.0, metavar="T", help="sampling "
                   "temperature; 0 = greedy: every token is the target's argmax for its prefix; in float32 all methods give "
                   "identical tokens, in bfloat16 dflash/ddtree take the argmax as the verify pass computes it, "
                   "which can differ from ar's one-row pass by bf16 rounding (default: 0.0)")
    d.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="sample from the K most "
                   "probable tokens only; 0 = off (default: 0). With --temperature > 0; every method samples "
                   "exactly from the truncated distribution")
    d.add_argument("--top-p", type=top_p_value, default=1.0, metavar="P", help="nucleus sampling: the smallest "
                   "set of most probable tokens whose probability reaches P, 0 < P <= 1; 1 = off (default: 1.0)")
    d.add_argument("--min-p", type=min_p_value, default=0.0, metavar="P", help="keep the tokens with probability "
                   ">= P times the most probable one's, 0 <= P < 1; 0 = off (default: 0.0). The three combine "
                   "(intersection), then the kept tokens are renormalised; ties with the last kept token stay. "
                   "e.g. --temperature 0.6 --top-p 0.95 --top-k 20 for Qwen's thinking mode")
    d.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: 0)")
    d.add_argument("--stop-ids", type=str, default=None, metavar="IDS", help="comma-separated token ids that "
                   "end generation (inclusive); 'none' disables (default: the tokenizer's/config's EOS ids)")
    r = p.add_argument_group("runtime")
    r.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="parameter/activation dtype "
                   "(default: float32 on CPU, bfloat16 on GPU)")
    r.add_argument("--kernels", choices=("xla", "pallas"), default=None, help="xla: jnp reference ops; pallas: "
                   "the GPU kernels (default: pallas on GPU, xla on CPU)")
    r.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor parallelism: split the target "
                   "over the first N devices (must divide its head counts, intermediate size and vocab; on a CPU "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices; default: 1)")
    r.add_argument("--loop", choices=("host", "device"), default="host", help="host: jitted calls of "
                   "--sync-every rounds, the next enqueued while the host streams the last one's tokens; device: all "
                   "rounds in one lax.while_loop, text printed at the end (default: host)")
    r.add_argument("--sync-every", type=positive_int, default=1, metavar="N", help="rounds per jitted call with "
                   "--loop host (default: 1)")
    r.add_argument("--no-warmup", action="store_true", help="skip the compile-only warm-up call; then time to "
                   "first token and tokens/s include compilation (default: warm up first)")
    r.add_argument("--compile-cache", metavar="DIR|none", default=None,
                   help="persistent XLA compilation cache directory: later runs with the same shapes load their "
                   "programs instead of compiling them (and --budget auto's measurement: see --budget-costs); none: "
                   "off (default: $JAXDDTREE_COMPILE_CACHE, else ~/.cache/jaxddtree/xla)")
    r.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line: tokens, "
                   "prompt_ids, text (when a tokenizer exists), acceptance_lengths, stats (no streaming). "
                   "Otherwise, on a terminal, the prompt is shown before the streamed text and stderr shows "
                   "what is loading or compiling")
    return p


# ------------------------------------------------------------------------------------------------ helpers
def import_jaxddtree():
    try:
        import jaxddtree  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import jaxddtree  # noqa: F401
    return sys.modules["jaxddtree"]


_status = False  # a transient status line is on the terminal


def status(msg: str):
    """A transient 'doing X ...' line on the terminal's stderr, replaced by the next output line."""
    global _status
    sys.stderr.write(f"\r\x1b[K{msg}")
    sys.stderr.flush()
    _status = True


def clear_status():
    """Remove the transient status line, if one is showing."""
    global _status
    if _status:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
    _status = False


def log(msg: str):
    global _status
    print(("\r\x1b[K" if _status else "") + msg, file=sys.stderr, flush=True)
    _status = False


# tokenizer helpers: jaxddtree/text.py (shared with the server), imported lazily (--help stays fast)
def _text():
    import_jaxddtree()
    from jaxddtree import text
    return text


def has_tokenizer(path: str) -> bool:
    return _text().has_tokenizer(path)


def load_hf_tokenizer(path: str):
    return _text().load_hf_tokenizer(path)


def ensure_chat_template(tok, flag: str):
    """Give a tokenizer without a chat template the minimal ChatML one (`flag` asked for a template)."""
    try:
        _text().ensure_chat_template(tok)
    except ValueError:
        raise UsageError(f"{flag} needs a transformers tokenizer (the random pair's byte tokenizer has no "
                         "chat template)") from None


def encode_prompt(tok, text: str, chat: bool, system: str | None = None, thinking: bool | None = None) -> list[int]:
    """Token ids of `text`: one user turn (after a `system` turn) through the chat template when `chat` and
    the tokenizer has one; `thinking` (None: the template's default) is passed as enable_thinking."""
    return _text().encode_prompt(tok, text, chat, system=system, thinking=thinking)


def show_prompt(text: str, out=sys.stdout):
    """The prompt before its streamed continuation, dimmed (plain with NO_COLOR set)."""
    out.write(text if os.environ.get("NO_COLOR") else f"\x1b[2m{text}\x1b[0m")
    out.flush()


class StreamPrinter:
    """Incremental detokenisation: re-decode the generated ids and print the new suffix; a trailing U+FFFD
    (an incomplete UTF-8 sequence) is held back until the next tokens complete it."""

    def __init__(self, tok, out=sys.stdout):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def __call__(self, new_ids):
        self.ids.extend(int(i) for i in new_ids)
        self._flush(final=False)

    def _flush(self, final: bool):
        text = self.tok.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        if text.startswith(self.shown):
            self.out.write(text[len(self.shown):])
            self.shown = text
        elif final:  # decoding changed earlier text (rare): show the rest from the common prefix
            k = os.path.commonprefix([text, self.shown])
            self.out.write(text[len(k):])
            self.shown = text
        self.out.flush()

    def close(self):
        self._flush(final=True)
        self.out.write("\n")
        self.out.flush()


def parse_stop_ids(text: str | None) -> list[int] | None:
    """None when --stop-ids is not given (then the defaults apply), [] for 'none'."""
    if text is None:
        return None
    if text.strip().lower() in ("none", ""):
        return []
    try:
        return id_list(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"argument --stop-ids: {e}") from None


def default_stop_ids(cfg, tok) -> list[int]:
    return _text().default_stop_ids(cfg, tok)


# ------------------------------------------------------------------------------------------------ main
def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt is not None and args.prompt_ids is not None:
        raise UsageError("give only one of --prompt and --prompt-ids")
    if args.prompt == "":
        raise UsageError("argument --prompt: empty prompt")
    if args.prompt_ids is not None and not args.prompt_ids:
        raise UsageError("argument --prompt-ids: no ids given")
    chat = _chat_flag(args)
    if chat and args.no_chat_template:
        raise UsageError(f"{chat} applies the chat template, --no-chat-template turns it off: give one of them")
    if chat and args.prompt_ids is not None:
        raise UsageError(f"{chat} applies to --prompt text, not to --prompt-ids")
    if args.target is None and args.drafter is not None:
        raise UsageError("--drafter needs --target (the demo pair brings its own drafter)")
    if args.target is not None and args.prompt is None and args.prompt_ids is None:
        raise UsageError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    for flag, path in (("--target", args.target), ("--drafter", args.drafter)):
        if path is not None and not os.path.isdir(path):
            raise UsageError(f"{flag} {path}: no such directory")
    if args.method in ("dflash", "ddtree") and args.target is not None and args.drafter is None:
        raise UsageError(f"--method {args.method} needs a drafter: pass --drafter DIR (or use --method ar)")
    max_new = args.max_new_tokens = args.max_new_tokens or (64 if args.target is None else 256)
    stops = parse_stop_ids(args.stop_ids)

    # ---- configs, tokenizer and weight files first, before jax is imported: every check they allow is one line
    # within a second or two of the start (jaxddtree's public names load lazily; the tokenizer needs no torch)
    jd = import_jaxddtree()
    from jaxddtree.checkpoint import builtin
    from jaxddtree.model.drafter_config import DrafterConfig
    label, tdir, ddir = None, args.target, args.drafter
    if tdir is None:  # the demo pair in demo/, else the random pair built in code
        demo = builtin.demo_dirs()
        label = builtin.DEMO_LABEL if demo else builtin.LABEL
        tdir, ddir = demo or (None, None)
        if args.prompt is None and args.prompt_ids is None:
            args.prompt = builtin.DEMO_PROMPT if demo else builtin.DEFAULT_PROMPT
    if args.method == "ar":
        ddir = None  # plain decoding: the drafter is neither read nor loaded
    if tdir is None:
        cfg, tok = builtin.target_config(), builtin.ByteTokenizer()
        dcfg = builtin.drafter_config() if args.method != "ar" else None
    else:
        cfg = jd.load_config(tdir)
        dcfg = DrafterConfig.from_pretrained(ddir) if ddir else None
        tok = load_hf_tokenizer(tdir) if has_tokenizer(tdir) else None
        if tok is None and args.prompt is not None:
            raise UsageError(f"--prompt needs a tokenizer, and {tdir} has none: use --prompt-ids")
    if chat:
        ensure_chat_template(tok, chat)
    method = args.method or ("ddtree" if dcfg is not None else "ar")
    _check_budget(args, cfg, method)
    _check_draft_vocab(args, cfg, method, ddir, tdir)
    if args.drafter_fp8 and method == "ar":
        raise UsageError("--drafter-fp8 changes how the drafter drafts: it needs --method dflash or ddtree")
    ids = _prompt_ids(args, tok)
    _check_prompt(args, cfg, ids)
    stops = default_stop_ids(cfg, tok) if stops is None else stops
    _check_stops(stops, cfg)
    for flag, path in (("--target", tdir), ("--drafter", ddir)):
        if path is not None:
            _check_weights(flag, path)

    import jax
    from jaxddtree import compile_cache
    cache_dir = compile_cache.enable(args.compile_cache, "generate.py")
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    kernels = args.kernels or ("xla" if backend == "cpu" else "pallas")
    if kernels == "pallas" and backend == "cpu":
        raise UsageError("--kernels pallas needs a GPU (the Pallas kernels do not run on the CPU backend); "
                         "use --kernels xla")
    from jaxddtree.model.drafter import check_compatible
    if dcfg is not None:
        check_compatible(dcfg, _ConfigOnly(cfg), source=ddir or "built-in drafter")
    from jaxddtree.model.sharding import check_tp, replicate
    try:
        check_tp(cfg, args.tp)
    except ValueError as e:
        raise UsageError(f"--tp: {e}") from None
    vocab_ids = None
    if args.draft_vocab is not None:  # the ids (from the file or the frequency table), checked before any weights
        from jaxddtree.checkpoint.load import draft_vocab_ids
        try:
            vocab_ids = draft_vocab_ids(_draft_vocab_value(args.draft_vocab), ddir or "", cfg.vocab_size)
        except ValueError as e:
            raise UsageError(f"argument --draft-vocab: {str(e).removeprefix('draft_vocab: ')}") from None

    for flag, path in (("--target", tdir), ("--drafter", ddir)):
        if path is not None:
            _check_converted(flag, path)

    # ---- the weights
    tty = sys.stderr.isatty() and not args.json
    say = status if tty else (lambda msg: None)
    if label:
        log(label)
    t_load = time.perf_counter()
    early = None  # a thread compiling the warm-up's programs while the weights load
    if tdir is None:
        pair = builtin.load_random(dtype)
        target, drafter = pair.target.shard(args.tp, consume=True), pair.drafter if method != "ar" else None
        if drafter is not None:
            drafter.params = replicate(drafter.params, target.mesh)
            if vocab_ids is not None:
                drafter = drafter.with_draft_vocab(vocab_ids, target)
    else:
        early = _compile_while_loading(args, cfg, dcfg, tdir, dtype, kernels, method, ids, max_new, vocab_ids)
        say(f"loading {tdir} ...")
        target = jd.load_target(tdir, dtype, progress=tty, tp=args.tp)
        drafter = None
        if ddir:
            say(f"loading {ddir} ...")
            drafter = jd.load_drafter(ddir, target, dtype, draft_vocab=vocab_ids)
    if drafter is not None and method != "ar" and args.drafter_fp8:
        drafter = drafter.to_fp8()
    target.kernels = kernels
    load_s = time.perf_counter() - t_load

    from jaxddtree.model.prefill import chunk_size, warmup_length
    from jaxddtree.speculative.loop import cache_positions
    # one cache capacity for the warm-up and the run: the warm-up's shorter prompt compiles the same programs
    cache_len = cache_positions(target, drafter, method, args.budget, len(ids), max_new, args.budget_costs)
    kw = dict(drafter=drafter if method != "ar" else None, method=method, max_new_tokens=max_new,
              tree_budget=args.budget, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, loop=args.loop,
              sync_every=args.sync_every, budget_costs=args.budget_costs, cache_len=cache_len)
    if not args.json:
        log(f"{method}" + (f" (budget {args.budget})" if method == "ddtree" else "") +
            (f", draft vocabulary of {len(vocab_ids)} ids" if vocab_ids is not None else "") +
            (", FP8 drafter" if args.drafter_fp8 else "") +
            f", {len(ids)} prompt tokens, max {max_new} new, T={args.temperature:g}, {dtype}, kernels={kernels}, "
            f"{backend}" + (f", tp={args.tp}" if args.tp > 1 else "") + f" (loaded in {load_s:.1f} s)")
    measured = None  # tokens/s at warm-up per candidate name, "ar" included
    from jaxddtree.speculative import budget as budget_lib
    probe = ids[:warmup_length(len(ids))]  # the warm-up prompt
    measure = (not args.no_warmup and method == "ddtree" and args.budget == "auto" and args.budget_costs is None
               and max_new >= MEASURE_MIN and budget_lib.shipped() is None)
    # no round-time table for this device (the CPU): each candidate and AR are timed after the warm-up, or were
    # timed by an earlier start with the same inputs (kept beside the compilation cache: then only the method
    # chosen is compiled)
    known = known_path = None
    if measure and cache_dir is not None:
        from jaxddtree.speculative import calibration
        known_key = calibration.key(target_dir=tdir, drafter_dir=ddir, settings=dict(
            dtype=dtype, kernels=kernels, tp=args.tp, drafter_fp8=args.drafter_fp8, probe=[int(i) for i in probe],
            measure_tokens=min(
                max_new, MEASURE_TOKENS), draft_vocab=None if vocab_ids is None else [int(i) for i in vocab_ids],
            **{k: v for k, v in kw.items() if k not in ("drafter", "method")}))
        known_path = calibration.path_for(cache_dir, known_key)
        known = calibration.load(known_path, known_key)
        if known is not None:
            method, measured = _use_measured(args, kw, budget_lib, *known, f"measured by an earlier run ({known_path})")
    compile_s = None
    if not args.no_warmup:  # same programs (a prompt of the same chunk width, the same caches); every token is a
        # stop id, so only the first is produced (on one device no round runs: the rounds go on compiling in the
        # background, and the real call streams its first token before it waits for them)
        say("compiling ...")
        t = time.perf_counter()
        if early is not None:
            early.join()
        jd.generate(target, probe, **kw, stop_ids=range(cfg.vocab_size))
        compile_s = time.perf_counter() - t
        if not args.json:
            from jaxddtree.speculative import precompile
            log(f"compiled in {compile_s:.1f} s" + (" (the rounds still compiling)" if precompile.in_flight() else ""))
    if measure and known is None:
        say("measuring the candidates ...")
        t = time.perf_counter()
        table, rates, ar_rate = _measure(jd, target, probe, kw, cfg, budget_lib)
        if known_path is not None:
            calibration.save(known_path, known_key, table, rates, ar_rate)
        method, measured = _use_measured(args, kw, budget_lib, table, rates, ar_rate,
                                         f"measured at warm-up ({time.perf_counter() - t:.1f} s)")

    printer = StreamPrinter(tok) if (tok is not None and not args.json) else None
    show_text = printer is not None and sys.stdout.isatty()  # the text continues the prompt: show it first, dimmed
    show_prefill = tty and len(ids) > 4 * chunk_size(len(ids))

    def prefill_progress(done, total):  # long prompts on a terminal: one transient line per chunk, then the prompt
        status(f"prefill: {done:,} / {total:,} prompt tokens ({time.perf_counter() - t:.1f} s)")
        if done == total:
            clear_status()
            if show_text:
                show_prompt(tok.decode(ids))
    if show_text and not show_prefill:
        show_prompt(tok.decode(ids))
    t = time.perf_counter()
    gen = jd.generate(target, ids, **kw, stop_ids=stops, on_tokens=printer,
                      on_prefill=prefill_progress if show_prefill else None)
    wall = time.perf_counter() - t
    text = tok.decode(gen.tokens) if tok is not None else None
    stats = dict(gen.stats)
    if measured is not None:
        stats["warmup_tokens_per_s"] = measured
    stats.update(wall_s=wall, load_s=load_s, compile_s=compile_s, prompt_tokens=len(ids), dtype=dtype,
                 kernels=kernels, backend=backend, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                 stop_ids=stops, loop=args.loop, target=target.source,
                 drafter=(getattr(drafter, "path", None) if method != "ar" else None),
                 draft_vocab=len(vocab_ids) if vocab_ids is not None and method != "ar" else None,
                 drafter_fp8=bool(args.drafter_fp8 and method != "ar"))
    if args.json:
        out = {"tokens": gen.tokens, "prompt_ids": [int(i) for i in ids]}
        if tok is not None:
            out["text"] = text
        out.update(acceptance_lengths=gen.acceptance_lengths, stats=stats)
        print(json.dumps(out, ensure_ascii=False), flush=True)
        return 0
    if printer is not None:
        printer.close()
    else:
        print(" ".join(map(str, gen.tokens)), flush=True)
    n = stats["new_tokens"]
    log(f"-- {n} tokens in {wall:.2f} s: {stats['tokens_per_s']:.1f} tokens/s after the first, "
        f"time to first token {stats['time_to_first_token_s'] * 1e3:.0f} ms, {stats['rounds']} rounds, "
        f"mean acceptance length tau = {stats['mean_acceptance_length']:.2f}" +
        (f", budgets {stats['budget_counts']}" if stats.get("budget_counts") else "") +
        (f" (ar at warm-up: {measured['ar']:.1f} tokens/s)" if measured is not None and method != "ar" else ""))
    return 0


def _use_measured(args, kw, budget_lib, table, rates, ar_rate, when: str):
    """Decode with the measured table, or with AR when --method was not given and no candidate beat it (the default
    is never slower than AR); one line says so. Updates `kw` -> (method, {name: tokens/s} with "ar" first)."""
    use_ar = args.method is None and ar_rate > max(rates.values())
    kw["budget_costs"] = table
    if use_ar:
        kw.update(method="ar", drafter=None, budget_costs=None)
    measured = {"ar": ar_rate, **{budget_lib.name(b): r for b, r in rates.items()}}
    if not args.json:
        log(f"--budget auto: {when}, tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in measured.items()) +
            (" -> ar (no speculative candidate beat it on this device)" if use_ar else
             " -> ddtree with these round times"))
    return kw["method"], measured


MEASURE_TOKENS = 32  # tokens per timed generation when --budget auto measures its candidates at warm-up
MEASURE_MIN = 8  # fewer new tokens: not worth measuring (the default model's table stays)


def _measure(jd, target, probe, kw, cfg, budget_lib):
    """--budget auto on a device without a round-time table: plain AR, then each candidate's auto round (forced by
    a table: data, so the warm-up's compilation serves them all), timed on the warm-up prompt (the faster of two
    runs; one when the first is under half the best rate so far). -> (the measured CostTable, {candidate:
    tokens/s}, AR's tokens/s)."""
    import jax

    base = dict(kw, max_new_tokens=min(kw["max_new_tokens"], MEASURE_TOKENS), stop_ids=[])
    best = [0.0]

    def timed(**over):
        runs = []
        for _ in range(2):
            runs.append(jd.generate(target, probe, **dict(base, **over)).stats)
            if (runs[-1]["new_tokens"] - 1) / runs[-1]["decode_s"] < best[0] / 2:
                break
        s = min(runs, key=lambda s: s["decode_s"])
        best[0] = max(best[0], (s["new_tokens"] - 1) / s["decode_s"])
        return s["rounds"], s["new_tokens"], s["decode_s"]

    _, n, secs = timed(method="ar", drafter=None, budget_costs=None)
    cands = budget_lib.candidates_for(cfg.vocab_size)
    table, rates = budget_lib.calibrate(lambda t: timed(budget_costs=t), cands, jax.devices()[0].device_kind)
    return table, rates, (n - 1) / secs


class _ConfigOnly:
    """Stand-in target for drafter compatibility checks before any weights are loaded."""

    def __init__(self, cfg):
        self.config = cfg


def _check_weights(flag: str, path: str):
    """The weight files' headers, before jax is imported: a directory without weights, a truncated or corrupt
    safetensors file is one line at once (the loaders check every tensor later)."""
    if os.path.isfile(os.path.join(path, "jaxddtree_checkpoint.json")):  # a `python -m convert` output: its
        return  # restore checks it
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise UsageError(f"{flag} {path}: no weights (expected *.safetensors files or a `python -m convert` "
                         "output)")
    from safetensors import safe_open
    for f in files:
        try:
            with safe_open(os.path.join(path, f), framework="numpy"):
                pass
        except Exception as e:
            raise UsageError(f"{flag} {os.path.join(path, f)}: not a readable safetensors file ({e})") from None


def _check_converted(flag: str, path: str):
    """A `python -m convert` output's parameter directory exists (after the argument checks, before the weights
    load and the warm-up's compile thread starts: a missing one once started it for nothing); its restore checks
    the rest (an unreadable marker included)."""
    from jaxddtree.checkpoint import orbax_format
    from jaxddtree.checkpoint.params import CheckpointError
    if not orbax_format.is_converted(path):
        return
    try:
        meta = orbax_format.read_marker(path)
    except CheckpointError:
        return
    try:
        orbax_format.params_dir_of(path, meta)
    except CheckpointError as e:
        raise UsageError(f"{flag} {e}") from None


def _check_budget(args, cfg, method: str):
    if args.budget_costs is not None and not os.path.isfile(args.budget_costs):
        raise UsageError(f"argument --budget-costs: no such file {args.budget_costs}")
    if method == "ddtree" and args.budget != "auto" and args.budget >= cfg.vocab_size:
        raise UsageError(f"argument --budget: must be < the vocabulary size {cfg.vocab_size}, got {args.budget}")


def _compile_while_loading(args, cfg, dcfg, tdir, dtype, kernels, method, ids, max_new, vocab_ids):
    """A thread compiling the warm-up call's programs for weights of the checkpoint's shapes (`loop.compile_call` on
    `abstract_target` / `abstract_params`) while the main thread loads them; None where the loaded pair's structure
    is not predicted (FP8 checkpoints, tensor parallelism, a draft vocabulary, an FP8 drafter) or there is no
    warm-up. A wrong prediction costs only the thread's work: the warm-up then compiles as usual."""
    import threading

    from jaxddtree.checkpoint.hf_target import fp8_format
    if args.no_warmup or args.tp > 1 or vocab_ids is not None or args.drafter_fp8 or fp8_format(tdir) is not None:
        return None
    from jaxddtree.model.drafter import Drafter, abstract_params
    from jaxddtree.model.prefill import warmup_length
    from jaxddtree.model.target import abstract_target, as_dtype
    from jaxddtree.speculative.loop import cache_positions, compile_call
    target = abstract_target(cfg, dtype)
    target.kernels = kernels
    drafter = (Drafter(config=dcfg, params=abstract_params(dcfg, as_dtype(dtype)), path="abstract")
               if dcfg is not None and method != "ar" else None)
    kw = dict(drafter=drafter, method=method, max_new_tokens=max_new, tree_budget=args.budget,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
              loop=args.loop, sync_every=args.sync_every, budget_costs=args.budget_costs,
              cache_len=cache_positions(target, drafter, method, args.budget, len(ids), max_new, args.budget_costs))

    def run():
        try:
            compile_call(target, ids[:warmup_length(len(ids))], **kw, stop_ids=range(cfg.vocab_size))
        except Exception:  # noqa: BLE001 (the warm-up compiles what this could not)
            pass
    thread = threading.Thread(target=run, name="precompile-early", daemon=True)
    thread.start()
    return thread


def _check_draft_vocab(args, cfg, method: str, ddir, tdir):
    """--draft-vocab's cheap checks (before jax): a speculative method, N within the vocabulary, a frequency table
    for N. The ids themselves are checked once jax is imported (`checkpoint.load.draft_vocab_ids`)."""
    n = args.draft_vocab
    if n is None:
        return
    if method == "ar":
        raise UsageError("--draft-vocab restricts what the drafter drafts: it needs --method dflash or ddtree")
    if isinstance(n, int):
        if n > cfg.vocab_size:
            raise UsageError(f"argument --draft-vocab: must be <= the vocabulary size {cfg.vocab_size}, got {n}")
        table = os.path.join(ddir, COUNTS_FILE) if ddir else None
        if table is None or not os.path.isfile(table):
            where = table or ("the built-in random pair" if tdir is None else "no drafter directory")
            raise UsageError(f"argument --draft-vocab: N needs a token frequency table ({where}: none; "
                             "scripts/count_tokens.py writes one), or give a FILE of token ids")


def _draft_vocab_value(value):
    """--draft-vocab's value as `load_drafter` takes it: N, or the ids read from FILE."""
    if isinstance(value, int):
        return value
    from jaxddtree.model import draft_vocab
    return draft_vocab.load(value)


def _check_stops(stops, cfg):
    bad = [s for s in stops or () if not 0 <= s < cfg.vocab_size]
    if bad:
        raise UsageError(f"argument --stop-ids: {bad} outside the vocabulary [0, {cfg.vocab_size})")


def _chat_flag(args) -> str | None:
    """The first flag that asks for the chat template, if any."""
    flags = (("--chat", args.chat), ("--system", args.system is not None), ("--no-think", args.no_think),
             ("--enable-thinking", args.enable_thinking))
    return next((f for f, on in flags if on), None)


def _prompt_ids(args, tok) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    thinking = False if args.no_think else (True if args.enable_thinking else None)
    ids = encode_prompt(tok, args.prompt, chat=not args.no_chat_template, system=args.system, thinking=thinking)
    if not ids:
        raise UsageError("the prompt is empty after tokenisation")
    return ids


def _check_prompt(args, cfg, ids):
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UsageError(f"prompt ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    max_new = args.max_new_tokens
    if len(ids) + max_new > cfg.max_position_embeddings:
        raise UsageError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({max_new}) exceeds the model's maximum "
                         f"length ({cfg.max_position_embeddings} positions)")


def main(argv=None) -> int:
    for stream in (sys.stdout, sys.stderr):  # generated text may not be encodable in the locale's encoding
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        return run(argv)
    except UsageError as e:
        log(f"{PROG}: error: {e}")
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # ConfigError, CheckpointError too
        msg = " ".join(str(e).split()) or type(e).__name__
        log(f"{PROG}: error: {msg}")
    except KeyboardInterrupt:
        log(f"{PROG}: interrupted")
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
