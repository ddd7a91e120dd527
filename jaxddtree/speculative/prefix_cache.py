"""Prefix caching for the hybrid target (issue 39): a request whose prompt starts with a cached prefix resumes its
prefill there instead of at position 0.

A Gated-DeltaNet layer's state (conv + fp32 recurrent) is valid at one position only, so the cache keeps
**snapshots**: the GDN states of every GDN layer at a position p, taken where a prefill chunk ends anyway (the end
of each prompt, and every `grid` tokens inside a long prompt, where `model.prefill.chunk_bounds` ends a chunk), with
the attention KV and the drafter's context KV of positions [0, p). The KV lives in **blocks** of BLOCK tokens (every
attention layer's and drafter layer's K and V rows of the block), keyed by a chained digest of the token ids up to
the block's end and shared by every snapshot whose prefix holds them (a snapshot at p not on the block grid owns
its partial last block, its `tail`).

Lookup: the deepest snapshot whose token ids are exactly the prompt's first p tokens, with p <= len(prompt) - 1 (the
last prompt token is always recomputed: its logits draw the first token). A hit **copies** the snapshot into the
request's own fresh caches (`build`: its blocks, its tail, its GDN states, the lengths), so entries are immutable
(copy-on-write) and no running request ever reads one: eviction (least recently used snapshot first; a block goes
with the last snapshot that uses it) never touches a running request. Memory: `budget` bytes of device memory for
blocks, tails and states together; a snapshot that does not fit alone is not kept.

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

from jaxddtree.model.cache import GDNState, KVCache

BLOCK = 256  # tokens per KV block (divides every cache capacity: `loop.capacity` rounds them to 256)
GRID = 8192  # default snapshot spacing inside long prompts (a multiple of every prefill chunk width)


@dataclasses.dataclass(eq=False)
class _Block:
    digest: bytes
    kv: Any  # (target ((k, v) per attention layer), drafter ((k, v) per layer)) rows of one block
    nbytes: int
    refs: int = 0  # snapshots that use it


@dataclasses.dataclass(eq=False)
class Snapshot:
    p: int  # tokens covered
    ids: np.ndarray  # the prefix's token ids [p]
    blocks: list  # its full blocks [0, p // BLOCK)
    tail: Any  # the partial block [p // BLOCK * BLOCK, p) (rows past p unused), or None
    gdn: Any  # per GDN layer (conv, recurrent) at p
    nbytes: int = 0  # its own bytes (tail + states), the blocks counted apart
    key: Any = None  # (p, digest of ids)


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _take(cache, dcache, start, *, block: int):
    """KV rows [start, start + block) of every attention layer (stacked per group position, `cache.ModelCache`)
    and drafter layer: new buffers."""
    t = tuple((jax.lax.dynamic_slice_in_dim(c.k, start, block, axis=3),
               jax.lax.dynamic_slice_in_dim(c.v, start, block, axis=3))
              for c in cache.groups if isinstance(c, KVCache))
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block, axis=2)
    d = tuple((sl(k), sl(v)) for k, v in zip(dcache.k, dcache.v)) if dcache is not None else ()
    return t, d


def _states(cache):
    """Every GDN layer's (conv, recurrent) state, stacked per group position (jit outputs: copies, the cache may
    be donated after)."""
    return tuple((c.conv, c.recurrent) for c in cache.groups if isinstance(c, GDNState))


def _put(cache, dcache, kv, start):
    """`_take`'s rows written back at `start` (cache and dcache donated)."""
    t, d = iter(kv[0]), kv[1]
    groups = []
    for c in cache.groups:
        if isinstance(c, KVCache):
            k, v = next(t)
            c = KVCache(k=jax.lax.dynamic_update_slice_in_dim(c.k, k, start, axis=3),
                        v=jax.lax.dynamic_update_slice_in_dim(c.v, v, start, axis=3))
        groups.append(c)
    cache = cache.replace(groups=tuple(groups))
    if dcache is not None:
        up = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=2)
        dcache = dataclasses.replace(dcache, k=tuple(up(x, y) for x, (y, _) in zip(dcache.k, d)),
                                     v=tuple(up(x, y) for x, (_, y) in zip(dcache.v, d)))
    return cache, dcache


def _set_states(cache, dcache, gdn, p):
    """The GDN states and the committed lengths (p) of a snapshot (cache and dcache donated)."""
    g = iter(gdn)
    groups = []
    for c in cache.groups:
        if isinstance(c, GDNState):
            conv, rec = next(g)
            c = GDNState(conv=conv, recurrent=rec)
        groups.append(c)
    cache = cache.replace(groups=tuple(groups), length=p)
    if dcache is not None:
        dcache = dataclasses.replace(dcache, length=p)
    return cache, dcache


