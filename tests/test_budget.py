"""tree_budget="auto" (jaxddtree/speculative/budget.py), on CPU with fake cost tables.

  * the expectation: a prefix of the largest tree is the best smaller tree, and 1 + the prefix sum of path
    probabilities is the exact expected accepted length when the target's tokens follow the draft marginals
    (enumerated over every continuation of a tiny vocabulary); likewise the chain's cumulative product;
  * cost tables: linear interpolation in the committed length, extrapolation, JSON / dict parsing, errors,
    the default model on CPU;
  * end to end on tiny models: auto == AR tokens at T = 0 with a fake cost table that forces several budgets
    (chain included) across the rounds of one generation, host and device loops; the per-round choice is in
    the stats; another table is data (no recompilation); T > 0 runs;
  * the compiled device loop does not copy the KV caches (the `lax.switch` over branches).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(HERE), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import helpers_dflash  # noqa: E402
import jaxddtree  # noqa: E402
from jaxddtree.speculative import budget as B  # noqa: E402
from jaxddtree.speculative import loop as loop_lib  # noqa: E402
from jaxddtree.speculative import tree as tree_lib  # noqa: E402

V = 97
BLOCK = 8
MAX_NEW = 40
PROMPTS = [np.random.RandomState(s).randint(0, V - 1, n).tolist() for s, n in ((0, 17), (1, 20), (2, 24))]


# ----------------------------------------------------------------------------------------- expectation
def _paths(tree):
    tok, par = np.asarray(tree.tokens), np.asarray(tree.parents)
    out = []
    for i in range(1, len(tok)):
        if not bool(np.asarray(tree.valid)[i]):
            out.append(None)
            continue
        p, j = [], i
        while j > 0:
            p.append(int(tok[j]))
            j = int(par[j])
        out.append(tuple(p[::-1]))
    return out


SMALL_BUDGETS = (1, 2, 5, 13, 26, 40)


# Built in one jit (one compilation shared by the seeds): built eagerly, every budget's tree and every truncation
# compiled its own op-by-op programs (2-core VM: 8.9 s for the three seeds).
@jax.jit
def _prefix_trees(logits):
    """(the budget-40 tree, per SMALL_BUDGETS b: the budget-b tree, the 40-tree truncated to b + 1 rows)."""
    big = tree_lib.build_tree(jnp.int32(3), logits, 40)
    return (big, [tree_lib.build_tree(jnp.int32(3), logits, b) for b in SMALL_BUDGETS],
            [B.truncate(big, b + 1) for b in SMALL_BUDGETS])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_prefix_is_the_best_smaller_tree(seed):
    logits = jax.random.normal(jax.random.key(seed), (5, 11)) * 2.0
    big, smalls, truncated = _prefix_trees(logits)
    paths = _paths(big)
    for b, small, t in zip(SMALL_BUDGETS, smalls, truncated):
        assert set(_paths(small)) == set(paths[:b])  # the same b prefixes
        par = np.asarray(t.parents)
        assert par.shape == (b + 1,) and all(0 <= par[i] < i for i in range(1, b + 1))


@functools.partial(jax.jit, static_argnums=1)
def _expectations(logits, budget):
    """(tree, tree expectations, chain expectation) in one jit (one compilation for the seeds, as above)."""
    tree = tree_lib.build_tree(jnp.int32(0), logits, budget)
    return tree, B.tree_expectation(tree, logits, tree_lib.ancestor_mask(tree)), B.chain_expectation(logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_expectation_is_exact_under_the_draft_marginals(seed):
    """Continuations x_1..x_D drawn from the per-depth marginals: E[accepted] = 1 + the deepest tree node
    matching x's prefix, enumerated over all V**D continuations."""
    D, Vs, budget = 3, 4, 20
    logits = jax.random.normal(jax.random.key(seed), (D, Vs)) * 1.5
    tree, got, chain = _expectations(logits, budget)
    got = np.asarray(got)
    p = np.asarray(jax.nn.softmax(logits.astype(jnp.float64) if jax.config.x64_enabled else logits), np.float64)
    paths = _paths(tree)
    for b in range(1, budget + 1):
        nodes = {q for q in paths[:b] if q is not None}
        want = 0.0
        for x in itertools.product(range(Vs), repeat=D):
            depth = max([d for d in range(1, D + 1) if x[:d] in nodes], default=0)
            want += np.prod([p[d, x[d]] for d in range(D)]) * (1 + depth)
        np.testing.assert_allclose(got[b - 1], want, rtol=1e-5)
    chain = float(chain)
    amax = p.argmax(-1)
    want = sum(np.prod([p[d, x[d]] for d in range(D)]) * (1 + next((d for d in range(D) if x[d] != amax[d]), D))
               for x in itertools.product(range(Vs), repeat=D))
    np.testing.assert_allclose(chain, want, rtol=1e-5)


