"""Prefix caching for the hybrid target (issue 39): a request whose prompt starts with a cached prefix resumes its
prefill there instead of at position 0.

A Gated-DeltaNet layer's state (conv + fp32 recurrent) is valid at one position only, so the cache keeps
**snapshots**: the GDN states of every GDN layer at a position p, taken where a prefill chunk ends anyway (the end
of each prompt, and every `grid` tokens inside a long prompt, where `model.prefill.chunk_bounds` ends a chunk), with
the attention KV and the drafter's context KV of positions [0, p). The KV lives in **blocks** of BLOCK tokens (every
attention layer's and drafter layer's K and V rows of the block), keyed by a chained digest of the token ids up to
the block's end and shared by every snapshot whose prefix holds them (a snapshot at p not on the block grid owns
its partial last block, its `tail`).

**Pools**: the blocks and the states live in two device arrays made once, at the first snapshot (paged, as vLLM's
KV blocks): `budget` bytes split into STATE_SHARE for states (at least one) and the rest for blocks; block slot 0
stays zero (the padding of a build). So a snapshot is slot numbers, its store is one dispatch per KB new blocks
(a gather from the request's caches scattered into the pool), and a hit's restore is ONE dispatch per request
whatever its length (a gather of its blocks into fresh caches; measured on the H200 at 27B shapes, 2026-12-03: one
dispatch per block, as before, took 0.26-1.4 s at 128K).

Lookup: the deepest snapshot whose token ids are exactly the prompt's first p tokens, with p <= len(prompt) - 1 (the
last prompt token is always recomputed: its logits draw the first token). A hit **copies** the snapshot into the
request's own fresh caches (`build`), so entries are immutable (copy-on-write) and no running request ever reads
one: eviction (least recently used snapshot first, until the new snapshot's blocks and state fit; a block goes with
the last snapshot that uses it) never touches a running request. A snapshot that does not fit alone is not kept.

Exactness: the resumed prefill ends its chunks where a cold prefill of the same prompt ends them (multiples of the
chunk width counted from position 0, `chunk_bounds`), so a hit on the grid reproduces the cold prefill's shapes; a
hit at a prompt end (not on the grid) regroups the first chunk's tokens (equal in exact arithmetic; in fp32 the
logits agree to ~1e-6, tests/test_serve.py compares the tokens at T = 0).

Everything runs in the caller's thread (the server's scheduler): no locks. Device work is enqueued, never waited for.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxddtree.model.cache import GDNState, KVCache, init_cache
from jaxddtree.model.drafter import init_draft_cache

BLOCK = 256  # tokens per KV block (divides every cache capacity: `loop.capacity` rounds them to 256)
GRID = 8192  # default snapshot spacing inside long prompts (a multiple of every prefill chunk width)
STATE_SHARE = 0.25  # of the budget for the GDN states (at 27B one is ~147 MiB, a block ~21 MiB)
KB = 64  # blocks stored per dispatch
MAX_STATES = 4096  # slots of a pool whose entries take no bytes (a model without GDN or attention layers)


@dataclasses.dataclass(eq=False)
class _Block:
    digest: bytes | None  # None: a snapshot's own partial block (its tail)
    slot: int  # in the block pool
    refs: int = 0  # snapshots that use it


@dataclasses.dataclass(eq=False)
class Snapshot:
    p: int  # tokens covered
    ids: np.ndarray  # the prefix's token ids [p]
    blocks: list  # its full blocks [0, p // BLOCK)
    tail: _Block | None  # the partial block [p // BLOCK * BLOCK, p) (rows past p unused), or None
    state: int  # its GDN states' slot in the state pool
    key: Any = None  # (p, digest of ids)


# ---------------------------------------------------------------------------------------------- device programs
def _kv_leaves(cache, dcache):
    """[(array, position axis)] of every attention layer's K and V (stacked per group position: [G, B, Hkv, S, hd])
    and every drafter layer's ([B, Hkv, S, hd])."""
    out = [(x, 3) for c in cache.groups if isinstance(c, KVCache) for x in (c.k, c.v)]
    if dcache is not None:
        out += [(x, 2) for x in dcache.k + dcache.v]
    return out


def _state_leaves(cache):
    return [x for c in cache.groups if isinstance(c, GDNState) for x in (c.conv, c.recurrent)]


def _blocks_of(x, axis: int, block: int):
    """x's rows along `axis` as [S / block, ..., block, ...] (the block index in front; padded to whole blocks)."""
    S = x.shape[axis]
    if S % block:
        x = jnp.pad(x, [(0, 0)] * axis + [(0, -S % block)] + [(0, 0)] * (x.ndim - axis - 1))
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _alloc(cache, dcache, n_blocks: int, n_states: int, block: int):
    """Zeroed pools: (per KV leaf [n_blocks + 1, ..., block, ...] (slot 0: the zero block), per state leaf
    [n_states, ...])."""
    kv = tuple(jnp.zeros((n_blocks + 1,) + x.shape[:a] + (block,) + x.shape[a + 1:], x.dtype)
               for x, a in _kv_leaves(cache, dcache))
    st = tuple(jnp.zeros((n_states,) + x.shape, x.dtype) for x in _state_leaves(cache))
    return kv, st


