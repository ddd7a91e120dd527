"""Batched rounds and the slot pool (speculative/batch.py) on tiny fp32 models (CPU).

  * exact per slot: 3-4 requests at different prompt lengths, max_new, per-slot budgets and stop ids (one finishing
    while the others go on, one joining late into the freed slot) give each request's `generate` tokens at T = 0,
    AR / DFlash / DDTree, with long accepted paths (the `_oracle_tokens` hook, per slot);
  * sampling: a slot's tokens at T > 0 (its own seed, temperature, truncation) are exactly generate's alone at the
    same budget, whatever shares the batch; a T = 0 slot inside a sampling batch stays greedy;
  * one compilation per bucket, grow / shrink keep every slot's tokens, release() of a running slot;
  * the projections' batching rule (kernels_pallas.ops.dense under vmap: one GEMM / one pallas_call of B·rows).

Compile time dominates on CPU: every test reuses one pool configuration per method (MAX_NEW-sized caches).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import helpers_dflash
import jaxddtree
from jaxddtree.speculative import batch as batch_lib
from jaxddtree.speculative.batch import Request

V = 97
BLOCK = 8
MAX_NEW = 40
ORACLE = 64  # fixed oracle length (one compilation)
CACHE_LEN = 256
PROMPTS = [np.random.RandomState(s).randint(0, V - 1, n).tolist() for s, n in ((0, 17), (1, 20), (2, 24), (3, 9))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return helpers_dflash.tiny_pair(tmp_path_factory, "batch", V, BLOCK)


def alone(pair, prompt, method, budget=64, oracle=None, **kw):
    target, drafter = pair
    kw.setdefault("max_new_tokens", MAX_NEW)
    return jaxddtree.generate(target, prompt, drafter=drafter, method=method, tree_budget=budget,
                              cache_len=CACHE_LEN, _oracle_tokens=oracle, **kw)


@pytest.fixture(scope="module")
def ar_ref(pair):
    return [alone(pair, p, "ar").tokens for p in PROMPTS]


def padded(o):
    return (list(o) + [0] * ORACLE)[:ORACLE]


def pool(pair, method, max_batch=4, **kw):
    target, drafter = pair
    kw.setdefault("tree_budget", 64)
    return batch_lib.SlotPool(target, drafter, method=method, max_batch=max_batch, cache_len=CACHE_LEN,
                              _oracle_len=ORACLE, **kw)


def cut(tokens, stops):
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_exact_per_slot_join_and_leave(pair, ar_ref, method):
    """4 requests on 3 slots: different prompts, max_new, budgets, stop ids; request 1 stops early, request 3 joins
    late into its slot; every request's tokens are its AR tokens (cut at its stop / max_new)."""
    ar = ar_ref
    reqs = [Request(PROMPTS[0], MAX_NEW, tree_budget=7, oracle=padded(ar[0])),
            Request(PROMPTS[1], MAX_NEW, stop_ids=(ar[1][6],), oracle=padded(ar[1])),
            Request(PROMPTS[2], 25, tree_budget=3, oracle=padded(ar[2])),
            Request(PROMPTS[3], MAX_NEW, stop_ids=(ar[3][30], 96), oracle=padded(ar[3]))]
    want = [ar[0], cut(ar[1], {ar[1][6]}), ar[2][:25], cut(ar[3], {ar[3][30], 96})]
    p = pool(pair, method, max_batch=3)
    gens = batch_lib.generate_many(pair[0], reqs, pool=p, join_at=[0, 0, 1, 2])
    for i, (g, w) in enumerate(zip(gens, want)):
        assert g.tokens == w, f"{method} request {i}"
    if method != "ar":  # long accepted paths: far fewer rounds than tokens
        assert gens[0].stats["rounds"] < MAX_NEW // 2, gens[0].stats
        assert max(g.stats["mean_acceptance_length"] for g in gens) > 3
    assert gens[3].stats["joined"] >= 2  # it waited for a slot: joined after request 1 left
    if method == "ddtree":
        seen = {b for g in gens for b in g.stats["budgets"]}
        assert 3 in seen and 7 in seen  # per-slot budgets as data (bucket 4: budget 31 per slot)


