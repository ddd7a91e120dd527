"""scripts/serve.py without the server's extra (fastapi / uvicorn missing): one line on stderr naming the install
command and exit code 2, before any model loads (no traceback). The missing module is simulated with a `None`
entry in sys.modules, which makes its import raise ModuleNotFoundError as an absent package does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "serve.py")
RUN = ("import runpy, sys; sys.modules[{mod!r}] = None; sys.argv = ['serve.py'] + {argv!r}; "
       "runpy.run_path({script!r}, run_name='__main__')")


def _serve_without(mod: str, *argv: str):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    code = RUN.format(mod=mod, argv=list(argv), script=SCRIPT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("mod", ["fastapi", "uvicorn", "prometheus_client"])
def test_missing_server_extra_is_one_line(mod):
    p = _serve_without(mod, "--port", "0")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("serve.py: error:") and mod in lines[0], lines[0]
    assert "pip install -e '.[serve]'" in lines[0], lines[0]
    assert p.stdout == ""


def test_missing_extra_checked_before_loading(monkeypatch, capsys):
    """In process: main() stops before load_engine (no model is loaded, nothing compiles); --help still works."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    monkeypatch.setattr(serve, "load_engine", lambda args: pytest.fail("load_engine ran"))
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(SystemExit) as e:
        serve.main(["--no-warmup"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[serve]" in err[0], err
    with pytest.raises(SystemExit) as e:
        serve.main(["--help"])
    assert e.value.code == 0


class _Device:
    """A device reporting memory statistics (the CPU reports none)."""
    device_kind = "Fake GPU"

    def __init__(self, free):
        self.free = free

    def memory_stats(self):
        return {"bytes_limit": self.free + 1000, "bytes_in_use": 1000}


def test_max_batch_memory_check():
    """--max-batch against the device's free memory: `peak_slots(N)` slots' caches + the reserve; auto = the
    largest power of two that fits; too many = one line naming --max-batch and the largest N that fits."""
    from jaxddtree.checkpoint import builtin
    from jaxddtree.serving import engine as E

    pair = builtin.load_random("float32")
    t, d = pair.target, pair.drafter
    cache_len, chunk = 1280, 256
    slot, reserve = E._slot_bytes(t, d, cache_len), E._reserve_bytes(t.config, chunk, 128)
    assert slot > t.cache_bytes(cache_len)  # the drafter's context cache counted too
    assert [E.peak_slots(n) for n in (1, 2, 4, 5, 8, 16)] == [2, 4, 7, 10, 13, 25]
    dev = _Device(reserve + E.peak_slots(5) * slot + slot // 2)  # 5 fit (10 slots' caches), 6 do not (11)
    n, mem = E.fit_max_batch(t, d, cache_len, 1024, chunk, "auto", device=dev)
    assert (n, mem["fits"], mem["peak_slots"]) == (4, 5, 7)
    assert E.fit_max_batch(t, d, cache_len, 1024, chunk, 5, device=dev)[0] == 5
    with pytest.raises(ValueError) as e:
        E.fit_max_batch(t, d, cache_len, 1024, chunk, 6, device=dev)
    msg = str(e.value)
    assert "\n" not in msg and "--max-batch 6 does not fit on Fake GPU" in msg and "at most --max-batch 5" in msg
    with pytest.raises(ValueError, match="not even one request fits .* lower --max-context"):
        E.fit_max_batch(t, d, cache_len, 1024, chunk, "auto", device=_Device(reserve + slot))
    assert E.fit_max_batch(t, d, cache_len, 1024, chunk, "auto", device=_Device(10 ** 15))[0] == E.AUTO_MAX_BATCH
    assert E.fit_max_batch(t, d, cache_len, 1024, chunk, 3, device=object())[0] == 3  # no statistics: unchecked
    tp2 = type("TP2", (), {"tp": 2})()  # tensor parallelism: one slot (batched rounds run on one device)
    assert E.fit_max_batch(tp2, None, cache_len, 1024, chunk, "auto", device=object())[0] == 1
    with pytest.raises(ValueError, match="--max-batch 2 needs --tp 1"):
        E.fit_max_batch(tp2, None, cache_len, 1024, chunk, 2, device=object())


def test_max_batch_argument():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    p = serve.build_parser()
    assert p.parse_args([]).max_batch == "auto"
    assert p.parse_args(["--max-batch", "AUTO"]).max_batch == "auto"
    assert p.parse_args(["--max-batch", "6"]).max_batch == 6
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            p.parse_args(["--max-batch", bad])


def test_prefix_cache_arguments_and_default_budget():
    """--prefix-cache-gb: GiB >= 0 (0: off), default None: 80% of what the slots' peak and the reserve leave, 1 GiB
    without memory statistics, off with --tp > 1; --prefix-cache-grid: tokens >= 1."""
    import importlib.util

    from jaxddtree.serving import engine as E

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    p = serve.build_parser()
    args = p.parse_args([])
    assert args.prefix_cache_gb is None and args.prefix_cache_grid == 8192
    assert p.parse_args(["--prefix-cache-gb", "0"]).prefix_cache_gb == 0
    assert p.parse_args(["--prefix-cache-gb", "2.5", "--prefix-cache-grid", "2048"]).prefix_cache_grid == 2048
    for bad in (["--prefix-cache-gb", "-1"], ["--prefix-cache-gb", "x"], ["--prefix-cache-grid", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    one = type("T", (), {"tp": 1})()
    mem = {"free_gib": 100.0, "peak_slots": 3, "slot_gib": 10.0, "reserve_gib": 5.0}
    assert E.prefix_cache_budget(None, mem, one) == int(65 * 0.8 * E.GIB)
    assert E.prefix_cache_budget(None, dict(mem, free_gib=20.0), one) == 0  # nothing left: off
    assert E.prefix_cache_budget(None, None, one) == int(E.CPU_PREFIX_CACHE_GIB * E.GIB)
    assert E.prefix_cache_budget(2, mem, one) == 2 * E.GIB and E.prefix_cache_budget(0, mem, one) == 0
    tp2 = type("TP2", (), {"tp": 2})()
    assert E.prefix_cache_budget(None, mem, tp2) == 0
    with pytest.raises(ValueError, match="--tp 1"):
        E.prefix_cache_budget(1, mem, tp2)


def _serve_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    return serve


def test_port_zero_names_the_bound_port():
    """--port 0: the socket is bound before the model loads and the announced URL carries the port the system
    chose (it once printed http://127.0.0.1:0/v1); a busy port is one line at once, before any model loads."""
    import socket

    serve = _serve_script()
    sock = serve.bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port != 0 and serve.url("127.0.0.1", sock) == f"http://127.0.0.1:{port}/v1"
        sock.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(SystemExit) as e:
            serve.bind("127.0.0.1", port)
        msg = str(e.value.code)
        assert msg.startswith("serve.py: error: cannot listen on 127.0.0.1:") and "\n" not in msg, msg
    finally:
        sock.close()
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--port", "70000"])


@pytest.mark.parametrize("script", ["serve.py", "generate.py"])
def test_help_examples_keep_their_line_breaks(script):
    """An example's continuation line stays a line of its own (a single backslash in the source once joined
    `--budget 64` and `--max-batch 16` into one long line)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("s", os.path.join(ROOT, "scripts", script))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = mod.EPILOG.splitlines()
    for i, line in enumerate(lines):
        assert len(line) <= 118 and "   " not in line.strip(), line
        if line.endswith("\\"):
            assert lines[i + 1].startswith("      "), (line, lines[i + 1])
    assert any(line.endswith(" \\") for line in lines)


def test_demo_engine_loads_without_torch_and_ar_without_drafter():
    """serve.py's load path on the demo pair (no warm-up) imports neither torch nor transformers (the tokenizer
    is jaxddtree.tokenizer's), and --method ar loads no drafter."""
    code = ("import sys, runpy\nserve = runpy.run_path({script!r})\n"
            "for argv in (['--no-warmup'], ['--no-warmup', '--method', 'ar']):\n"
            "    e = serve['load_engine'](serve['build_parser']().parse_args(argv))\n"
            "    print(e.method, e.drafter is None, e.name)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))").format(script=SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["ddtree False demo", "ar True demo", "[]"], (p.stdout, p.stderr)


def test_api_key_argument():
    """--api-key (repeatable) and $JAXDDTREE_API_KEY (comma-separated) together; an empty --api-key is one line."""
    serve = _serve_script()
    p = serve.build_parser()
    assert serve.api_keys(p.parse_args([]), environ={}) == []
    args = p.parse_args(["--api-key", "a", "--api-key", "b"])
    assert serve.api_keys(args, environ={}) == ["a", "b"]
    assert serve.api_keys(args, environ={serve.API_KEY_ENV: " c, ,d "}) == ["a", "b", "c", "d"]
    assert serve.api_keys(p.parse_args([]), environ={serve.API_KEY_ENV: ""}) == []
    with pytest.raises(SystemExit, match="--api-key: an empty key"):
        serve.api_keys(p.parse_args(["--api-key", " "]), environ={})


def test_draft_vocab_argument(tmp_path):
    """--draft-vocab N|FILE: the demo pair's drafter drafts only those ids (N from its frequency table); a bad
    value, a file of bad ids or --method ar is one line before any request (no warm-up here: nothing compiles)."""
    import importlib.util
    import json

    import numpy as np

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    p = serve.build_parser()
    for bad in (["--draft-vocab", "0"], ["--draft-vocab", "nofile.json"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    base = ["--max-batch", "1", "--prefix-cache-gb", "0", "--max-context", "256"]
    engine = serve.load_engine(p.parse_args(base + ["--draft-vocab", "64"]))
    assert engine.drafter.draft_vocab.size == 64
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 5, 7, 11]))
    got = serve.load_engine(p.parse_args(base + ["--draft-vocab", str(ids)])).drafter.draft_vocab
    assert sorted(np.asarray(got.ids)[np.asarray(got.ids) >= 0].tolist()) == [3, 5, 7, 11]
    ids.write_text(json.dumps([3, 3]))
    with pytest.raises(SystemExit, match=r"^serve.py: error: argument --draft-vocab: ids \[3\] given more than once"):
        serve.load_engine(p.parse_args(base + ["--draft-vocab", str(ids)]))
    with pytest.raises(SystemExit, match="needs --method dflash or ddtree"):
        serve.load_engine(p.parse_args(base + ["--draft-vocab", "64", "--method", "ar"]))


def test_drafter_fp8_argument():
    """--drafter-fp8: the demo pair's drafter with FP8 projections (`Drafter.to_fp8`); with --method ar one line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    p = serve.build_parser()
    base = ["--max-batch", "1", "--prefix-cache-gb", "0", "--max-context", "256"]
    assert not p.parse_args(base).drafter_fp8
    assert serve.load_engine(p.parse_args(base + ["--drafter-fp8"])).drafter.fp8
    with pytest.raises(SystemExit, match="--drafter-fp8 .* needs --method dflash or ddtree"):
        serve.load_engine(p.parse_args(base + ["--drafter-fp8", "--method", "ar"]))
