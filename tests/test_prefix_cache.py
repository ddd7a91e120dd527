"""The prefix cache's states (jaxddtree/speculative/prefix_cache.py) on the demo pair in fp32: a prefill resumed
from a snapshot reaches the cold prefill's caches and last logits (bit for bit from a grid point, where the chunk
ends coincide; to ~1e-6 from a prompt end inside a chunk), and the snapshot is unchanged by its use. The token-level
exactness through the server is in tests/test_serve.py; the demo's GDN layers forget fast, so only these state
comparisons catch a wrong GDN restore."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

S = 1024


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


def _prefill(pair, ids, start=None, on_chunk=None, grid=0, chunk=64):
    """(start state, last chunk's logits) of loop.Prefill (chunks of 64)."""
    from jaxddtree.speculative import loop as L

    t, d = pair.target, pair.drafter
    plan = L.make_plan(t, d.config, "ddtree", 16)
    p = L.Prefill(t, d, plan, np.asarray(ids), chunk, S, S, seed=0, stop_mask=np.zeros(t.config.vocab_size, bool),
                  temperature=0.0, max_new=4, start=start, grid=grid, on_chunk=on_chunk)
    logits = None
    while not p.advance():
        logits = p._logits
    return p.state, logits


def _diff(a, b, n):
    """Max |a - b| over two states' caches (attention / drafter rows below n)."""
    out = 0.0
    for x, y in zip(jax.tree.leaves((a.cache, a.dcache)), jax.tree.leaves((b.cache, b.dcache))):
        if x.ndim >= 4 and x.shape[-2] == S:  # KV [(G,) B, Hkv, S, hd]
            x, y = x[..., :n, :], y[..., :n, :]
        out = max(out, float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))))
    return out


@pytest.mark.parametrize("cut, want_p, exact", [(None, 300, False), (280, 256, True)],
                         ids=["prompt-end-inside-a-chunk", "grid-point"])
def test_resumed_prefill_reaches_the_cold_state(pair, cut, want_p, exact):
    from jaxddtree.speculative.prefix_cache import PrefixCache

    rng = np.random.default_rng(1)
    P = rng.integers(2, pair.target.config.vocab_size, 300)
    Q = np.concatenate([P if cut is None else P[:cut], rng.integers(2, pair.target.config.vocab_size, 50)])
    pc = PrefixCache(pair.target, pair.drafter, 1 << 30, grid=256)
    _prefill(pair, P, on_chunk=pc.recorder(P), grid=256)
    assert sorted(s.p for s in pc.snapshots()) == [256, 300]
    hit = pc.lookup(Q)
    assert hit.p == want_p
    before = [np.asarray(x).copy() for x in jax.tree.leaves(pc.arrays(hit))]
    warm, lw = _prefill(pair, Q, start=pc.build(hit, S), on_chunk=pc.recorder(Q), grid=256)
    cold, lc = _prefill(pair, Q, grid=256)
    after = jax.tree.leaves(pc.arrays(hit))
    assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(before, after))  # copy-on-write
    assert int(warm.cache.length) == int(cold.cache.length) == len(Q) == int(warm.dcache.length)
    d_state, d_logits = _diff(warm, cold, len(Q)), float(jnp.max(jnp.abs(lw - lc)))
    if exact:
        assert d_state == 0.0 and d_logits == 0.0
    else:
        assert d_state < 2e-5 and d_logits < 2e-5, (d_state, d_logits)
    assert int(warm.root[0]) == int(cold.root[0])
    # the resumed prefill's own snapshots share the hit's blocks
    assert len(pc) == 3 and pc.snapshots()[-1].p == len(Q) and pc.snapshots()[-1].blocks[0] is hit.blocks[0]


def test_lookup_never_takes_the_whole_prompt_and_evicts_lru(pair):
    from jaxddtree.speculative.prefix_cache import PrefixCache

    rng = np.random.default_rng(2)
    P = rng.integers(2, pair.target.config.vocab_size, 100)
    pc = PrefixCache(pair.target, pair.drafter, 1 << 30, grid=0)
    _prefill(pair, P, on_chunk=pc.recorder(P))
    assert pc.lookup(P) is None  # the last prompt token is always recomputed
    assert pc.lookup(np.concatenate([P, [5]])).p == 100
    assert pc.lookup(np.concatenate([P[:99], [P[99] + 1, 5]])) is None  # differs before the snapshot's end
    one = pc.bytes
    Q = rng.integers(2, pair.target.config.vocab_size, 100)
    pc.set_budget(int(one * 1.5))
    _prefill(pair, Q, on_chunk=pc.recorder(Q))
    assert len(pc) == 1 and np.array_equal(pc.snapshots()[0].ids, Q) and pc.bytes == one