def test_sampling_per_slot(pair, ar_ref):
    """DDTree at budgets 5 and 31 per slot (bucket 3: 31): a sampled slot's tokens (own seed, temperature, top_k /
    top_p) are exactly generate's alone at its budget whatever shares the batch (so the per-slot budget shapes its
    tree); a T = 0 slot in the sampling batch is greedy; two
    seeds differ. (3 slots: test_exact_per_slot_join_and_leave's ddtree pool compiled the bucket of 3 already;
    sampling is data in the batched round.)"""
    o = [padded(a) for a in ar_ref]
    hot = [Request(PROMPTS[0], MAX_NEW, temperature=1.0, seed=5, tree_budget=5, oracle=o[0]),  # inside bucket 31
           Request(PROMPTS[1], MAX_NEW, temperature=0.7, top_k=5, top_p=0.9, seed=9, tree_budget=31, oracle=o[1])]
    cold = Request(PROMPTS[2], MAX_NEW, tree_budget=31, oracle=o[2])
    other = Request(PROMPTS[3], MAX_NEW, temperature=1.0, seed=6, tree_budget=31, oracle=o[3])
    p = pool(pair, "ddtree", max_batch=3)
    g1 = batch_lib.generate_many(pair[0], hot + [cold], pool=p)
    g2 = batch_lib.generate_many(pair[0], [other, hot[1], hot[0]], pool=p)  # other neighbours, other slots
    assert g1[2].tokens == ar_ref[2]
    for i, r in enumerate(hot):
        want = alone(pair, r.ids, "ddtree", r.tree_budget, oracle=r.oracle, temperature=r.temperature, top_k=r.top_k,
                     top_p=r.top_p, seed=r.seed).tokens
        assert g1[i].tokens == want, f"request {i}"
    assert g2[2].tokens == g1[0].tokens and g2[1].tokens == g1[1].tokens
    assert g1[0].tokens != ar_ref[0] and g2[0].tokens != g1[0].tokens  # sampling happened


def test_one_compilation_per_bucket_and_release(pair, ar_ref):
    """Joins one by one (single -> bucket 2 -> bucket 4), a running slot released, leaves (4 -> 2 -> single): every
    remaining request keeps its AR tokens; a second pass through the same buckets compiles nothing. (The pool of
    test_warmup_compiles_everything, no oracle: one set of round programs for both tests.)"""
    target, drafter = pair
    p = batch_lib.SlotPool(target, drafter, method="dflash", max_batch=4, cache_len=CACHE_LEN, sync_every=2,
                           max_group=2)

    def run():
        hs = {}
        got = {}
        for i in range(4):  # join one per step
            hs[p.admit(p.prefill(Request(PROMPTS[i], MAX_NEW - 3 * i)))] = i
            for h, u in p.step().items():
                got.setdefault(hs[h], []).extend(u.tokens)
        victim = next(h for h, i in hs.items() if i == 1)
        p.release(victim)  # while running
        p.release(victim)  # twice: harmless
        p.release(12345)  # unknown: harmless
        live = {h for h in hs if h != victim}
        while live:
            for h, u in p.step().items():
                assert h != victim
                got.setdefault(hs[h], []).extend(u.tokens)
                if u.done:
                    p.release(h)
                    live.discard(h)
        assert p.step() == {} or True
        p.drain()
        for i in (0, 2, 3):
            assert got[i] == ar_ref[i][:MAX_NEW - 3 * i], f"request {i}"
        assert len(got[1]) < MAX_NEW - 3

    before = batch_lib.TRACES["slots"]
    run()
    mid = batch_lib.TRACES["slots"]
    assert mid - before <= 2  # buckets 2 and 4 (0 when another test compiled them)
    run()
    assert batch_lib.TRACES["slots"] == mid
    assert p.free() == 4