def test_choose_and_scale():
    e, c = jnp.array([2.0, 4.0, 5.0]), jnp.array([1.0, 1.5, 2.5])
    lam0 = B.rate(jnp.zeros(4), e, c)
    assert float(lam0) == pytest.approx(4.0 / 1.5) and int(B.choose(e, c, lam0)) == 1  # first round: best ratio
    assert int(B.choose(e, c, 0.5)) == 2 and int(B.choose(e, c, 5.0)) == 0  # slow: buy tokens; fast: save ms
    assert float(B.rate(jnp.array([0.0, 0.0, 6.0, 4.0]), e, c)) == pytest.approx(1.5)
    assert float(B.scale(jnp.array([0.0, 0.0]))) == 1.0
    assert float(B.scale(jnp.array([8.0, 24.0]))) == pytest.approx(0.5)
    assert float(B.scale(jnp.array([1e6, 0.0]))) == B.S_MAX


# ----------------------------------------------------------------------------------------- cost tables
def test_verify_groups():
    """The auto round's switch: one branch per verify width; the chain shares the 16-row tree's (block 16)."""
    assert B.verify_groups(B.CANDIDATES, 16) == [[0, 1], [2], [3], [4]]
    assert B.verify_groups((B.CHAIN, 2, 7), 8) == [[0, 2], [1]]  # (the end-to-end tests below run this one)
    assert B.verify_groups((15, B.CHAIN), 8) == [[0], [1]]


def test_interpolation():
    t = B.from_dict({"chain": {"1000": 10.0, "3000": 14.0}, "64": {"1000": 20.0, "3000": 30.0}})
    assert t.candidates == (0, 64) and t.contexts == (1000, 3000)
    np.testing.assert_allclose(t.at(2000), [12.0, 25.0])
    np.testing.assert_allclose(t.at(5000), [18.0, 40.0])  # linear past the ends
    np.testing.assert_allclose(t.at(0), [8.0, 15.0])
    np.testing.assert_allclose(t.flat(2000).at(10 ** 6), [12.0, 25.0])  # one column: constant
    with pytest.raises(ValueError, match="no round time for budget 32"):
        t.subset((0, 32))


def test_tables_from_json_and_errors(tmp_path):
    p = tmp_path / "h200.json"
    p.write_text(json.dumps({"other": 1, B.TABLE_KEY: {"16": {"4096": 18.0}, "chain": {"4096": 17.0}}}))
    t = B.load(p)
    assert t.candidates == (0, 16) and t.ms == ((17.0,), (18.0,))
    assert B.resolve_costs(str(p), 97, 8).candidates == (0, 16)
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'round_ms_by_budget_context'"):
        B.load(tmp_path / "none.json")
    with pytest.raises(ValueError, match="lacks"):
        B.from_dict({"16": {"4096": 1.0}, "chain": {"8192": 1.0}})
    with pytest.raises(ValueError, match="> 0"):
        B.from_dict({"16": {"4096": 0.0}})
    with pytest.raises(ValueError, match="needs a candidate budget"):
        B.resolve_costs({"chain": {"1": 1.0}, "128": {"1": 2.0}}, 97, 8)  # 128 >= vocab


def test_default_model_on_cpu():
    t = B.resolve_costs(None, 248320, 16)
    assert t.candidates == B.CANDIDATES and t.source.startswith("default model")
    c = t.at(4096)
    row = lambda L: B.MODEL[2] + B.MODEL[3] * L  # ms per tree row at committed length L
    # fitted to chain 17.77 / 20.59 ms and 65 rows 20.83 / 28.14 ms at 4K / 128K; candidate 63 has 64 rows
    assert c[0] == pytest.approx(17.77, abs=0.05) and c[3] == pytest.approx(20.83 - row(4096), abs=0.05)
    assert list(c) == sorted(c)  # more rows cost more
    np.testing.assert_allclose(t.at(131072)[[0, 3]], [20.59, 28.14 - row(131072)], atol=0.05)
    assert B.resolve_costs(None, 97, 8).candidates == (0, 15, 31, 63)  # budgets < vocab only


