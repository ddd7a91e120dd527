"""model/executables.py (issue 40, warm starts): the heavy programs a first call compiles are written to the store
and a later start (here: the same process with every in-process cache dropped; jaxlib's own deserialization
stood in for, see `store`) loads them without tracing or lowering them; the tokens are the same; a change of the
source or a damaged entry makes a compilation, never a wrong program. A tiny 4-layer pair of its own shapes (fp32,
CPU). The real load is measured on the GPU (bench_startup.py / serve_bench.py with a warm --compile-cache)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers_dflash
from jaxddtree.model import executables
from jaxddtree.model import target as target_mod
from jaxddtree.speculative import loop as loop_lib
from jaxddtree.speculative import precompile

LAYERS = 4
PROMPT = (np.arange(21) * 5 % 200 + 3).tolist()


@pytest.fixture(scope="module")
def pair():
    return helpers_dflash.builtin_pair(LAYERS, seed=5, last_tap=LAYERS - 2)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on, on the CPU, whose client cannot load a serialized executable into a process (`enable`): the
    stored bytes are real, loading them returns the executable that was serialized (kept in this process), so that
    everything but jaxlib's own deserialization is what a GPU start does."""
    from jax.experimental import serialize_executable
    kept, real = {}, serialize_executable.serialize

    def serialize(compiled):
        blob, in_tree, out_tree = real(compiled)
        kept[blob] = compiled
        return blob, in_tree, out_tree

    def load(blob, in_tree, out_tree):
        if blob not in kept:
            raise ValueError("not a program")
        return kept[blob]
    monkeypatch.setattr(serialize_executable, "serialize", serialize)
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", load)
    d = executables.enable(tmp_path / "executables", platforms=("cpu",))
    yield d
    executables.enable(None)


def new_process(target):
    """What a new start has: no program bound, nothing in jax's caches, nothing compiled by precompile."""
    precompile.ready()
    target_mod._SHARED.clear()
    jax.clear_caches()
    return dataclasses.replace(target)  # (a fresh `_bound`)


def gen(target, drafter, **kw):
    return loop_lib.generate(target, PROMPT, drafter=drafter, method="ddtree", tree_budget=6, max_new_tokens=20,
                             **kw)


def test_a_second_start_loads_without_tracing(pair, store, monkeypatch):
    target, drafter = pair
    first = gen(new_process(target), drafter)
    precompile.ready()
    files = sorted(p.name.split("-")[0] for p in store.glob("*.exe"))
    assert {"_prefill", "_start", "run_rounds"} <= set(files), files
    n0, traces = len(precompile.timings), loop_lib.TRACES["rounds"]
    again = gen(new_process(target), drafter)
    precompile.ready()
    assert again.tokens == first.tokens
    assert loop_lib.TRACES["rounds"] == traces  # loaded: never traced (nor lowered)
    loaded = {r["name"] for r in precompile.timings[n0:] if "load_s" in r and r["ok"]}
    assert {"_prefill", "_start", "run_rounds"} <= loaded, precompile.timings[n0:]
    # a damaged entry is dropped and compiled again (and written again)
    for p in store.glob("run_rounds-*.exe"):
        p.write_bytes(b"not a program")
    assert gen(new_process(target), drafter).tokens == first.tokens
    precompile.ready()
    assert loop_lib.TRACES["rounds"] == traces + 1
    # another source: other keys
    rounds = loop_lib.loop_fn(target, drafter.config, loop_lib.make_plan(target, drafter.config, "ddtree", 6), 1)
    args = (jax.ShapeDtypeStruct((3,), jnp.float32),)
    before = rounds.path(args)
    monkeypatch.setattr(executables, "_VERSION", "another source")
    assert rounds.path(args) != before and rounds.path(args).parent == before.parent


def test_program_runs_its_executable_only_for_its_shapes():
    f = executables.Program(jax.jit(lambda x: x * 2), key="double")
    a = jax.ShapeDtypeStruct((3,), jnp.float32)
    f.add((a,), jax.jit(lambda x: x * 3).lower(a).compile())  # (a different program, to see which one runs)
    assert f(jnp.ones(3)).tolist() == [3, 3, 3]
    assert f(jnp.ones(4)).tolist() == [2] * 4  # other shapes: the jitted function
    assert jax.jit(lambda x: f(x))(jnp.ones(3)).tolist() == [2, 2, 2]  # under a trace: the jitted function
    assert f._cache_size() >= 1 and f.__name__ == "<lambda>"


def test_prefill_programs_with_compiler_options_run_in_every_path(pair, monkeypatch):
    """The prefill programs carry XLA options on a GPU (`prefill_compiler_options`); jax refuses options on a jit
    called inside another trace (`precompile.shape_of`'s eval_shape, an outer program): `OptionedJit` runs the
    plain jit there. Here with an option the CPU accepts, through generate's precompiled path."""
    target, drafter = pair
    first = gen(new_process(target), drafter)
    monkeypatch.setattr(target_mod, "prefill_compiler_options", lambda: {"xla_embed_ir_in_executable": False})
    t = new_process(target)
    fn = t.prefill_fn((), "last")
    assert isinstance(fn.jitted, executables.OptionedJit) and fn.jitted.nested is not fn.jitted.optioned
    assert gen(t, drafter).tokens == first.tokens
    x = jnp.arange(6.0)
    f = executables.OptionedJit(lambda v: v * 2, {"xla_embed_ir_in_executable": False})
    assert jax.eval_shape(f, x).shape == (6,) and jax.jit(lambda v: f(v) + 1)(x).tolist() == [1, 3, 5, 7, 9, 11]