def test_bad_requests_rejected(pair):
    p = pool(pair, "ddtree", max_batch=2)
    for req, match in ((Request([], 4), "empty"), (Request([1, 2], 0), "max_new"),
                       (Request([1, 2], 4, temperature=-1), "temperature"), (Request([1, 2], 4, top_p=0), "top_p"),
                       (Request([1, 2], 4, stop_ids=(V,)), "stop_ids"), (Request([1, 2], 4, tree_budget=0), "budget"),
                       (Request([1, 2], CACHE_LEN), "cache_len")):
        with pytest.raises(ValueError, match=match):
            p.prefill(req)
    p.admit(p.prefill(Request([1, 2], 4)))
    p.admit(p.prefill(Request([1, 2], 4)))
    with pytest.raises(ValueError, match="no free slot"):
        p.admit(p.prefill(Request([1, 2], 4)))


def test_bucket_budgets():
    assert batch_lib.buckets(1) == () and batch_lib.buckets(8) == (2, 4, 8) and batch_lib.buckets(6) == (2, 4, 6)
    assert [batch_lib.bucket_budget(B) for B in (2, 4, 8, 16, 32)] == [63, 31, 15, 7, 7]
    assert batch_lib.bucket_budget(2, cap=20) == 20 and batch_lib.bucket_budget(8, cap=20) == 15


# ------------------------------------------------------------------------------------- one GEMM for all slots
def _count(text, op):
    return text.count(op)


def test_projection_dots_do_not_grow_with_slots(pair):
    """The batched round's HLO has as many dot ops for 4 slots as for 2 (each projection one GEMM of B·N rows)."""
    target, drafter = pair
    plan = batch_lib.batch_plan(target, drafter.config, "ddtree", 15)
    counts = []
    for B in (2, 4):
        p = batch_lib.SlotPool(target, drafter, method="ddtree", max_batch=B, cache_len=CACHE_LEN, tree_budget=15)
        for i in range(B):
            p.admit(p.prefill(Request(PROMPTS[i % 4], 4)))
        p._arrange()
        fn = batch_lib.slots_fn(target, drafter.config, plan, B, 1)
        txt = fn.lower(target.leaves, drafter.params, p._state, p._oracle).as_text()
        counts.append(_count(txt, "dot_general"))
    assert counts[0] == counts[1] and counts[0] > 0, counts


def _interpret(monkeypatch, module, name, calls=None):
    fn = getattr(module, name)

    def run(*a, **k):
        if calls is not None:
            calls.append(name)
        return fn(*a, **{**k, "interpret": True})
    monkeypatch.setattr(module, name, run)