def test_calibrate():
    """Measured round times per candidate, each timed under a table that forces it; a flat table auto accepts."""
    seen = []

    def run(table):  # a fake device: chain 5 ms per round, each tree row 0.1 ms more; 4 tokens per round
        b = min(table.candidates, key=lambda c: table.ms[table.candidates.index(c)][0])
        seen.append(b)
        ms = 5.0 if b == B.CHAIN else 5.0 + 0.1 * (b + 1)
        return 10, 41, 10 * ms / 1e3

    table, rates = B.calibrate(run, (0, 15, 63), "cpu")
    assert seen == [0, 15, 63] and table.candidates == (0, 15, 63) and table.source == "measured at warm-up (cpu)"
    np.testing.assert_allclose(table.at(10 ** 5), [5.0, 6.6, 11.4], rtol=1e-6)  # flat in the context
    assert rates[0] == pytest.approx(40 / 0.05) and rates[63] == pytest.approx(40 / 0.114)
    assert B.resolve_costs(table, 97, 8) == table
    with pytest.raises(ValueError, match="budget 15: no round"):
        B.calibrate(lambda t: (0, 1, 0.0), (15,), "cpu")


def test_measurement_kept_on_disk(tmp_path):
    """generate.py's warm-up measurement (speculative/calibration.py): saved and read back under its key; another
    setting, a changed model file or a corrupt file is a miss (the caller measures again)."""
    from jaxddtree.speculative import calibration as C
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    settings = dict(dtype="float32", probe=[1, 2, 3], cache_len=256, temperature=0.0, budget_costs=None)
    k = C.key(target_dir=str(model), drafter_dir=None, settings=settings)
    assert json.loads(json.dumps(k)) == k and k["drafter"] == "built-in random"
    path = C.path_for(str(tmp_path / "cc"), k)
    assert path.startswith(str(tmp_path / "cc" / C.SUBDIR)) and C.load(path, k) is None
    table, rates = B.calibrate(lambda t: (10, 41, 0.01 * (1 + min(t.candidates, key=lambda c: t.ms[
        t.candidates.index(c)][0]))), (0, 15, 63), "cpu")
    assert C.save(path, k, table, rates, 1234.5)
    got = C.load(path, k)
    assert got is not None
    t2, r2, ar = got
    assert t2.candidates == table.candidates and t2.contexts == table.contexts and ar == 1234.5
    np.testing.assert_allclose(t2.ms, table.ms)
    assert r2 == pytest.approx(rates)
    assert "earlier run" in t2.source
    k_other = C.key(target_dir=str(model), drafter_dir=None, settings=dict(settings, cache_len=512))
    assert C.path_for(str(tmp_path / "cc"), k_other) != path and C.load(path, k_other) is None
    os.utime(model / "config.json", ns=(1, 1))  # the model changed: another key
    assert C.key(target_dir=str(model), drafter_dir=None, settings=settings) != k
    with open(path, "w") as f:
        f.write("{not json")
    assert C.load(path, k) is None
    (tmp_path / "blocker").write_text("")  # a file where the directory goes: nothing saved, no error
    assert not C.save(str(tmp_path / "blocker" / C.SUBDIR / "x.json"), k, table, rates, 1.0)


# ----------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return helpers_dflash.tiny_pair(tmp_path_factory, "budget", V, BLOCK)


@pytest.fixture(scope="module")
def ar_ref(pair):
    target, drafter = pair
    return [jaxddtree.generate(target, p, method="ar", max_new_tokens=MAX_NEW).tokens for p in PROMPTS]


def forcing_table(prompt_len: int):
    """Chain cheapest for the first committed rows, then budget 2, then budget 7 (costs 1 vs 100 ms)."""
    a, b = prompt_len + 6, prompt_len + 18
    ctx = ["0", str(a), str(a + 1), str(b), str(b + 1), "1000"]
    lo, hi = 1.0, 100.0
    return {"chain": dict(zip(ctx, [lo, lo, hi, hi, hi, hi])), "2": dict(zip(ctx, [hi, hi, lo, lo, hi, hi])),
            "7": dict(zip(ctx, [hi, hi, hi, hi, lo, lo]))}


def run(pair, prompt, **kw):
    target, drafter = pair
    kw.setdefault("max_new_tokens", MAX_NEW)
    return jaxddtree.generate(target, prompt, drafter=drafter, method="ddtree", **kw)


