"""speculative/precompile.py (issue 40): a first `generate` call and a SlotPool's warm-up compile their heavy
programs side by side in threads, from abstract arguments, before running them; the real calls then compile none
of them (jax's in-process cache: same function, shapes and placements) and the tokens are AR's (fp32, T = 0).

A tiny 12-layer pair of its own shapes, so that no other test in the process has compiled its programs."""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers_dflash
from jaxddtree.speculative import loop as loop_lib
from jaxddtree.speculative import precompile
from jaxddtree.speculative.batch import Request, SlotPool, generate_many

HEAVY = ("_prefill", "drafter_forward", "_forward_many_jit", "_start", "run_rounds", "run_slots")
LAYERS = 12


@pytest.fixture(scope="module")
def pair():
    return helpers_dflash.builtin_pair(LAYERS, seed=3, last_tap=LAYERS - 2)


@contextlib.contextmanager
def compiles():
    """Backend compilations while the block runs, as {(thread kind, function name): count}."""
    seen = collections.Counter()

    def listen(event, secs, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            thread = "precompile" if threading.current_thread().name.startswith("precompile") else "main"
            seen[(thread, (fun_name or "").removeprefix("jit(").removesuffix(")"))] += 1
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def heavy(seen, thread):
    return {name: n for (t, name), n in seen.items() if t == thread and name in HEAVY}


PROMPT = (np.arange(30) * 7 % 250 + 1).tolist()


def test_first_generate_compiles_side_by_side(pair, monkeypatch):
    """... and the rounds compile in the background: the first token is streamed before the first round waits for
    them (`precompile.ready`)."""
    target, drafter = pair
    ar = loop_lib.generate(target, PROMPT, method="ar", max_new_tokens=24, precompile=False)
    streamed, waits, real_ready = [], [], precompile.ready

    def ready(fn=None):
        waits.append((list(streamed), getattr(fn, "__name__", None), id(fn) in precompile._pending))
        real_ready(fn)
    monkeypatch.setattr(precompile, "ready", ready)
    with compiles() as seen:
        g = loop_lib.generate(target, PROMPT, drafter=drafter, method="ddtree", tree_budget=8, max_new_tokens=24,
                              on_tokens=streamed.extend)
    assert heavy(seen, "main") == {}, seen  # every heavy program was ready when its call came
    assert set(heavy(seen, "precompile")) == {"_prefill", "drafter_forward", "_start", "run_rounds"}, seen
    assert g.tokens == ar.tokens == streamed
    assert waits == [([ar.tokens[0]], "run_rounds", True)], waits  # streamed, then waited for the background job
    assert g.stats["compile_wait_s"] >= 0
    with compiles() as seen:  # a second call: nothing compiled, nothing precompiled
        loop_lib.generate(target, PROMPT[:20], drafter=drafter, method="ddtree", tree_budget=8, max_new_tokens=24)
    assert heavy(seen, "main") == heavy(seen, "precompile") == {}, seen
    waits.clear()  # a first call whose first token ends it (generate.py's warm-up) runs no round: it does not wait
    w = loop_lib.generate(target, PROMPT, drafter=drafter, method="ddtree", tree_budget=4, max_new_tokens=24,
                          stop_ids=range(target.config.vocab_size))
    assert w.tokens == ar.tokens[:1] and waits == [], waits
    assert precompile.in_flight() <= 1  # (its rounds, still compiling or done)
    real_ready()


def test_pool_warmup_compiles_side_by_side(pair):
    target, drafter = pair
    pool = SlotPool(target, drafter, method="ddtree", max_batch=2, cache_len=512, tree_budget=6, max_group=2)
    stages = []
    with compiles() as seen:
        pool.warmup(PROMPT, progress=lambda d, n, what: stages.append(what), lengths=[len(PROMPT)])
    assert heavy(seen, "main") == {}, seen
    assert {"_prefill", "_forward_many_jit", "run_rounds", "run_slots"} <= set(heavy(seen, "precompile")), seen
    assert stages[0].startswith("the prefill and round programs (") and "side by side" in stages[0], stages
    # two requests joining (a batched round of 2 slots), the tokens AR's
    reqs = [Request(PROMPT, 20), Request(PROMPT[:25], 20)]
    with compiles() as seen:
        out = generate_many(target, reqs, drafter=drafter, method="ddtree", pool=pool)
    assert heavy(seen, "main") == {}, seen
    for r, g in zip(reqs, out):
        assert g.tokens == loop_lib.generate(target, r.ids, method="ar", max_new_tokens=20).tokens


def test_compile_all_drops_failures_and_duplicates():
    f = jax.jit(lambda x: x * 2)
    bad = jax.jit(lambda x: x.reshape(7))  # fails to trace for 6 elements: left to its real call
    a = jax.ShapeDtypeStruct((6,), jnp.float32)
    t0, n0 = time.perf_counter(), len(precompile.timings)
    assert precompile.compile_all([(f, (a,)), (f, (a,)), (bad, (a,))]) == 1
    recs = precompile.timings[n0:]  # each distinct job timed once, the failure too
    assert sorted(r["ok"] for r in recs) == [False, True]
    good = next(r for r in recs if r["ok"])
    assert good["name"] == "<lambda>" and good["compile_s"] > 0 and good["lower_s"] > 0 and good["ints"] == []
    assert next(r for r in recs if not r["ok"])["compile_s"] is None
    top = precompile.slowest(len(precompile.timings), since=t0)
    assert len(top) == len(precompile.timings) and any(r["start_s"] >= 0 for r in top)
    x = jnp.ones(6)
    with compiles() as seen:
        f(x)
    assert sum(seen.values()) == 0  # the duplicate was compiled once, and its real call found it


def test_a_program_in_flight_elsewhere_is_waited_for_not_compiled_again():
    """Two compile_all calls meeting one Program (a server's early thread and its warm-up): the second waits for the
    first's compilation instead of lowering and compiling it again, and counts it."""
    from jaxddtree.model.executables import Program
    fn = Program(jax.jit(lambda x: x + 1), key=None)
    a = jax.ShapeDtypeStruct((5,), jnp.float32)
    go, lowered, compiled = threading.Event(), [], []

    class Held:  # the first compilation holds until the second call has come
        def __init__(self, real):
            self.real = real

        def lower(self, *args):
            lowered.append(1)
            low = self.real.lower(*args)

            class Low:
                def compile(self):
                    go.wait(30)
                    compiled.append(1)
                    return low.compile()
            return Low()
    fn.jitted = Held(fn.jitted)
    out = {}
    first = threading.Thread(target=lambda: out.setdefault("first", precompile.compile_all([(fn, (a,))])))
    first.start()
    for _ in range(3000):
        if any(k[0] == id(fn) for k in precompile._in_flight):
            break
        time.sleep(0.01)
    second = threading.Thread(target=lambda: out.setdefault("second", precompile.compile_all([(fn, (a,))])))
    second.start()
    time.sleep(0.2)
    assert "second" not in out  # waiting for the first
    go.set()
    first.join(60)
    second.join(60)
    assert out == {"first": 1, "second": 1} and lowered == [1] and compiled == [1]
    assert fn.has((a,)) and not precompile._in_flight
    assert fn(jnp.ones(5)).tolist() == [2.0] * 5


def test_generate_script_compiles_while_loading(monkeypatch, capsys):
    """scripts/generate.py with checkpoint directories compiles its warm-up's programs for the checkpoint's shapes
    (`loop.compile_call` on `abstract_target` / `abstract_params`) while the weights load: the warm-up then finds
    every program compiled and none compiles on the main thread."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(root, "scripts", "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    real_all, real_call = precompile.compile_all, loop_lib.compile_call
    calls = []

    def compile_all(jobs, workers=None, **kw):
        n = real_all(jobs, workers, **kw)
        calls.append((threading.current_thread().name, n))
        return n
    abstract = []
    monkeypatch.setattr(precompile, "compile_all", compile_all)
    monkeypatch.setattr(loop_lib, "compile_call", lambda t, *a, **k: (abstract.append(t.source), real_call(t, *a, **k)))
    demo = os.path.join(root, "demo")
    with compiles() as seen:
        rc = mod.main(["--target", os.path.join(demo, "target"), "--drafter", os.path.join(demo, "drafter"),
                       "--prompt-ids", "5,6,7,8,9", "--method", "ddtree", "--budget", "5", "--max-new-tokens", "12",
                       "--compile-cache", "none", "--json"])
    capsys.readouterr()
    assert rc == 0 and abstract == ["abstract"]
    assert calls and calls[0][0] == "precompile-early", calls
    assert heavy(seen, "main") == {}, seen


def test_serve_compiles_while_loading(monkeypatch):
    """serve.py compiles the warm-up's single-slot programs (every prefill width, the start, the single-slot round)
    for the checkpoint's shapes while the weights load (`batch.single_slot_programs` on the abstract pair); its
    warm-up then compiles only the rest (groups, batched rounds), and nothing heavy on the main thread."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("serve_script", os.path.join(root, "scripts", "serve.py"))
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    real_all = precompile.compile_all
    calls = []

    def compile_all(jobs, workers=None, **kw):
        jobs = list(jobs)
        n = real_all(jobs, workers, **kw)
        calls.append((threading.current_thread().name, len(jobs), n))
        return n
    monkeypatch.setattr(precompile, "compile_all", compile_all)
    args = serve.build_parser().parse_args(["--max-batch", "2", "--prefix-cache-gb", "0", "--max-context", "320",
                                            "--budget", "4", "--compile-cache", "none"])
    with compiles() as seen:
        serve.load_engine(args)
    early = dict((c[0], c[1]) for c in calls)  # (the warm-up does not wait for the early thread: either may end first)
    assert sorted(early) == ["MainThread", "precompile-early"], calls
    assert early["precompile-early"] >= 3, calls  # widths, start, single-slot round
    assert heavy(seen, "main") == {}, seen
