"""scripts/generate.py as a subprocess (JAX_PLATFORMS=cpu): --help, the built-in default pair, a tiny HF
directory (tokens == the API), the chat template path, and bad arguments (exit code 2, one line on
stderr, no traceback).

Compilation dominates on CPU: subprocesses are started concurrently where they are independent (XLA
compiles on one core) and compile with XLA's cheap CPU settings (FAST_COMPILE: LLVM optimisation off,
which changes speed, not fp32 results: no fast-math either way).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import string
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import helpers_dflash  # noqa: E402
import hf_models  # noqa: E402
from jaxddtree.checkpoint import orbax_format  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "generate.py")
DEMO = os.path.join(ROOT, "demo")
V = 97
PROMPT_IDS = np.random.RandomState(5).randint(0, V - 1, 12).tolist()
MAX_NEW = 16
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
ENV.update(JAX_PLATFORMS="cpu", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
           TOKENIZERS_PARALLELISM="false", PYTHONIOENCODING="utf-8")
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def start(*args, fast: bool = False) -> subprocess.Popen:
    env = dict(ENV, XLA_FLAGS=FAST_COMPILE) if fast else ENV
    return subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode("utf-8"), err.decode("utf-8")


def cli(*args) -> tuple[int, str, str]:
    return finish(start(*args))


def last_json(rc, out, err) -> dict:
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def char_tokenizer(path: str):
    """A 97-token character-level fast tokenizer with a Qwen-style chat template (enable_thinking)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list(dict.fromkeys(string.ascii_letters + string.digits + " \n" + string.punctuation))
    vocab = {t: i for i, t in enumerate((specials + chars)[:V])}
    assert len(vocab) == V
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if not enable_thinking|default(false) %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"], chat_template=template)
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = {k: str(tmp_path_factory.mktemp(k)) for k in ("target", "drafter", "wide_drafter", "deep_drafter",
                                                       "empty", "cache")}  # cache: --compile-cache
    hf_models.save_text_only(hf_models.causal_lm(0), d["target"])
    d["tokenizer"] = char_tokenizer(d["target"])
    good = helpers_dflash.tiny_config(hidden=64, vocab=V, mask_token_id=V - 1, num_target_layers=4,
                                      target_layer_ids=(1, 2), block_size=8)
    helpers_dflash.write_checkpoint(d["drafter"], good, helpers_dflash.random_weights(good, seed=1))
    wide = helpers_dflash.tiny_config(hidden=48, vocab=V, mask_token_id=V - 1, num_target_layers=4,
                                      target_layer_ids=(1, 2))  # hidden size != the target's 64
    helpers_dflash.write_checkpoint(d["wide_drafter"], wide, helpers_dflash.random_weights(wide))
    deep = helpers_dflash.tiny_config(hidden=64, vocab=V, mask_token_id=V - 1, num_target_layers=None,
                                      target_layer_ids=(1, 9))  # the target has 4 layers
    helpers_dflash.write_checkpoint(d["deep_drafter"], deep, helpers_dflash.random_weights(deep))
    return d


def test_help_lists_every_flag():
    rc, out, err = cli("--help")
    assert rc == 0, err
    flags = [s for a in load_script().build_parser()._actions for s in a.option_strings if s.startswith("--")]
    expected = {"--target", "--drafter", "--prompt", "--prompt-ids", "--no-chat-template", "--enable-thinking",
                "--method", "--budget", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                "--seed", "--dtype", "--stop-ids",
                "--kernels", "--loop", "--json"}
    assert expected <= set(flags)
    for f in flags:
        assert f in out, f
    assert "examples:" in out and out.count("(default") >= 10


def test_help_describes_the_demo_pair():
    """The default pair is the trained pair in demo/ (--help once called it random, its output noise)."""
    rc, out, err = cli("--help")
    assert rc == 0, err
    assert "noise" not in out and "random demo" not in out
    assert "the demo pair in demo/ runs" in out and "demo/target" in out and "demo/drafter" in out