@pytest.mark.parametrize("loop", ["host", "device"])
def test_auto_is_exact_and_follows_the_cost_table(pair, ar_ref, loop):
    for i, prompt in enumerate(PROMPTS):
        table = forcing_table(len(prompt))
        g = run(pair, prompt, budget_costs=table, loop=loop)
        assert g.tokens == ar_ref[i]
        chosen = g.stats["budget_per_round"]
        assert g.stats["tree_budget"] == "auto" and len(chosen) == g.stats["rounds"] == len(g.acceptance_lengths)
        assert chosen[0] == B.CHAIN and set(chosen) == {B.CHAIN, 2, 7}, chosen  # all three, in table order
        assert chosen == sorted(chosen, key=[B.CHAIN, 2, 7].index)
        assert sum(g.stats["budget_counts"].values()) == len(chosen)
        # long accepted paths (oracle draft logits): still exact
        go = run(pair, prompt, budget_costs=table, loop=loop, _oracle_tokens=ar_ref[i])
        assert go.tokens == ar_ref[i] and max(go.acceptance_lengths) > 3


def test_tables_are_data_and_sampling_runs(pair, ar_ref):
    prompt = PROMPTS[0]
    run(pair, prompt, budget_costs=forcing_table(len(prompt)))
    n = loop_lib.TRACES["rounds"]
    flat = {"chain": {"0": 5.0}, "2": {"0": 1.0}, "7": {"0": 50.0}}  # budget 2 always
    g7 = run(pair, prompt, budget_costs=B.forcing((0, 2, 7), 7))
    assert g7.tokens == ar_ref[0] and set(g7.stats["budget_per_round"]) == {7}
    g = run(pair, prompt, budget_costs=flat)
    assert g.tokens == ar_ref[0] and set(g.stats["budget_per_round"]) == {2}
    assert loop_lib.TRACES["rounds"] == n  # the same candidates: one compilation
    gs = run(pair, prompt, budget_costs=flat, temperature=0.8, seed=5)
    assert len(gs.tokens) == MAX_NEW and all(0 <= t < V for t in gs.tokens)
    assert set(gs.stats["budget_per_round"]) == {2}


def test_default_is_auto(pair, ar_ref):
    g = run(pair, PROMPTS[1])  # no tree_budget, no table: the default candidates and model
    assert g.tokens == ar_ref[1] and g.stats["tree_budget"] == "auto"
    assert set(g.stats["budget_per_round"]) <= {0, 15, 31, 63}
    assert g.stats["budget_costs"].startswith("default model")
    with pytest.raises(ValueError, match="tree_budget must be an int or 'auto'"):
        run(pair, PROMPTS[1], tree_budget="big")


def test_device_loop_does_not_copy_the_kv_caches(pair, monkeypatch):
    """The switch's branches each update the caches: the compiled device loop holds no copy of a KV-cache
    buffer, and no more top-level copies of cache-shaped buffers than the fixed-budget loop."""
    captured = {}
    orig = loop_lib.loop_fn

    def spy(*a, **kw):
        fn = orig(*a, **kw)

        def call(*args):
            captured["text"] = fn.lower(*args).compile().as_text()
            captured["cache"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args[2].cache)
            return fn(*args)
        return call

    monkeypatch.setattr(loop_lib, "loop_fn", spy)

    def top_level_copies(budget, costs):
        run(pair, PROMPTS[0], tree_budget=budget, budget_costs=costs, loop="device", max_new_tokens=8)
        text, cache = captured["text"], captured["cache"]
        kv = {f"f32{list(x.shape)}".replace(" ", "") for x in jax.tree.leaves(cache) if x.ndim >= 4
              and x.shape[-2] > 64}
        shapes = {f"f32{list(x.shape)}".replace(" ", "") for x in jax.tree.leaves(cache) if x.ndim >= 3}
        assert kv
        comp, kv_copies, copies = "", 0, 0
        for line in text.splitlines():
            m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
            if m and line.rstrip().endswith("{"):
                comp = m.group(1)
            m = re.search(r"= (f32\[[\d,]*\])\{[^}]*\} copy\(", line)
            if m and m.group(1) in shapes:
                kv_copies += m.group(1) in kv
                copies += "fus" not in comp  # fusion bodies: layout changes of values, not buffer copies
        return kv_copies, copies

    kv_auto, auto = top_level_copies("auto", {"chain": {"0": 1.0}, "2": {"0": 1.2}, "7": {"0": 1.5}})
    kv_fixed, fixed = top_level_copies(7, None)
    assert kv_auto == 0 and kv_fixed == 0
    assert auto <= fixed, (auto, fixed)