def test_dense_folds_the_slot_axis(monkeypatch):
    """ops.dense / decode_row / dense of an FP8 weight under vmap (kernels="pallas", interpret mode): the values of
    per-slot calls, and ONE kernel call on the B·rows (not a pallas_call batched over a slot grid axis)."""
    from kernels_pallas import dense as dn
    from kernels_pallas import ops, w8a8
    monkeypatch.setattr(ops, "pick", functools.partial(ops.pick, gemv_rows=16, gemv_cols=1))  # tiny shapes: GEMV
    calls = []
    kernel = dn.dense
    monkeypatch.setattr(dn, "dense", lambda x2, w2, *a, **k: calls.append(x2.shape) or kernel(x2, w2, *a, **{
        **k, "interpret": True}))
    B = 3
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    x = (jax.random.normal(ks[0], (B, 1, 1, 64)) + 0.1).astype(jnp.bfloat16)
    w = (0.2 * jax.random.normal(ks[1], (64, 256))).astype(jnp.bfloat16)
    nw = (0.1 * jax.random.normal(ks[2], (64,))).astype(jnp.bfloat16)
    r = jax.random.normal(ks[3], (B, 1, 1, 256)).astype(jnp.bfloat16)
    f = lambda x, r: ops.dense("btd,dc->btc", x, w, "pallas", norm=(nw, 1e-6), residual=r)  # noqa: E731
    calls.clear()
    jaxpr = jax.make_jaxpr(jax.vmap(f))(x, r)
    # (custom_vmap traces the per-slot call once for its output shape) then ONE kernel call on all slots' rows:
    assert calls[-1] == (B, 64), calls
    assert str(jaxpr).count("pallas_call") == 1 and f"bf16[{B},64]" in str(jaxpr)
    got = jax.vmap(f)(x, r)
    want = jnp.stack([f(x[i], r[i]) for i in range(B)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # partials: a consumer of per-slot partials gets the same sums
    g = lambda x: ops.decode_row(x, w, "pallas", norm=(nw, 1e-6))  # noqa: E731
    pg, pw = jax.vmap(g)(x), jnp.stack([g(x[i]) for i in range(B)])
    assert pg.shape == pw.shape and pg.dtype == pw.dtype
    np.testing.assert_allclose(np.asarray(pg.astype(jnp.float32).sum(1)), np.asarray(pw.astype(jnp.float32).sum(1)),
                               rtol=1e-2, atol=1e-2)
    # without the fold (the kernel's own batching rule) the call would be per slot: the fold is what the test sees
    calls.clear()
    jax.make_jaxpr(jax.vmap(lambda x: dn.dense(x.reshape(1, 64), w)))(x)
    assert calls == [(1, 64)]
    # W8A8
    wcalls = []
    wk = w8a8.w8a8
    monkeypatch.setattr(w8a8, "w8a8", lambda x2, q, s, **k: wcalls.append(x2.shape) or wk(x2, q, s, **{
        **k, "interpret": True}))
    q = (0.2 * jax.random.normal(ks[1], (256, 64))).astype(jnp.float8_e4m3fn)  # [N, K]
    s = jnp.ones((2, 1), jnp.float32)
    h = lambda x: ops.dense("btd,dc->btc", x, q, "pallas", fp8=ops.Fp8(s, None, 64, 128, (64, 256)))  # noqa: E731
    if ops.pick("w8a8", 1, 256, "pallas", block_in=64).kernel == "w8a8":
        wcalls.clear()
        got = jax.vmap(h)(x)
        assert wcalls[-1] == (B, 64), wcalls
        want = jnp.stack([h(x[i]) for i in range(B)])
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6)


def test_pallas_batched_round_interpret(pair, ar_ref, monkeypatch):
    """kernels="pallas" (every kernel the tiny fp32 model takes, in interpret mode): the batched DDTree round vmaps
    (pallas_call's batching rule for the attention / GDN kernels: each slot reads its own cache) and two slots
    give their AR tokens."""
    import dataclasses
    from kernels_pallas import gdn_prefill, gdn_tree, prefill_attention, tree_attention
    calls = []
    for mod, name in ((tree_attention, "tree_attention"), (prefill_attention, "prefill_attention"),
                      (gdn_prefill, "gdn_chunked"), (gdn_tree, "gdn_masked_block")):
        _interpret(monkeypatch, mod, name, calls)
    target, drafter = pair
    tp = dataclasses.replace(target, kernels="pallas")
    n = 6
    reqs = [Request(PROMPTS[i], n, tree_budget=7, oracle=padded(ar_ref[i])) for i in (0, 1)]
    p = batch_lib.SlotPool(tp, drafter, method="ddtree", max_batch=2, cache_len=CACHE_LEN, tree_budget=7,
                           _oracle_len=ORACLE)
    gens = batch_lib.generate_many(tp, reqs, pool=p)
    for i, g in enumerate(gens):
        assert g.tokens == ar_ref[i][:n], f"slot {i}"
    assert gens[0].stats["budgets"][0] == 7
    assert {"tree_attention", "gdn_masked_block", "prefill_attention", "gdn_chunked"} <= set(calls)


@pytest.mark.parametrize("method,B,head_dim,budget", [("ddtree", 2, 32, 15), ("ddtree", 2, 64, 31), ("ar", 4, 32, 15)])
def test_batched_round_lowers_for_h200(method, B, head_dim, budget, monkeypatch):
    """The batched round with kernels="pallas" (bf16, bench.py's smoke shapes) traces and lowers for an abstract
    H200: the Pallas kernels' batching (attention / GDN: a slot grid axis; projections: folded rows) lowers. The
    GEMV's domain widened to these shapes, so that the AR step's per-slot projections take the split-K partials
    path (`ops.decode_row` into the fused GDN / attention decode kernels) and fold onto a GEMV of B rows. At head
    dim 64 and 32 tree rows per slot the verify's tree attention is the Mosaic GPU kernel (ops.MGPU_MIN_ROWS), its
    slot axis folded into its batch axis."""
    import dataclasses
    import functools
    from kernels_pallas import ops
    monkeypatch.setattr(ops, "pick", functools.partial(ops.pick, gemv_rows=8, gemv_cols=1))
    import bench
    from jaxddtree.model.config import text_config_from_dict
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.model.target import random_target
    from kernels_pallas._common import lower_for_h200
    raw, dfl = dict(bench.QWEN36_27B), dict(bench.DFLASH_27B)
    raw.update(bench.SMOKE_TARGET, head_dim=head_dim)
    dfl.update(bench.SMOKE_DFLASH)
    target = random_target(text_config_from_dict(raw, where="smoke"), "bfloat16")
    dcfg = DrafterConfig(**dfl) if method != "ar" else None
    drafter = bench.random_drafter(DrafterConfig(**dfl), jnp.bfloat16)
    plan = batch_lib.batch_plan(target, dcfg, method, budget)
    one = jax.eval_shape(lambda: bench.loop_state(target, drafter, plan, 64, 64))
    bst = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B,) + x.shape, x.dtype), one)
    if method == "ddtree":
        bst = bst.replace(budget=jax.ShapeDtypeStruct((B,), jnp.int32))
    pallas = dataclasses.replace(target, kernels="pallas")
    f = functools.partial(batch_lib.run_slots, graphdef=pallas.graphdef, treedef=pallas.treedef, dcfg=dcfg,
                          plan=dataclasses.replace(plan, kernels="pallas"), chunk=1)
    txt = lower_for_h200(f, pallas.leaves, drafter.params if dcfg else None, bst, jax.ShapeDtypeStruct((B, 1),
                                                                                                       jnp.int32))
    assert "triton" in txt
    # Mosaic GPU: the verify's projections of the stacked weights (dense_mgpu: > 8 rows here) and, at head dim 64,
    # the tree attention
    assert ("custom_call @mosaic_gpu" in txt) == (method != "ar" or head_dim == 64)