class PrefixCache:
    """Snapshots of prompt prefixes within `budget` device bytes (module docstring). `grid`: snapshot spacing inside
    long prompts (0: prompt ends only). One per slot pool (`SlotPool(prefix_cache=...)`)."""

    def __init__(self, target, drafter, budget: int, grid: int = GRID, block: int = BLOCK):
        if int(budget) < 0 or int(grid) < 0 or int(block) < 1:
            raise ValueError(f"budget and grid must be >= 0, block >= 1; got {budget}, {grid}, {block}")
        self.target, self.drafter = target, drafter
        self.budget, self.grid, self.block = int(budget), int(grid), int(block)
        self._blocks: dict[bytes, _Block] = {}
        self._snaps: collections.OrderedDict = collections.OrderedDict()  # key -> Snapshot, least recent first
        self.bytes = 0
        self.stats = collections.Counter()  # lookups, hits, hit_tokens, snapshots, evicted

    # ------------------------------------------------------------------------------------ jitted helpers
    def _fn(self, name, make):
        return self.target.bind(("prefix_cache", name, self.block), make)

    def _take(self, cache, dcache, start):
        return self._fn("take", lambda: jax.jit(functools.partial(_take, block=self.block)))(
            cache, dcache, jnp.int32(start))

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
        drafter cache or None), their lengths p."""
        cache = self.target.init_cache(S)
        dcache = self.drafter.init_cache(1, S) if self.drafter is not None else None
        put = self._fn("put", lambda: jax.jit(_put, donate_argnums=(0, 1)))
        for i, blk in enumerate(snap.blocks):
            cache, dcache = put(cache, dcache, blk.kv, jnp.int32(i * self.block))
        if snap.tail is not None:
            cache, dcache = put(cache, dcache, snap.tail, jnp.int32(len(snap.blocks) * self.block))
        states = self._fn("set_states", lambda: jax.jit(_set_states, donate_argnums=(0, 1)))
        return states(cache, dcache, snap.gdn, jnp.int32(snap.p))

    # ------------------------------------------------------------------------------------ snapshots
    def recorder(self, ids, hit: Snapshot | None = None):
        """The `on_chunk(end, cache, dcache)` of a prefill of `ids` (resumed from `hit`, if any): snapshots at the
        prompt's end and at the grid's multiples."""
        return _Recorder(self, np.asarray(ids, np.int64), hit)

    def _snapshot(self, rec: "_Recorder", p: int, cache, dcache):
        if self.budget <= 0:
            return
        key = self._key(rec.ids, p, rec.digests)
        if key in self._snaps:
            self._snaps.move_to_end(key)
            return
        nb = p // self.block
        for i in range(len(rec.blocks), nb):
            blk = self._blocks.get(rec.digests[i])
            if blk is None:
                kv = self._take(cache, dcache, i * self.block)
                blk = _Block(rec.digests[i], kv, _nbytes(kv))
            rec.blocks.append(blk)
        tail = self._take(cache, dcache, nb * self.block) if p % self.block else None
        gdn = self._fn("states", lambda: jax.jit(_states))(cache)
        snap = Snapshot(p=p, ids=rec.ids[:p].copy(), blocks=list(rec.blocks[:nb]), tail=tail, gdn=gdn)
        snap.nbytes, snap.key = _nbytes((tail, gdn)), key
        self._insert(key, snap)

    def _insert(self, key, snap: Snapshot):
        for i, blk in enumerate(snap.blocks):
            cur = self._blocks.get(blk.digest)
            if cur is None:  # new, or evicted since the recorder took it
                cur = self._blocks[blk.digest] = blk
                blk.refs = 0
                self.bytes += blk.nbytes
            snap.blocks[i] = cur
            cur.refs += 1
        self.bytes += snap.nbytes
        self._snaps[key] = snap
        self.stats["snapshots"] += 1
        self._evict()

    def _evict(self):
        while self.bytes > self.budget and self._snaps:
            _, s = self._snaps.popitem(last=False)
            self._drop(s)
            self.stats["evicted"] += 1

    def _drop(self, s: Snapshot):
        self.bytes -= s.nbytes
        for blk in s.blocks:
            blk.refs -= 1
            if blk.refs <= 0 and self._blocks.get(blk.digest) is blk:
                del self._blocks[blk.digest]
                self.bytes -= blk.nbytes

    def clear(self):
        """Drop every snapshot (e.g. after a warm-up's requests)."""
        self._blocks.clear()
        self._snaps.clear()
        self.bytes = 0

    def set_budget(self, budget: int):
        self.budget = int(budget)
        self._evict()

    def __len__(self) -> int:
        return len(self._snaps)

    def snapshots(self) -> list[Snapshot]:
        """The snapshots, least recently used first."""
        return list(self._snaps.values())


class _Recorder:
    def __init__(self, cache: PrefixCache, ids: np.ndarray, hit: Snapshot | None):
        self.cache, self.ids = cache, ids
        self.digests = cache.digests(ids)
        self.blocks = list(hit.blocks) if hit is not None else []  # its full blocks known so far

    def __call__(self, end: int, cache, dcache):
        pc = self.cache
        if end == len(self.ids) or (pc.grid and end % pc.grid == 0):
            pc._snapshot(self, end, cache, dcache)