def test_padding_keeps_the_function():
    for table in ({"chain": {"1000": 10.0, "3000": 14.0}, "64": {"1000": 20.0, "3000": 30.0}},
                  {"chain": {"500": 3.0}, "16": {"500": 4.0}}):
        t = B.from_dict(table)
        x, y = B.padded(t)
        assert x.shape == (B.COLUMNS,) and y.shape == (2, B.COLUMNS)
        for L in (0, 700, 2000, 3000, 9000, 10 ** 5, 10 ** 6):
            np.testing.assert_allclose(B.interpolate(jnp.asarray(x), jnp.asarray(y), L), t.at(L), rtol=1e-5)


# ----------------------------------------------------------------------------------------- CLI / server
def _script(name):
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_script_budget", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["generate", "serve"])
def test_scripts_default_to_auto(name, capsys):
    p = _script(name).build_parser()
    assert p.parse_args([]).budget == "auto" and p.parse_args([]).budget_costs is None
    assert p.parse_args(["--budget", "AUTO"]).budget == "auto" and p.parse_args(["--budget", "32"]).budget == 32
    assert p.parse_args(["--budget-costs", "t.json"]).budget_costs == "t.json"
    with pytest.raises((SystemExit, Exception)) as e:  # generate.py raises its UsageError, serve.py exits
        p.parse_args(["--budget", "0"])
    assert "must be >= 1" in capsys.readouterr().err + str(e.value)
    assert "auto" in p.format_help() and "round_ms_by_budget_context" in p.format_help()


def test_engine_passes_the_table():
    from helpers_pool import FakePool
    from jaxddtree.checkpoint import builtin
    from jaxddtree.serving import engine as engine_lib

    seen = {}

    def factory(target, drafter, **kw):  # the engine's slot pool: only its arguments matter here
        seen.update(kw)
        return FakePool(target, drafter, **kw)

    pair = builtin.load_random("float32")
    costs = {"chain": {"0": 1.0}, "2": {"0": 1.0}, "7": {"0": 1.0}}
    e = engine_lib.Engine(pair.target, pair.drafter, None, budget="auto", budget_costs=costs, max_context=300,
                          stop_ids=[], pool_factory=factory)
    try:
        assert seen["tree_budget"] == "auto" and isinstance(seen["budget_costs"], B.CostTable)
        assert seen["budget_costs"] is e.budget_costs and seen["cache_len"] == e.cache_len
    finally:
        e.close()
    import inspect
    sig = inspect.signature(engine_lib.Engine.__init__).parameters
    assert sig["budget"].default == "auto" and sig["budget_costs"].default is None


def test_bench_auto_budget_smoke(tmp_path):
    """benchmarks/bench_auto_budget.py --smoke (made-up round times, the demo pair, one short prompt) writes
    auto_budget.<context>.{budget, projected_tok_s, best_fixed_tok_s} into --out, keeping what was there."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
    import bench_auto_budget

    out = tmp_path / "r.json"
    out.write_text(json.dumps({"round_ms_by_context": {"4096": 1.0}}))
    assert bench_auto_budget.main(["--smoke", "--out", str(out), "--contexts", "4096,131072"]) == 0
    res = json.loads(out.read_text())
    assert res["round_ms_by_context"] == {"4096": 1.0} and set(res["auto_budget"]) == {"4096", "131072"}
    for r in res["auto_budget"].values():
        assert r["budget"] in ("chain", "16", "32") and r["projected_tok_s"] > 0 and r["best_fixed_tok_s"] > 0
        assert r["best_fixed_tok_s"] == max(r["fixed_tok_s"].values())
        assert 0.5 < r["ratio"] < 1.5


def test_serve_rejects_a_bad_cost_table_before_loading(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{}")
    mod = _script("serve")
    for path, why in ((bad, "has no 'round_ms_by_budget_context'"), (tmp_path / "none.json", "cannot read")):
        with pytest.raises(SystemExit, match=f"argument --budget-costs: .*{why}"):
            mod.load_engine(mod.build_parser().parse_args(["--budget-costs", str(path)]))


def test_engine_sizes_caches_for_the_widest_candidate(pair, monkeypatch):
    from jaxddtree.serving import engine as engine_lib

    target, drafter = pair
    seen = []
    real = engine_lib.capacity
    monkeypatch.setattr(engine_lib, "capacity", lambda *a: seen.append(a) or real(*a))
    costs = {"chain": {"0": 1.0}, "2": {"0": 1.0}, "7": {"0": 1.0}}
    e = engine_lib.Engine(target, drafter, None, budget="auto", budget_costs=costs, max_context=300, stop_ids=[])
    try:
        assert isinstance(e.budget_costs, B.CostTable) and e.budget_costs.candidates == (B.CHAIN, 2, 7)
        assert seen == [(target, drafter.config, "ddtree", 7, 300, 0)]
    finally:
        e.close()