def test_builtin_default(tmp_path):
    """No --target: the built-in (trained demo) pair; --json puts one JSON object on the last stdout line, and
    the streamed text (no --json) is the same text. --budget auto on the CPU (no round-time table for it) times
    its candidates and AR at warm-up: the default method is AR unless a candidate beat it, and the summary names
    AR's rate beside DDTree's. The measurement is kept beside the compilation cache: the second run (--json,
    same key) reuses it instead of measuring (its rates are the first run's)."""
    cache = str(tmp_path / "cc")
    rc, out, err = finish(start("--max-new-tokens", 8, "--stop-ids", "none", "--compile-cache", cache, fast=True))
    assert rc == 0, err
    assert "built-in demo pair (demo/)" in err and "--budget auto: measured at warm-up" in err
    assert "tokens/s" in err and "tau" in err and "time to first token" in err
    chose = err.split("--budget auto: measured at warm-up")[1].splitlines()[0]
    assert chose.endswith("-> ar (no speculative candidate beat it on this device)") or (
        chose.endswith("-> ddtree with these round times") and "(ar at warm-up: " in err.splitlines()[-1]), err
    printed = dict(kv.rsplit(" ", 1) for kv in chose.split("tokens/s: ")[1].split(" -> ")[0].split(", "))
    assert len(os.listdir(os.path.join(cache, "budget-auto"))) == 1
    res = last_json(*finish(start("--max-new-tokens", 8, "--stop-ids", "none", "--json", "--compile-cache", cache,
                                  fast=True)))
    assert {"tokens", "text", "acceptance_lengths", "stats"} <= set(res)
    st = res["stats"]
    rates = st["warmup_tokens_per_s"]
    assert set(rates) == {"ar", "chain", "15", "31", "63", "127"} and min(rates.values()) > 0, rates
    assert {k: f"{v:.0f}" for k, v in rates.items()} == printed  # the first run's measurement, not a new one
    assert st["method"] == ("ar" if rates["ar"] > max(v for k, v in rates.items() if k != "ar") else "ddtree"), st
    assert st["method"] == ("ar" if "-> ar" in chose else "ddtree")
    assert len(res["tokens"]) == 8 and st["rounds"] == len(res["acceptance_lengths"]) >= 1
    for k in ("tokens_per_s", "mean_acceptance_length", "time_to_first_token_s"):
        assert st[k] >= 0
    assert out == res["text"] + "\n"  # streamed incrementally, then a newline


def test_tiny_hf_dir_matches_api(dirs):
    """CLI on an HF directory with --prompt-ids gives the tokens of jaxddtree.generate (AR here, the
    cheapest to compile; ddtree == ar at T = 0 is tests/test_generate.py's job). The default method is
    ddtree with a drafter, ar without; --stop-ids stops inclusively."""
    import jaxddtree

    common = ["--target", dirs["target"], "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens",
              MAX_NEW, "--json"]
    pa = start(*common, "--drafter", dirs["drafter"], "--budget", 4, "--stop-ids", "none", fast=True)
    target = jaxddtree.load_target(dirs["target"], "float32")
    ref = jaxddtree.generate(target, PROMPT_IDS, method="ar", max_new_tokens=MAX_NEW).tokens
    stop = ref[6]
    pb = start(*common, "--stop-ids", stop, fast=True)
    a, b = last_json(*finish(pa)), last_json(*finish(pb))
    assert a["stats"]["method"] == "ddtree" and a["stats"]["tree_budget"] == 4
    assert a["tokens"] == ref and len(a["tokens"]) == MAX_NEW
    assert a["stats"]["rounds"] == len(a["acceptance_lengths"]) and sum(a["acceptance_lengths"]) >= MAX_NEW - 1
    assert a["prompt_ids"] == PROMPT_IDS and a["text"] == dirs["tokenizer"].decode(ref)
    assert b["stats"]["method"] == "ar" and b["stats"]["stop_ids"] == [stop]
    assert b["tokens"] == ref[:ref.index(stop) + 1]  # inclusive stop


def test_prompt_text_chat_template(dirs):
    """--prompt goes through the directory's tokenizer and chat template (enable_thinking: the template's
    default, off for this one, unless --enable-thinking; --no-chat-template: plain text); default stop ids =
    the tokenizer's EOS."""
    tok = dirs["tokenizer"]
    msg = [{"role": "user", "content": "Hi there"}]

    def templ(thinking):
        return tok(tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=thinking), add_special_tokens=False)["input_ids"]

    proc = start("--target", dirs["target"], "--prompt", "Hi there", "--max-new-tokens", MAX_NEW, "--json",
                 "--no-warmup", "--compile-cache", dirs["cache"], fast=True)
    # the flag -> ids mapping, in process (one subprocess is enough for the plumbing)
    mod = load_script()
    cases = {(): templ(False), ("--enable-thinking",): templ(True),
             ("--no-chat-template",): tok("Hi there")["input_ids"]}
    assert templ(False) != templ(True)
    for extra, ids in cases.items():
        args = mod.build_parser().parse_args(["--target", dirs["target"], "--prompt", "Hi there", *extra])
        assert mod._prompt_ids(args, tok) == ids, extra
    res = last_json(*finish(proc))
    assert res["prompt_ids"] == templ(False)
    assert res["stats"]["stop_ids"] == [tok.eos_token_id]
    assert 1 <= len(res["tokens"]) <= MAX_NEW and res["text"] == tok.decode(res["tokens"])
    if len(res["tokens"]) < MAX_NEW:
        assert res["tokens"][-1] == tok.eos_token_id