def _store(pools, cache, dcache, src, dst, state_slot, *, block: int):
    """Blocks src[i] of the caches into pool slots dst[i] (a dst out of range: dropped), and the GDN states into
    state slot `state_slot` (out of range: dropped); pools donated."""
    kv, st = pools
    kv = tuple(p.at[dst].set(_blocks_of(x, a, block)[src], mode="drop")
               for p, (x, a) in zip(kv, _kv_leaves(cache, dcache)))
    st = tuple(p.at[state_slot[None]].set(x[None], mode="drop") for p, x in zip(st, _state_leaves(cache)))
    return kv, st


def _build(pools, slots, state_slot, p, *, cfg, dcfg, S: int, dtype, ddtype, block: int):
    """Fresh caches of S positions holding pool blocks `slots` (in order; slot 0: zeros) and state `state_slot`,
    their lengths p -> (cache, drafter cache or None)."""
    kv, st = pools
    cache = init_cache(cfg, S, dtype)  # (its zeros are replaced: XLA drops them)
    dcache = init_draft_cache(dcfg, 1, S, ddtype) if dcfg is not None else None

    def rows(pool, axis):  # [K, ..., block, ...] -> [..., K * block, ...] -> S rows
        x = jnp.moveaxis(pool[slots], 0, axis)
        x = x.reshape(x.shape[:axis] + (x.shape[axis] * block,) + x.shape[axis + 2:])
        return jax.lax.slice_in_dim(x, 0, S, axis=axis)

    kv_it, st_it = iter(kv), iter(st)
    groups = []
    for c in cache.groups:
        if isinstance(c, KVCache):
            c = KVCache(k=rows(next(kv_it), 3), v=rows(next(kv_it), 3))
        else:
            c = GDNState(conv=next(st_it)[state_slot], recurrent=next(st_it)[state_slot])
        groups.append(c)
    cache = cache.replace(groups=tuple(groups), length=p)
    if dcache is not None:
        n = len(dcache.k)
        d = [rows(next(kv_it), 2) for _ in range(2 * n)]
        dcache = dataclasses.replace(dcache, k=tuple(d[:n]), v=tuple(d[n:]), length=p)
    return cache, dcache