def _gdn(cache):
    """The GDN states stacked per group position ([G, B, ...]), as a snapshot keeps them."""
    from jaxddtree.model.cache import GDNState

    return [x for c in cache.groups if isinstance(c, GDNState) for x in (c.conv, c.recurrent)]


def test_remembered_request_end_reaches_the_cold_state(pair):
    """The end of a finished request (`SlotPool.remember`: its prompt + completion prefilled from the prompt's
    snapshot, never admitted) is snapshotted with the GDN states and KV a cold prefill of prompt + completion
    reaches; the agent's next step resumes there and reaches the cold state of its own prompt. Nothing is done
    without the prompt's snapshot (min_hit) or when the end is already kept."""
    from jaxddtree.speculative.batch import SlotPool
    from jaxddtree.speculative.prefix_cache import PrefixCache

    t, d = pair.target, pair.drafter
    V = t.config.vocab_size
    rng = np.random.default_rng(3)
    P, C, new = (rng.integers(2, V, n) for n in (300, 45, 30))
    PC, Q = np.concatenate([P, C]), np.concatenate([P, C, new])
    pc = PrefixCache(t, d, 1 << 30, grid=256)
    pool = SlotPool(t, d, method="ddtree", max_batch=1, cache_len=S, tree_budget=16, prefix_cache=pc)
    assert pool.remember(PC, min_hit=len(P)) is None  # no snapshot of the prompt: the cost would be all of it
    _prefill(pair, P, on_chunk=pc.recorder(P), grid=256)
    lookups = pc.stats["lookups"]
    rem = pool.remember(PC, min_hit=len(P))
    assert rem.cached_tokens == len(P) and pc.stats["lookups"] == lookups  # (not counted as a request's)
    while not rem.prefilled:
        assert not rem.advance()
    assert rem._pre.state is None  # its start never ran
    assert sorted(s.p for s in pc.snapshots()) == [256, 300, 345]
    end = pc.snapshots()[-1]
    assert end.p == len(PC) and np.array_equal(end.ids, PC) and end.blocks[0] is pc.snapshots()[0].blocks[0]
    assert pool.remember(PC, min_hit=len(P)) is None  # kept already
    # the snapshot holds what a cold prefill of prompt + completion computes (GDN states, attention + drafter KV)
    cold_pc, _ = _prefill(pair, PC)
    kept, cold_gdn = pc.arrays(end)["gdn"], _gdn(cold_pc.cache)
    assert len(kept) == len(cold_gdn) and all(a.shape == b.shape for a, b in zip(kept, cold_gdn))
    d_gdn = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(kept, cold_gdn))
    assert d_gdn < 2e-5, d_gdn
    built = pc.build(end, S)
    rows = [(x[..., :len(PC), :], y[..., :len(PC), :])
            for x, y in zip(jax.tree.leaves(built), jax.tree.leaves((cold_pc.cache, cold_pc.dcache)))
            if x.ndim >= 4 and x.shape[-2] == S]
    assert len(rows) > 2 and max(float(jnp.max(jnp.abs(x - y))) for x, y in rows) < 2e-5
    # the next step hits the completion's end and reaches the cold state
    hit = pc.lookup(Q)
    assert hit is end
    warm, lw = _prefill(pair, Q, start=pc.build(hit, S))
    cold, lc = _prefill(pair, Q)
    assert _diff(warm, cold, len(Q)) < 2e-5 and float(jnp.max(jnp.abs(lw - lc))) < 2e-5
    assert int(warm.root[0]) == int(cold.root[0])
    # (the comparison catches a wrong GDN restore: the prompt end's states in place of the completion end's)
    bad = dataclasses.replace(end, state=next(s for s in pc.snapshots() if s.p == len(P)).state)
    wrong, _ = _prefill(pair, Q, start=pc.build(bad, S))
    assert _diff(wrong, cold, len(Q)) > 1e-3


def test_generate_with_a_prefix_cache(pair):
    """`generate(..., prefix_cache=)`: a second call whose prompt extends the first's (prompt + its tokens + new
    ones) resumes at the first prompt's end, reports it in stats["cached_tokens"], and returns the tokens of a
    call without the cache; a cache made for another drafter is refused."""
    import jaxddtree
    from jaxddtree.speculative.prefix_cache import PrefixCache

    t, d = pair.target, pair.drafter
    rng = np.random.default_rng(4)
    P = rng.integers(2, t.config.vocab_size, 120).tolist()
    kw = dict(drafter=d, method="ddtree", tree_budget=8, max_new_tokens=12, cache_len=S)
    pc = PrefixCache(t, d, 1 << 30, grid=0)
    g1 = jaxddtree.generate(t, P, prefix_cache=pc, **kw)
    assert g1.stats["cached_tokens"] == 0 and [s.p for s in pc.snapshots()] == [len(P)]
    Q = P + g1.tokens + rng.integers(2, t.config.vocab_size, 20).tolist()
    g2 = jaxddtree.generate(t, Q, prefix_cache=pc, **kw)
    cold = jaxddtree.generate(t, Q, **kw)
    assert g2.stats["cached_tokens"] == len(P) and cold.stats["cached_tokens"] == 0
    assert g2.tokens == cold.tokens
    assert sorted(s.p for s in pc.snapshots()) == [len(P), len(Q)]
    with pytest.raises(ValueError, match="another model"):
        jaxddtree.generate(t, Q, prefix_cache=PrefixCache(t, None, 1 << 30), **kw)