def start_tty(*args) -> tuple[subprocess.Popen, int]:
    """Like `start(..., fast=True)`, with stdin, stdout and stderr on a pseudo-terminal of 120 columns (tqdm
    sizes its bar from it). Returns the process and the terminal's master end."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in ENV.items() if k != "NO_COLOR"}
    env["XLA_FLAGS"] = FAST_COMPILE
    proc = subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, env=env, stdin=slave, stdout=slave,
                            stderr=slave)
    os.close(slave)
    return proc, master


def finish_tty(proc: subprocess.Popen, master: int, timeout: float = 300) -> tuple[int, str]:
    """Everything the process wrote to the terminal (line ends as "\n") and its exit code."""
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", errors="replace").replace("\r\n", "\n")


CHAT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n"


def test_terminal():
    """Under a pseudo-terminal (where the loading bar once crashed): the demo pair as --target / --drafter
    directories (with --chat) and as the default pair run without a traceback; stderr shows each phase (the
    loading bar, then 'compiling ...' replaced by its time) and stdout the prompt, dimmed, before the
    generated text. (AR, the cheapest round to compile: the phases are the same for every method.)"""
    from jaxddtree.checkpoint import builtin
    runs = {CHAT: start_tty("--target", "demo/target", "--drafter", "demo/drafter", "--chat", "--system",
                            "Be brief.", "--no-think", "--prompt", "def f(x):", "--method", "ar",
                            "--max-new-tokens", 8, "--stop-ids", "none"),
            builtin.DEMO_PROMPT: start_tty("--method", "ar", "--max-new-tokens", 8, "--stop-ids", "none")}
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(runs, pool.map(lambda r: finish_tty(*r), runs.values())))
    for prompt, (rc, out) in results.items():
        assert rc == 0 and "Traceback" not in out, out
        assert re.search(r"loading target: 100%\|.*\| (\d+)/\1 ", out), out
        assert "compiling ...\r\x1b[Kcompiled in" in out, out
        shown = f"\x1b[2m{prompt}\x1b[0m"
        assert out.index("compiled in") < out.index(shown) < out.index("-- 8 tokens"), out


def test_chat_template(dirs):
    """--chat on the demo pair, whose tokenizer has no chat template: a minimal ChatML one (plain text: its
    vocabulary has no <|im_start|>), with --system; a tokenizer's own template is kept, and --no-think
    passes enable_thinking=False to it."""
    from transformers import AutoTokenizer
    mod = load_script()
    demo = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    assert not demo.chat_template and "<|im_start|>" not in demo.get_vocab()
    mod.ensure_chat_template(demo, "--chat")
    args = mod.build_parser().parse_args(["--chat", "--system", "Be brief.", "--prompt", "def f(x):"])
    assert mod._prompt_ids(args, demo) == demo(CHAT)["input_ids"]
    assert demo.decode(demo(CHAT)["input_ids"]) == CHAT  # what the terminal shows (test_terminal)
    own = AutoTokenizer.from_pretrained(dirs["target"])
    template = own.chat_template
    mod.ensure_chat_template(own, "--chat")
    assert own.chat_template == template
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    for flag, thinking in (("--no-think", False), ("--enable-thinking", True)):
        want = own(own.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=thinking), add_special_tokens=False)["input_ids"]
        args = mod.build_parser().parse_args(["--target", dirs["target"], "--system", "S", "--prompt", "Hi", flag])
        assert mod._prompt_ids(args, own) == want, flag


def test_errors_before_loading(dirs, tmp_path, capsys):
    """What the configs and the tokenizer can show is reported before any weights load: these target
    directories have none (the demo target without its safetensors, and as a converted directory without
    params), yet each run fails with its argument error (one line, exit code 2). In process: no weights,
    no compilation (a converted directory without params once started the warm-up's compile thread first)."""
    import threading
    hf, conv = tmp_path / "hf", tmp_path / "conv"
    shutil.copytree(os.path.join(DEMO, "target"), hf, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(hf, conv)
    with open(conv / "jaxddtree_checkpoint.json", "w") as f:
        json.dump({"format": "jaxddtree-orbax", "format_version": orbax_format.FORMAT_VERSION, "kind": "target",
                   "dtype": "float32"}, f)
    demo_drafter = os.path.join(DEMO, "drafter")
    cases = [
        (["--temperature", "inf"], "--temperature: must be a finite number >= 0, got inf"),
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0, got nan"),
        (["--top-p", "0"], "--top-p: must be in (0, 1] (1 = off), got 0"),
        (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k: must be >= 0 (0 = off), got -1"),
        (["--min-p", "1"], "--min-p: must be in [0, 1) (0 = off), got 1"),
        (["--min-p", "x"], "--min-p: expected a number"),
        (["--prompt", ""], "--prompt: empty prompt"),
        (["--chat", "--no-chat-template"], "--no-chat-template"),
        (["--no-think", "--enable-thinking"], "not allowed with"),
        (["--target", hf, "--prompt-ids", "1,2", "--system", "S"], "--system applies to --prompt text"),
        (["--budget", "100000"], "vocabulary size 2048"),  # the demo pair (its weights exist)
        (["--target", os.path.join(DEMO, "target"), "--prompt-ids", "1,2", "--tp", "3"], "--tp: tp=3 must divide"),
        (["--target", hf, "--drafter", demo_drafter, "--prompt", "x", "--budget", "5000"], "vocabulary size 2048"),
        (["--target", conv, "--drafter", demo_drafter, "--prompt", "x", "--budget", "5000"], "vocabulary size 2048"),
        (["--target", conv, "--prompt", "x", "--max-new-tokens", "5000"], "maximum length"),
        (["--target", hf, "--prompt-ids", "1,2", "--stop-ids", "4096"], "outside the vocabulary"),
        (["--target", conv, "--drafter", dirs["wide_drafter"], "--prompt-ids", "1"], "hidden_size"),
        (["--target", hf, "--prompt", "x"], "safetensors"),  # the weights are indeed missing
        (["--target", conv, "--prompt", "x"], "params"),
    ]
    mod = load_script()
    for args, needle in cases:
        assert mod.main([str(a) for a in args]) == 2, args
        assert not [t for t in threading.enumerate() if t.name.startswith("precompile-early")], args
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("generate.py: error: ") and needle in lines[0], (args, lines)


def bad_cases(d):
    t, ids = d["target"], ["--prompt-ids", "1,2,3"]
    return [
        (["--budget", "0"], "budget"),
        (["--budget", "5000"], "vocabulary size 2048"),  # built-in (demo pair) vocab
        (["--target", t, "--drafter", d["drafter"], *ids, "--budget", "97"], "vocabulary size 97"),
        (["--method", "beam"], "method"),
        (["--target", t, "--drafter", d["wide_drafter"], *ids], "hidden_size"),
        (["--target", t, "--drafter", d["deep_drafter"], *ids], "target_layer_ids"),
        (["--prompt", " ".join(str(i) for i in range(3000))], "maximum length"),
        (["--target", t, "--prompt-ids", ",".join(["1"] * 4000), "--max-new-tokens", "200"], "maximum length"),
        (["--target", "/nonexistent/model", *ids], "no such directory"),
        (["--target", t, "--drafter", "/nonexistent/drafter", *ids], "no such directory"),
        (["--target", d["empty"], *ids], "config.json"),
        (["--prompt", "a", *ids], "only one of --prompt and --prompt-ids"),
        (["--target", t], "give a prompt"),
        (["--target", t, "--method", "dflash", *ids], "needs a drafter"),
        (["--target", t, "--method", "ddtree", *ids], "needs a drafter"),
        (["--drafter", d["drafter"]], "--drafter needs --target"),
        (["--target", t, "--prompt-ids", "1,x"], "integers"),
        (["--prompt-ids", "1,5000"], "outside the vocabulary"),
        (["--stop-ids", "9999"], "outside the vocabulary"),
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--kernels", "pallas"], "needs a GPU"),
    ]


def test_bad_arguments(dirs):
    cases = bad_cases(dirs)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: cli(*c[0]), cases))
    for (args, needle), (rc, out, err) in zip(cases, results):
        shown = " ".join(a if len(a) < 40 else a[:20] + "..." for a in args)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2, f"{shown}: rc {rc}\n{err}"
        assert "Traceback" not in err, f"{shown}:\n{err}"
        assert len(lines) == 1, f"{shown}: expected one stderr line, got:\n{err}"
        assert lines[0].startswith("generate.py: error: "), f"{shown}: {lines[0]}"
        assert needle in lines[0], f"{shown}: '{needle}' not in: {lines[0]}"


# ------------------------------------------------------------------------------ start-up: what the user path imports
PROBE = """import json, runpy, sys
sys.argv = [{script!r}] + {argv!r}
rc = 0
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as e:
    rc = e.code
sys.stderr.write("PROBE " + json.dumps({{"rc": rc, "modules": sorted(m for m in ("torch", "transformers", "jax",
    "jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.triton") if m in sys.modules)}}) + "\\n")
"""


def start_probe(*args) -> subprocess.Popen:
    """generate.py in a process that reports, after it exits, which heavy packages it imported."""
    code = PROBE.format(script=SCRIPT, argv=[str(a) for a in args])
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(ENV, XLA_FLAGS=FAST_COMPILE),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_probe(proc) -> tuple[int, str, list[str], list[str]]:
    """-> (exit code, stdout, stderr lines other than the report, the heavy modules imported)."""
    rc, out, err = finish(proc)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    report = json.loads(lines[-1][len("PROBE "):])
    return report["rc"], out, lines[:-1], report["modules"]


def test_user_path_imports_no_torch(tmp_path):
    """torch is a test dependency only: generate.py on the demo pair (tokenizer, chat template, the run itself)
    imports neither torch nor transformers (transformers' configuration_utils imports torch: seconds of start-up),
    nor, on the CPU (kernels=xla), the GPU kernels' Pallas back ends (Mosaic GPU ≈ 0.5 s, Triton ≈ 0.2 s), and
    `--method ar` neither reads nor loads a drafter (here one whose config.json is broken)."""
    bad = tmp_path / "bad_drafter"
    bad.mkdir()
    (bad / "config.json").write_text("{broken")
    target = os.path.join(DEMO, "target")
    procs = {"demo": start_probe("--max-new-tokens", 2, "--no-warmup", "--json"),
             "chat_ar": start_probe("--target", target, "--drafter", bad, "--method", "ar", "--chat", "--prompt",
                                    "def f(x):", "--max-new-tokens", 2, "--no-warmup", "--json")}
    for name, p in procs.items():
        rc, out, err, modules = finish_probe(p)
        assert rc == 0, (name, err)
        assert modules == ["jax"], (name, modules)
        res = json.loads(out.strip().splitlines()[-1])
        assert len(res["tokens"]) == 2 and res["stats"]["method"] == ("ar" if name == "chat_ar" else "ddtree")
        if name == "chat_ar":
            assert res["stats"]["drafter"] is None and res["prompt_ids"][0] != res["prompt_ids"][1], res
    code = ("import sys\nfrom convert.cli import main\ntry:\n    main([sys.argv[1], sys.argv[2]])\n"
            "except SystemExit as e:\n    print(e.code, sorted(m for m in ('torch', 'transformers', 'jax') "
            "if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nowhere"), str(tmp_path / "dst")], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "2 []", (p.stdout, p.stderr)  # `python -m convert`'s argument errors: no jax either