def _compiled_by_program(target) -> dict:
    """Compilations held by each of the target's bound jitted functions (rounds, prefill, start, the pool's helpers)
    and the drafter's forward."""
    from jaxddtree.model import drafter as drafter_mod
    fns = list(target._bound.items()) + [("drafter_forward", drafter_mod._forward_jit)]
    return {str(k)[:100]: f._cache_size() for k, f in fns if hasattr(f, "_cache_size")}


def _compiled(target):
    return sum(_compiled_by_program(target).values())


def test_warmup_lengths_compiles_only_their_widths(pair):
    """warmup(lengths=...) (what serve_bench.py passes): only the prefill widths of those prompt lengths; a
    length that fits no cache is a ValueError before anything compiles."""
    from jaxddtree.model.prefill import chunk_size, chunk_widths
    target, drafter = pair
    p = batch_lib.SlotPool(target, drafter, method="dflash", max_batch=2, cache_len=2 * CACHE_LEN, sync_every=2,
                           max_group=2)
    with pytest.raises(ValueError, match="fits the cache"):
        p.warmup(PROMPTS[0], lengths=[10 ** 6])
    fits = lambda n: batch_lib.loop_lib.capacity(target, p.dcfg, p.method, p.budget, n, 2)[1] <= 2 * CACHE_LEN
    all_widths = [w for w, n in chunk_widths(target.config.max_position_embeddings - 2) if fits(n)]
    assert len(all_widths) > 1, all_widths  # (else the filter below could not fail)
    seen = []
    p.warmup(PROMPTS[0], lengths=[len(PROMPTS[0]), len(PROMPTS[1])],
             progress=lambda done, total, what: seen.append(what))
    pre = [w for w in seen if w.startswith("prefill of")]
    assert len(pre) == 1 and pre[0].startswith(f"prefill of {chunk_size(len(PROMPTS[0]))}-token chunks"), seen
    assert seen[-1] == "2 slots: rounds, joins and leaves"