class PrefixCache:
    """Snapshots of prompt prefixes within `budget` device bytes (module docstring). `grid`: snapshot spacing inside
    long prompts (0: prompt ends only). One per slot pool (`SlotPool(prefix_cache=...)`)."""

    def __init__(self, target, drafter, budget: int, grid: int = GRID, block: int = BLOCK):
        if int(budget) < 0 or int(grid) < 0 or int(block) < 1:
            raise ValueError(f"budget and grid must be >= 0, block >= 1; got {budget}, {grid}, {block}")
        self.target, self.drafter = target, drafter
        self._budget, self.grid, self.block = int(budget), int(grid), int(block)
        self._blocks: dict[bytes, _Block] = {}  # shared full blocks by digest
        self._snaps: collections.OrderedDict = collections.OrderedDict()  # key -> Snapshot, least recent first
        self._pools = None  # (kv, states) device arrays, made at the first snapshot
        self.block_bytes = self.state_bytes = 0  # (known with the pools)
        self._n_blocks = self._n_states = 0  # usable slots (the budget's)
        self._alloc_n = (0, 0)  # slots in the pools (block slot 0 not counted)
        self._free_blocks: list[int] = []
        self._free_states: list[int] = []
        self.stats = collections.Counter()  # lookups, hits, hit_tokens, snapshots, evicted

    @property
    def bytes(self) -> int:
        """Device bytes in use by the snapshots (blocks and states; the pools hold `budget` bytes once made)."""
        if self._pools is None:
            return 0
        used_b, used_s = self._used()
        return used_b * self.block_bytes + used_s * self.state_bytes

    # ------------------------------------------------------------------------------------ jitted helpers
    def _fn(self, name, make):
        return self.target.bind(("prefix_cache", name, self.block), make)

    def _split(self, budget: int) -> tuple[int, int]:
        """(block slots, state slots) of a budget: STATE_SHARE for states (at least one), the rest blocks; (0, 0)
        when one state and one block do not fit."""
        if budget < self.state_bytes + self.block_bytes:
            return 0, 0
        m = max(1, int(budget * STATE_SHARE) // self.state_bytes) if self.state_bytes else MAX_STATES
        n = (budget - m * self.state_bytes) // self.block_bytes if self.block_bytes else MAX_STATES
        return n, m

    def _make_pools(self, cache, dcache) -> bool:
        if self._pools is None:
            isz = lambda x: jnp.dtype(x.dtype).itemsize  # noqa: E731
            self.block_bytes = sum(x.size // x.shape[a] * self.block * isz(x) for x, a in _kv_leaves(cache, dcache))
            self.state_bytes = sum(x.size * isz(x) for x in _state_leaves(cache))
            n, m = self._split(self.budget)
            if n == 0:
                return False
            self._pools = jax.jit(functools.partial(_alloc, n_blocks=n, n_states=m, block=self.block))(cache, dcache)
            self._n_blocks, self._n_states = self._alloc_n = (n, m)
            self._free_blocks, self._free_states = list(range(n, 0, -1)), list(range(m - 1, -1, -1))
        return self._n_states > 0

    # ------------------------------------------------------------------------------------ keys
    def digests(self, ids: np.ndarray) -> list[bytes]:
        """Chained digests of ids' full blocks: digest i covers ids[: (i + 1) * block]."""
        out, prev = [], b""
        ids = np.ascontiguousarray(ids, np.int64)
        for i in range(len(ids) // self.block):
            prev = hashlib.blake2b(prev + ids[i * self.block:(i + 1) * self.block].tobytes(),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def _key(self, ids: np.ndarray, p: int, digests: list[bytes]):
        nb = p // self.block
        head = digests[nb - 1] if nb else b""
        return p, hashlib.blake2b(head + np.ascontiguousarray(ids[nb * self.block:p], np.int64).tobytes(),
                                  digest_size=16).digest()

    # ------------------------------------------------------------------------------------ lookup and build
    def lookup(self, ids, count: bool = True) -> Snapshot | None:
        """The deepest snapshot whose ids are ids[:p] with p <= len(ids) - 1 (marked most recently used), or None.
        count=False: not counted in `stats` (a lookup that serves no request: `SlotPool.remember`)."""
        ids = np.asarray(ids, np.int64)
        self.stats["lookups"] += count
        best = None
        for s in self._snaps.values():
            if s.p < len(ids) and (best is None or s.p > best.p) and np.array_equal(s.ids, ids[:s.p]):
                best = s
        if best is not None:
            self._snaps.move_to_end(best.key)  # (only the snapshot used: SGLang #31643)
            self.stats["hits"] += count
            self.stats["hit_tokens"] += best.p * count
        return best

    def contains(self, ids) -> bool:
        """Whether a snapshot of exactly these token ids (all of them) is kept."""
        ids = np.asarray(ids, np.int64)
        return self._key(ids, len(ids), self.digests(ids)) in self._snaps

    def build(self, snap: Snapshot, S: int):
        """Fresh caches of S positions holding the snapshot (copies: the snapshot stays as it is) -> (cache,
        drafter cache or None), their lengths p. One dispatch."""
        K = -(-int(S) // self.block)
        slots = [b.slot for b in snap.blocks] + ([snap.tail.slot] if snap.tail is not None else [])
        slots = np.asarray(slots + [0] * (K - len(slots)), np.int32)
        cfg, d = self.target.config, self.drafter
        dcfg = d.config if d is not None else None
        dkey = (dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim, jnp.dtype(d.dtype).name) if d is not None else None
        fn = self._fn(("build", int(S), dkey), lambda: jax.jit(functools.partial(
            _build, cfg=cfg, dcfg=dcfg, S=int(S), dtype=self.target.dtype, ddtype=d.dtype if d is not None else None,
            block=self.block)))
        return fn(self._pools, jnp.asarray(slots), jnp.int32(snap.state), jnp.int32(snap.p))

    def arrays(self, snap: Snapshot) -> dict:
        """The snapshot's device contents (copies; tests): "gdn" (per GDN leaf), "tail" (per KV leaf, or None) and
        "blocks" (per block, per KV leaf)."""
        kv, st = self._pools
        return {"gdn": [x[snap.state] for x in st],
                "tail": [x[snap.tail.slot] for x in kv] if snap.tail is not None else None,
                "blocks": [[x[b.slot] for x in kv] for b in snap.blocks]}

    # ------------------------------------------------------------------------------------ snapshots
    def recorder(self, ids):
        """The `on_chunk(end, cache, dcache)` of a prefill of `ids` (cold or resumed from a hit): snapshots at the
        prompt's end and at the grid's multiples (their blocks kept already are shared, the others taken from the
        prefill's caches)."""
        return _Recorder(self, np.asarray(ids, np.int64))

    def _snapshot(self, rec: "_Recorder", p: int, cache, dcache):
        if self.budget <= 0 or not self._make_pools(cache, dcache):
            return
        key = self._key(rec.ids, p, rec.digests)
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return
        nb = p // self.block
        blocks = [self._blocks.get(rec.digests[i]) for i in range(nb)]  # kept ones (shared), else None: new
        new = [i for i, b in enumerate(blocks) if b is None] + ([nb] if p % self.block else [])
        for b in blocks:  # (pinned while room is made)
            if b is not None:
                b.refs += 1
        if not self._make_room(len(new)):
            for b in blocks:
                if b is not None:
                    self._unref(b)
            return
        slots = [self._free_blocks.pop() for _ in new]
        state = self._free_states.pop()
        store = self._fn(("store", KB), lambda: jax.jit(functools.partial(_store, block=self.block),
                                                        donate_argnums=(0,)))
        out_of_range = self._n_blocks_alloc + 1
        for a in range(0, max(len(new), 1), KB):  # (the states with the first dispatch)
            src = np.zeros((KB,), np.int32)
            dst = np.full((KB,), out_of_range, np.int32)
            src[:len(new[a:a + KB])] = new[a:a + KB]
            dst[:len(new[a:a + KB])] = slots[a:a + KB]
            self._pools = store(self._pools, cache, dcache, jnp.asarray(src), jnp.asarray(dst),
                                jnp.int32(state if a == 0 else self._n_states_alloc))
        made = dict(zip(new, slots))
        for i in range(nb):
            if blocks[i] is None:
                blocks[i] = self._blocks[rec.digests[i]] = _Block(rec.digests[i], made[i], refs=1)
        tail = _Block(None, made[nb], refs=1) if p % self.block else None
        snap = Snapshot(p=p, ids=rec.ids[:p].copy(), blocks=blocks, tail=tail, state=state, key=key)
        self._snaps[key] = snap
        self.stats["snapshots"] += 1

    @property
    def _n_blocks_alloc(self) -> int:
        return self._alloc_n[0]

    @property
    def _n_states_alloc(self) -> int:
        return self._alloc_n[1]

    def _used(self) -> tuple[int, int]:
        return self._n_blocks_alloc - len(self._free_blocks), self._n_states_alloc - len(self._free_states)

    def _make_room(self, n_blocks: int) -> bool:
        """Evict least recently used snapshots until n_blocks blocks and one state fit the budget -> whether they
        do (not even with every snapshot gone: False)."""
        if n_blocks > self._n_blocks or self._n_states < 1:
            return False
        self._shrink(self._n_blocks - n_blocks, self._n_states - 1)
        ub, us = self._used()
        return ub + n_blocks <= self._n_blocks and us + 1 <= self._n_states

    def _shrink(self, blocks: int, states: int):
        """Evict least recently used snapshots until at most `blocks` blocks and `states` states are in use."""
        while self._snaps and (self._used()[0] > blocks or self._used()[1] > states):
            _, s = self._snaps.popitem(last=False)
            self._drop(s)
            self.stats["evicted"] += 1

    def _unref(self, b: _Block):
        b.refs -= 1
        if b.refs <= 0:
            if b.digest is not None and self._blocks.get(b.digest) is b:
                del self._blocks[b.digest]
            self._free_blocks.append(b.slot)

    def _drop(self, s: Snapshot):
        self._free_states.append(s.state)
        for b in s.blocks + ([s.tail] if s.tail is not None else []):
            self._unref(b)

    def clear(self):
        """Drop every snapshot (e.g. after a warm-up's requests); the pools stay."""
        for s in list(self._snaps.values()):
            self._drop(s)
        self._snaps.clear()
        self._blocks.clear()

    @property
    def budget(self) -> int:
        """Device bytes for the blocks and states (setting it: `set_budget`)."""
        return self._budget

    @budget.setter
    def budget(self, value: int):
        self.set_budget(value)

    def set_budget(self, budget: int):
        """A new budget: least recently used snapshots go until the rest fits (a budget larger than the pools'
        drops them all, and the pools are made again at the next snapshot)."""
        if int(budget) < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self._budget = int(budget)
        if self._pools is None:
            return
        n, m = self._split(self._budget)
        if n > self._n_blocks_alloc or m > self._n_states_alloc:
            self.clear()
            self._pools = None
            return
        self._n_blocks, self._n_states = n, m
        self._shrink(n, m)

    def __len__(self) -> int:
        return len(self._snaps)

    def snapshots(self) -> list[Snapshot]:
        """The snapshots, least recently used first."""
        return list(self._snaps.values())


class _Recorder:
    def __init__(self, cache: PrefixCache, ids: np.ndarray):
        self.cache, self.ids = cache, ids
        self.digests = cache.digests(ids)

    def __call__(self, end: int, cache, dcache):
        pc = self.cache
        if end == len(self.ids) or (pc.grid and end % pc.grid == 0):
            pc._snapshot(self, end, cache, dcache)