def test_errors_come_before_jax(tmp_path):
    """Errors that need no model are one line before jax is imported: a truncated safetensors file, a directory
    without weights, a broken config.json, a prompt longer than the config's max_position_embeddings."""
    cut, empty, broken = tmp_path / "cut", tmp_path / "empty", tmp_path / "broken"
    shutil.copytree(os.path.join(DEMO, "target"), cut)
    f = cut / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    shutil.copytree(os.path.join(DEMO, "target"), empty, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(empty, broken)
    (broken / "config.json").write_text('{"model_type": ')
    ids = ["--prompt-ids", "1,2,3"]
    cases = {"truncated": (["--target", cut, *ids], str(f)),
             "no_weights": (["--target", empty, *ids], "no weights"),
             "config": (["--target", broken, *ids], "config.json"),
             "long_prompt": (["--target", os.path.join(DEMO, "target"), "--prompt-ids", ",".join(["1"] * 4095)],
                             "maximum length (4096 positions)"),
             "ar_drafter": (["--target", empty, "--drafter", os.path.join(DEMO, "drafter"), "--method", "ar", *ids],
                            "no weights")}
    procs = {k: start_probe(*args) for k, (args, _) in cases.items()}
    for name, p in procs.items():
        rc, out, err, modules = finish_probe(p)
        assert rc == 2 and len(err) == 1 and err[0].startswith("generate.py: error: "), (name, rc, err)
        assert cases[name][1] in err[0], (name, err[0])
        assert "jax" not in modules and "torch" not in modules, (name, modules)