def test_warmup_compiles_everything(pair, ar_ref):
    """After warmup(), requests of every kind (greedy, sampled, truncated; joining, leaving, single and batched)
    compile nothing."""
    target, drafter = pair
    p = batch_lib.SlotPool(target, drafter, method="dflash", max_batch=4, cache_len=CACHE_LEN, sync_every=2,
                           max_group=2)
    seen = []
    p.warmup(PROMPTS[0], progress=lambda done, total, what: seen.append((done, total, what)))
    # one progress line per stage: the heavy programs side by side, each prefill width, then each slot-count bucket
    # (greedy and sampled: one program)
    assert [d for d, _, _ in seen] == list(range(1, len(seen) + 1)) and {t for _, t, _ in seen} == {len(seen)}
    assert seen[0][2].startswith("the prefill and round programs") and "prefill of" in seen[1][2]
    assert seen[-1][2] == "4 slots: rounds, joins and leaves"
    before = _compiled(target), batch_lib.TRACES["slots"], batch_lib.TRACES["rounds"], batch_lib.TRACES["start"]
    by_program = _compiled_by_program(target)
    reqs = [Request(PROMPTS[0], 12), Request(PROMPTS[1], 20, temperature=0.8, seed=3),
            Request(PROMPTS[2], 9, temperature=1.0, top_p=0.8, stop_ids=(ar_ref[2][3],)), Request(PROMPTS[3], 30),
            Request(PROMPTS[1][:5], 7, temperature=0.5, top_k=3)]
    gens = batch_lib.generate_many(target, reqs, pool=p, join_at=[0, 0, 1, 1, 3])
    assert gens[0].tokens == ar_ref[0][:12] and gens[3].tokens == ar_ref[3][:30]
    after = _compiled(target), batch_lib.TRACES["slots"], batch_lib.TRACES["rounds"], batch_lib.TRACES["start"]
    now = _compiled_by_program(target)
    assert after == before and before[0] > 0, {k: (by_program.get(k, 0), n) for k, n in now.items()
                                               if n != by_program.get(k, 0)}
    # three running in the bucket of 4, two leave at once: the last one goes single through the compiled resizes
    hs = [p.admit(p.prefill(Request(PROMPTS[i], 40))) for i in range(3)]
    p.step()
    p.step()
    p.release(hs[0])
    p.release(hs[1])
    p.step()
    p.release(hs[2])
    p.step()
    p.drain()
    # two prompts prefilled together (a group of 2) join a running request
    h = p.admit(p.prefill(Request(PROMPTS[3], 30)))
    p.step()
    ps = [p.prefill(Request(PROMPTS[i], 12)) for i in (1, 2)]
    p.group(ps)
    hs = [p.admit(x) for x in ps] + [h]
    for _ in range(3):
        p.step()
    for h in hs:
        p.release(h)
    p.step()
    p.drain()
    assert (_compiled(target), batch_lib.TRACES["slots"], batch_lib.TRACES["rounds"]) == before[:3]
    # one request alone runs generate's own compiled round (generate at the pool's cache_len and sync_every)
    g = jaxddtree.generate(target, PROMPTS[2], drafter=drafter, method="dflash", max_new_tokens=15,
                           cache_len=CACHE_LEN, sync_every=2, temperature=0.9, seed=1)
    assert batch_lib.TRACES["rounds"] == before[2] and len(g.tokens) == 15


def test_slot_bytes(pair):
    target, drafter = pair
    one = batch_lib.slot_bytes(target, drafter, CACHE_LEN)
    assert one == batch_lib.slot_bytes(target, None, CACHE_LEN) + sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(drafter.init_cache(1, CACHE_LEN)))
    assert batch_lib.slot_bytes(target, None, 2 * CACHE_LEN) > batch_lib.slot_bytes(target, None, CACHE_LEN)