def test_pool_slots_reused_after_eviction(pair):
    """The blocks and states live in preallocated pools: with a budget of two blocks, one prompt's snapshots (its
    grid point and its end, sharing their first block) fill it, a second prompt's evict them (least recently used
    first) and reuse the freed slots, and a step resumed from the second prompt's end reaches the cold state (a
    slot written twice, or read from the wrong one, would not)."""
    from jaxddtree.speculative.prefix_cache import PrefixCache

    V = pair.target.config.vocab_size
    rng = np.random.default_rng(4)
    P, Q = rng.integers(2, V, 300), rng.integers(2, V, 300)
    pc = PrefixCache(pair.target, pair.drafter, 1 << 30, grid=256)
    _prefill(pair, P, on_chunk=pc.recorder(P), grid=256)
    assert sorted(s.p for s in pc.snapshots()) == [256, 300]
    sb, bb = pc.state_bytes, pc.block_bytes
    m = next(m for m in range(1, 1000) if pc._split(2 * bb + m * sb) == (2, m))
    pc.set_budget(2 * bb + m * sb)  # (smaller than the pools: no eviction yet, they fit)
    assert len(pc) == 2 and pc.bytes == 2 * bb + 2 * sb
    p_end = pc.snapshots()[-1]
    slots = {p_end.blocks[0].slot, p_end.tail.slot}
    _prefill(pair, Q, on_chunk=pc.recorder(Q), grid=256)
    assert [s.p for s in pc.snapshots()] == [256, 300] and all(np.array_equal(s.ids, Q[:s.p]) for s in pc.snapshots())
    q_end = pc.snapshots()[-1]
    assert {q_end.blocks[0].slot, q_end.tail.slot} == slots and pc.stats["evicted"] == 2 and pc.bytes <= pc.budget
    R = np.concatenate([Q, rng.integers(2, V, 40)])
    hit = pc.lookup(R)
    assert hit is q_end
    warm, lw = _prefill(pair, R, start=pc.build(hit, S), grid=256)
    cold, lc = _prefill(pair, R, grid=256)
    assert _diff(warm, cold, len(R)) < 2e-5 and float(jnp.max(jnp.abs(lw - lc))) < 2e-5
    assert int(warm.root[0]) == int(cold.root[0])


def test_resumed_prefill_of_a_few_tokens_runs_narrow_chunks(pair):
    """A prefill resumed with at most PREFILL_CHUNK tokens left runs chunks of that width when the prompt's are wider
    (a completion's few tokens: one 256-row pass, not a mostly padded 512- or 2048-row one) and reaches the cold
    state of the wide chunks; more tokens left keep the prompt's width."""
    from jaxddtree.model.prefill import PREFILL_CHUNK
    from jaxddtree.speculative import loop as L
    from jaxddtree.speculative.prefix_cache import PrefixCache

    V = pair.target.config.vocab_size
    rng = np.random.default_rng(5)
    P = rng.integers(2, V, 300)  # (padded chunks of 512 from 300 stay inside the S = 1024 rows)
    pc = PrefixCache(pair.target, pair.drafter, 1 << 30, grid=0)
    _prefill(pair, P, on_chunk=pc.recorder(P), chunk=512)
    shapes = []
    real = L.Prefill.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        shapes.append(self.shape)
    for left, width in ((100, PREFILL_CHUNK), (300, 512)):
        Q = np.concatenate([P, rng.integers(2, V, left)])
        hit = pc.lookup(Q)
        assert hit.p == 300
        L.Prefill.__init__ = spy
        try:
            warm, lw = _prefill(pair, Q, start=pc.build(hit, S), chunk=512)
        finally:
            L.Prefill.__init__ = real
        assert shapes[-1][0] == width
        cold, lc = _prefill(pair, Q, chunk=512)
        assert _diff(warm, cold, len(Q)) < 2e-5 and float(jnp.max(jnp.abs(lw - lc))) < 2e-5
        assert int(warm.root[0]) == int(cold.root[0])