def test_first_token_in_the_admitting_step(pair, ar_ref):
    """A request's first token comes back from the step() that admits it (alone and joining a running batch), not one
    call later; its later updates continue after it (no token twice)."""
    o = [padded(a) for a in ar_ref]
    p = pool(pair, "dflash", max_batch=4)
    got = {}
    h0 = p.admit(p.prefill(Request(PROMPTS[0], MAX_NEW, oracle=o[0])))
    first = p.step()  # nothing was in flight: only the first token
    assert first[h0].tokens == ar_ref[0][:1] and first[h0].rounds == 0
    got[h0] = list(first[h0].tokens)
    h1 = p.admit(p.prefill(Request(PROMPTS[1], MAX_NEW, oracle=o[1])))
    ups = p.step()
    assert ups[h1].tokens == ar_ref[1][:1] and ups[h1].rounds == 0  # joined a running request: still at once
    for h, u in ups.items():
        got.setdefault(h, []).extend(u.tokens)
    live = {h0, h1}
    while live:
        for h, u in p.step().items():
            got[h].extend(u.tokens)
            if u.done:
                p.release(h)
                live.discard(h)
    p.drain()
    assert got[h0] == ar_ref[0] and got[h1] == ar_ref[1]


def _leaves(state):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def test_prefill_group_matches_alone(pair):
    """Prompts prefilled together (loop.PrefillGroup: one pass per chunk for all, 3 chunks of 8 here) give every
    member the start state it gets alone (caches, first token, key, settings); prompts of other shapes refuse."""
    from jaxddtree.speculative import loop as loop_lib
    target, drafter = pair
    p = pool(pair, "ddtree")

    def pre(ids, seed, t):
        return loop_lib.Prefill(target, drafter, p.start_plan, np.asarray(ids), 8, CACHE_LEN, p.out_len, seed=seed,
                                stop_mask=np.zeros(V, bool), temperature=t, max_new=10)
    args = [(PROMPTS[0], 3, 0.0), (PROMPTS[1], 4, 1.0), (PROMPTS[2], 5, 0.5)]  # 17 / 20 / 24 tokens: 3 chunks each
    solo = [pre(*a) for a in args]
    for s in solo:
        while not s.advance():
            pass
    grp = [pre(*a) for a in args[:2]] + [pre(PROMPTS[2], 5, 0.5)]
    loop_lib.PrefillGroup(grp)
    assert not grp[2].advance() and not grp[0].advance()  # two passes, any member drives the group
    while not grp[1].advance():
        pass
    for i, (a, b) in enumerate(zip(solo, grp)):
        la, lb = _leaves(a.state), _leaves(b.state)
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"member {i}")
    assert int(np.asarray(grp[0].state.root)[0]) == int(np.asarray(solo[0].state.root)[0])
    with pytest.raises(ValueError, match="shapes"):  # 9 tokens: 2 chunks of 8
        loop_lib.PrefillGroup([pre(PROMPTS[0], 0, 0.0), pre(PROMPTS[3], 0, 0.0)])


def test_group_joins_exact(pair, ar_ref, method="ddtree"):
    """Four requests prefilled as one group (SlotPool.group) join a running request at once: every request's tokens
    are its AR tokens; the pool refuses a group size it does not compile."""
    o = [padded(a) for a in ar_ref]
    p = pool(pair, method, max_batch=8, max_group=4)
    assert p.group_sizes(20) == (2, 4)
    got = {}
    h0 = p.admit(p.prefill(Request(PROMPTS[3], MAX_NEW, oracle=o[3])))
    got[h0] = list(p.step()[h0].tokens)
    ps = [p.prefill(Request(PROMPTS[i], MAX_NEW - 5 * i, oracle=o[i])) for i in range(4)]  # 17, 20, 24, 9 tokens
    with pytest.raises(ValueError, match="cannot prefill together"):
        p.group(ps[:3])
    p.group(ps)
    hs = {p.admit(x): i for i, x in enumerate(ps)}
    live = set(hs) | {h0}
    while live:
        for h, u in p.step().items():
            got.setdefault(h, []).extend(u.tokens)
            if u.done:
                p.release(h)
                live.discard(h)
    p.drain()
    assert got[h0] == ar_ref[3]
    for h, i in hs.items():
        assert got[h] == ar_ref[i][:MAX_NEW - 5 * i], f"{method} member {i}"
