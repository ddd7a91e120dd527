"""Batched rounds: several requests' rounds in one pass (issue 28), and the slot pool a server drives.

A batched state is the single-request `loop.DecodeState` with every leaf stacked on a new leading slot axis [B, ...]:
each slot keeps its own batch-1 caches (attention KV, GDN conv + recurrent state, the drafter's context), output,
acceptance record, key, stop ids, max_new, temperature and truncation. The batched round is `jax.vmap` of loop's
per-slot round (`loop._round`, `_hold_if_done` included) over the slot axis, the target's leaves and the drafter's
parameters unbatched, so every slot computes exactly its single-request round, and XLA turns each projection (a
dot_general batched in its activations only) into one GEMM of B·N rows: the weights are streamed once per round for
all slots (`kernels_pallas.ops.dense`'s batching rule does the same for the Pallas GEMV / W8A8 kernels).

Per slot, as data (one compilation per slot-count bucket): the DDTree budget (`DecodeState.budget`, <= the bucket's
static budget: the tree is built at the bucket's budget and its rows past budget + 1 become padding), the
temperature and top_k / top_p / min_p (the round's sampling class is the widest of its slots', `slots_mode`: a slot
at temperature 0 in a sampled round takes the argmax, `tree.posterior_by_mode`). With one active request the pool runs `generate`'s own compiled round
(`loop.loop_fn(..., chunk=sync_every)`, tree_budget="auto" included); with n >= 2 it runs a bucket of B >= n slots
(B = 2, 4, 8, ...; `buckets`) at the bucket's budget (`bucket_budget`: B·(budget + 1) <= slot_rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxddtree.model import sharding
from jaxddtree.model.drafter import check_compatible
from jaxddtree.model.prefill import PREFILL_CHUNK, check_ids, check_vocab, chunk_size, chunk_widths
from jaxddtree.model.target import Target
from jaxddtree.speculative import budget as budget_lib
from jaxddtree.speculative import loop as loop_lib
from jaxddtree.speculative import precompile as precompile_lib
from jaxddtree.speculative import tree as tree_lib

BUDGETS = (7, 15, 31, 63)  # the DDTree budgets of the batched buckets (per slot), largest first that fits slot_rows
# Joining prompts of one shape prefill together in passes of at most GROUP_ROWS rows (SlotPool.prefill_many): at 27B
# on the H200 a 512-token prompt took 90 ms in two 256-row chunks (≈ 2 × 27B × 512 / 0.09 s ≈ 300 TFLOP/s) and 8K
# tokens 1.05 s in four 2048-row chunks (≈ 420 TFLOP/s) (BENCHMARKS.md, sessions 6 and 7).
GROUP_ROWS = 2048
TRACES = loop_lib.TRACES  # "slots": traces of the batched round (one per bucket and plan)


@dataclasses.dataclass
class Request:
    """One generation request, host values."""
    ids: list[int]  # prompt token ids
    max_new: int  # tokens to emit at most (the first token included, as generate counts)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # generation ends after the first of these (inclusive)
    tree_budget: int | None = None  # DDTree: this request's budget (at most the pool's per-slot budget); None: pool's
    oracle: Any = None  # test hook (pools made with _oracle_len): the continuation the draft logits favour


@dataclasses.dataclass
class SlotUpdate:
    """What one slot did since the last step() reported it."""
    tokens: list[int]  # newly emitted tokens (the request's first token comes in its first update)
    done: bool  # finished (stop id or max_new): release() it
    rounds: int  # rounds run so far for this request
    accepted: int  # sum of acceptance lengths so far (mean = accepted / rounds)
    budget: int | str | None  # the tree budget its rounds use now ("auto", an int, None for ar/dflash)


def buckets(max_batch: int) -> tuple[int, ...]:
    """The slot counts of the batched rounds: 2, 4, 8, ... <= max_batch, and max_batch itself when it is not a power
    of two (so that max_batch requests can run)."""
    out = [b for b in (2 ** i for i in range(1, 31)) if b <= max_batch]
    if max_batch >= 2 and (not out or out[-1] != max_batch):
        out.append(max_batch)
    return tuple(out)


def bucket_budget(B: int, slot_rows: int = 128, cap: int | None = None) -> int:
    """The per-slot DDTree budget of a round of B slots: the largest of BUDGETS (each at most `cap`, the pool's int
    budget) with B·(budget + 1) <= slot_rows; the smallest when none fits."""
    cands = sorted({min(b, cap) if cap else b for b in BUDGETS})
    fit = [b for b in cands if B * (b + 1) <= slot_rows]
    return fit[-1] if fit else cands[0]


def batch_plan(target: Target, dcfg, method: str, budget: int, inject: bool = False) -> loop_lib.Plan:
    """The static plan of a batched round. Sampling is data: the round's class is the widest of its live slots'
    (`slots_mode`): greedy when none samples (H200, 27B, 4 slots of budget 31: 25.42 ms per round greedy vs 28.54
    sampled + truncated, the truncation's bisection being most of the difference; benchmarks/results/
    batch_27b_h200.json), else per-slot temperatures and truncations (a slot at temperature 0 takes the argmax)."""
    return loop_lib.make_plan(target, dcfg, method, budget, inject=inject)


def slots_mode(bstate) -> jax.Array:
    """The sampling class of a batched round: the widest of its slots' that are not done (`tree.sampling_mode`;
    a finished slot's round is held, its tokens unused)."""
    return jnp.max(jnp.where(bstate.done, tree_lib.GREEDY, jax.vmap(loop_lib.mode_of)(bstate)))


def run_slots(leaves, dparams, bstate, oracle, *, graphdef, treedef, dcfg, plan, chunk: int):
    """`chunk` batched rounds (vmap of loop's per-slot round over the slot axis; the target's leaves and the
    drafter's params unbatched) -> (bstate, Progress with [B] leaves). oracle [B, L] (the test hook's, else [B, 1])."""
    TRACES["slots"] += 1  # once per compilation (tests count them)
    body = jax.vmap(functools.partial(loop_lib._round, graphdef=graphdef, treedef=treedef, dcfg=dcfg, plan=plan),
                    in_axes=(None, None, 0, 0, None))
    mode = slots_mode(bstate)  # unbatched: one branch of the posterior runs for all slots
    if chunk == 1:
        bstate = body(leaves, dparams, bstate, oracle, mode)
    else:
        bstate = jax.lax.fori_loop(0, chunk, lambda i, s: body(leaves, dparams, s, oracle, mode), bstate)
    return bstate, jax.vmap(loop_lib.progress)(bstate)


def slots_fn(target: Target, dcfg, plan: loop_lib.Plan, B: int, chunk: int = 1):
    """`run_slots` of (target, drafter config, plan, B slots, chunk rounds per call), jitted once per target with its
    static parts bound (`Target.bind`), the batched state donated: fn(leaves, dparams, bstate, oracle [B, L])."""
    return target.bind(("slots", dcfg, plan, B, chunk), lambda: jax.jit(functools.partial(
        run_slots, graphdef=target.graphdef, treedef=target.treedef, dcfg=dcfg, plan=plan, chunk=chunk),
        donate_argnames=("bstate",)))


def slot_bytes(target: Target, drafter, cache_len: int) -> int:
    """Device bytes of one slot's caches (the target's, all shards together, + the drafter's context cache; drafter
    None: AR) at cache_len positions: a pool holds max_batch of them, plus one per joining request (its prefill) and,
    while a bucket grows or shrinks, the new bucket's copy next to the old."""
    n = target.cache_bytes(cache_len)
    if drafter is not None:
        n += loop_lib._nbytes(jax.eval_shape(lambda: drafter.init_cache(1, cache_len)))
    return n


# ------------------------------------------------------------------------------- batched-state plumbing (jitted)
def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _blank_like(bstate):
    """An empty slot of bstate's per-slot shapes: zero caches and lengths, done (its rounds change nothing)."""
    blank = jax.tree.map(lambda b: b[0] if _is_key(b) else jnp.zeros(b.shape[1:], b.dtype), bstate)
    return blank.replace(done=jnp.asarray(True))


def _resize(bstate, idx):
    """new slot j = old slot idx[j] (idx[j] = -1: an empty slot)."""
    blank = _blank_like(bstate)
    safe = jnp.maximum(idx, 0)

    def pick(b, e):
        taken = jnp.take(b, safe, axis=0)
        keep = (idx >= 0).reshape((-1,) + (1,) * (b.ndim - 1))
        if _is_key(b):
            return taken
        return jnp.where(keep, taken, e[None])
    return jax.tree.map(pick, bstate, blank)


def _write(bstate, slot, i):
    return jax.tree.map(lambda b, s: jax.lax.dynamic_update_index_in_dim(b, s, i, 0), bstate, slot)


def _stack1(slot):
    return jax.tree.map(lambda s: s[None], slot)


def _extract(bstate, i):
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False), bstate)


def _with_budget(slot, budget):
    """A start / single-mode state as a batched slot: no auto state, the budget as data (None: not DDTree)."""
    return slot.replace(auto=None, budget=budget)


def _as_single(slot, costs, out_len: int):
    """A batched slot as generate's state: tree_budget="auto"'s fresh statistics (costs) or none."""
    return slot.replace(budget=None, auto=budget_lib.init_state(*costs, out_len) if costs is not None else None)


def _bound(target: Target, name: str, fn, **jit_kw):
    return target.bind(("batch", name), lambda: jax.jit(fn, **jit_kw))


# ------------------------------------------------------------------------------------------------- the pool
class Pending:
    """A request being prefilled (`SlotPool.prefill`): advance() enqueues its next chunk; True once its start
    state is enqueued (then `SlotPool.admit` it)."""

    def __init__(self, req: Request, pre: loop_lib.Prefill, budget, oracle, cached_tokens: int = 0):
        self.req, self._pre, self.budget, self.oracle = req, pre, budget, oracle
        self.cached_tokens = cached_tokens  # prompt tokens taken from the pool's prefix cache (0: none)

    @property
    def chunks(self) -> int:
        """Its prefill's chunks (a prefix-cache hit skips some)."""
        return self._pre.n_chunks

    def advance(self) -> bool:
        return self._pre.advance()

    @property
    def prefilled(self) -> bool:
        """Every prefill chunk enqueued (the next advance() would draw the first token)."""
        return self._pre.prefilled

    @property
    def width(self) -> int:
        """Its prefill chunks' rows."""
        return self._pre.shape[0]

    @property
    def state(self):
        while not self._pre.advance():
            pass
        return self._pre.state


@dataclasses.dataclass
class _Live:
    req: Request
    budget: Any  # DDTree: this request's budget (int, or "auto" in single mode with the pool's auto); else None
    single_plan: loop_lib.Plan
    oracle: Any
    shown: int = 0  # tokens reported so far
    done: bool = False
    fn: Any = None  # its single-slot round (loop.loop_fn), once looked up
    first: Any = None  # the start state's first token [1] (device), until step() reports it


class SlotPool:
    """Continuous batching over `max_batch` slots of one cache capacity `cache_len` (docs: the module docstring and
    /work/briefs/pool_api.md). A handle (int) names a request from admit() to release()."""

    def __init__(self, target: Target, drafter, *, method: str = "ddtree", max_batch: int = 1, cache_len: int,
                 tree_budget="auto", budget_costs=None, slot_rows: int = 128, sync_every: int = 1,
                 max_group: int = 1, group_rows: int = GROUP_ROWS, prefix_cache=None, precompile: bool = True,
                 _oracle_len: int = 0):
        if method not in loop_lib.METHODS:
            raise ValueError(f"unknown method '{method}' (choose one of {', '.join(loop_lib.METHODS)})")
        if method != "ar" and drafter is None:
            raise ValueError(f"method '{method}' needs a drafter (load one with jaxddtree.load_drafter)")
        if int(max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if int(sync_every) < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if int(slot_rows) < 1:
            raise ValueError(f"slot_rows must be >= 1, got {slot_rows}")
        if int(max_group) < 1 or int(group_rows) < 1:
            raise ValueError(f"max_group and group_rows must be >= 1, got {max_group}, {group_rows}")
        if target.mesh is not None and max_batch > 1:
            raise ValueError("batched rounds (max_batch > 1) run on one device; load the target with tp=1")
        cfg = target.config
        if drafter is not None and method != "ar":
            check_compatible(drafter.config, target, draft_vocab=drafter.draft_vocab)
        self.target, self.method = target, method
        self.dcfg = drafter.config if (drafter is not None and method != "ar") else None
        self.drafter = drafter if self.dcfg else None
        self.dparams = self.drafter.params if self.drafter else None
        self.max_batch, self.cache_len, self.slot_rows = int(max_batch), int(cache_len), int(slot_rows)
        self.sync_every = int(sync_every)
        self.max_group, self.group_rows = min(int(max_group), self.max_batch), int(group_rows)
        self.tree_budget = tree_budget
        self.budget, self.table = loop_lib.resolve_budget(tree_budget, method, cfg.vocab_size, self.dcfg,
                                                          budget_costs)
        self.auto = self.table is not None
        self.costs = budget_lib.padded(self.table) if self.auto else None
        self.out_len = self.cache_len  # as generate with cache_len: one buffer size
        self.oracle_len = int(_oracle_len)
        self.buckets = buckets(self.max_batch)
        cap = None if self.auto else (self.budget if method == "ddtree" else None)
        self.bucket_budgets = {B: bucket_budget(B, self.slot_rows, cap) for B in self.buckets}
        self.start_plan = batch_plan(target, self.dcfg, method, 0, inject=self.oracle_len > 0)
        self.P = self.dcfg.block_size if self.dcfg else 1
        self._live: dict[int, _Live] = {}
        self._joining: dict[int, Pending] = {}
        self._next = 0
        self._mode = "empty"  # "empty" | "single" | "batched"
        self._state = None  # single: a DecodeState; batched: a DecodeState with [B, ...] leaves
        self._slots: list = []  # batched: handle per slot (None: empty); single: [handle]
        self._oracle = None  # device oracle of the current layout ([L] single, [B, L] batched)
        self._inflight = None
        self._slot_fns: dict[int, Any] = {}  # B -> the bound batched round
        # a speculative.prefix_cache.PrefixCache (prompts resume from their longest cached prefix) or None
        self.prefix_cache = prefix_cache
        self.precompile = bool(precompile)  # warmup(): its heavy programs compiled side by side first (one device)

    @property
    def prefix_cache_bytes(self) -> int:
        """Device bytes the prefix cache holds (0 without one)."""
        return self.prefix_cache.bytes if self.prefix_cache is not None else 0

    # ------------------------------------------------------------------------------------------- requests
    def prefill(self, req: Request) -> Pending:
        """Validate (ValueError, one line) and prepare the request's prefill; runs nothing yet."""
        cfg = self.target.config
        ids = check_ids(req.ids, "ids")
        check_vocab(self.target, ids, "ids")
        max_new, temperature, top_k, top_p, min_p, stop_mask = loop_lib.check_request(
            cfg, len(ids), req.max_new, req.temperature, req.top_k, req.top_p, req.min_p, req.stop_ids,
            max_new_name="max_new")
        budget = None
        if self.method == "ddtree":
            if req.tree_budget is None:
                budget = "auto" if self.auto else self.budget
            else:
                budget = int(req.tree_budget)
                if not 1 <= budget < cfg.vocab_size:
                    raise ValueError(f"tree_budget must be in [1, vocab_size={cfg.vocab_size}), got {req.tree_budget}")
        widest = self.budget if budget in (None, "auto") else max(budget, self.budget)
        chunk, need = loop_lib.capacity(self.target, self.dcfg, self.method, widest, len(ids), max_new)
        if need > self.cache_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new ({max_new}) needs caches of {need} positions, "
                             f"the pool's cache_len is {self.cache_len}")
        oracle = None
        if self.oracle_len:
            o = np.zeros((self.oracle_len,), np.int32)
            src = np.asarray(req.oracle if req.oracle is not None else [], np.int32)[:self.oracle_len]
            o[:len(src)] = src
            oracle = o
        start = on_chunk = hit = None
        grid = 0
        pc = self.prefix_cache
        if pc is not None:  # resume from the longest cached prefix (a copy: copy-on-write); snapshot this prompt
            hit = pc.lookup(ids)
            if hit is not None:
                start = pc.build(hit, self.cache_len)
            on_chunk, grid = pc.recorder(ids), pc.grid
        pre = loop_lib.Prefill(self.target, self.drafter, self.start_plan, ids, chunk, self.cache_len, self.out_len,
                               seed=int(req.seed), stop_mask=stop_mask, temperature=temperature, max_new=max_new,
                               top_k=top_k, top_p=top_p, min_p=min_p, start=start,
                               start_len=hit.p if hit is not None else None, grid=grid, on_chunk=on_chunk)
        return Pending(dataclasses.replace(req, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                       pre, budget, oracle, cached_tokens=hit.p if hit is not None else 0)

    def remember(self, ids, min_hit: int = 0) -> Pending | None:
        """A prefill of `ids` that is never admitted, only snapshotted by the prefix cache (issue 39: a finished
        request's prompt + completion, so that the agent's next step, which resends both, resumes at their end; the
        committed caches of the request itself cannot be used: they hold tokens past a stop id or max_new, and the
        rounds run after its end overwrite the GDN states). It resumes from the deepest cached prefix and records a
        snapshot at the end of `ids` (and at the grid's multiples): advance() it until `Pending.prefilled`, then
        drop it (its start is never run; its caches are one joiner's). None when there is nothing to do: no prefix
        cache, `ids` already snapshotted, no cached prefix of at least `min_hit` tokens (the prompt's end: the cost
        stays the completion's length), or `ids` does not fit the pool's caches."""
        pc = self.prefix_cache
        ids = check_ids(ids, "ids")
        if pc is None or pc.budget <= 0 or len(ids) < 2 or pc.contains(ids):
            return None
        hit = pc.lookup(ids, count=False)
        if (hit.p if hit is not None else 0) < int(min_hit):
            return None
        chunk, need = loop_lib.capacity(self.target, self.dcfg, self.method, self.budget, len(ids), 1)
        if need > self.cache_len:
            return None
        pre = loop_lib.Prefill(self.target, self.drafter, self.start_plan, ids, chunk, self.cache_len, self.out_len,
                               seed=0, stop_mask=np.zeros((self.target.config.vocab_size,), bool), temperature=0.0,
                               max_new=1, start=pc.build(hit, self.cache_len) if hit is not None else None,
                               start_len=hit.p if hit is not None else None, grid=pc.grid,
                               on_chunk=pc.recorder(ids))
        return Pending(Request(ids.tolist(), 1), pre, None, None, cached_tokens=hit.p if hit is not None else 0)

    def group(self, pendings) -> None:
        """Prefill these prepared requests (`prefill`, none advanced yet) together: one pass per chunk for all of them
        (`loop.PrefillGroup`). Their prompts must have one shape (`model.prefill.prompt_shape`) and their number must be one of
        `group_sizes` (one compilation each); then admit them all (the first advance() / admit runs the group)."""
        pendings = list(pendings)
        if any(p.cached_tokens for p in pendings):
            raise ValueError("a prompt resumed from the prefix cache prefills on its own")
        n = pendings[0]._pre.shape
        sizes = self.group_sizes_of(n[0])
        if len(pendings) not in sizes:
            raise ValueError(f"{len(pendings)} prompts of chunk width {n[0]} cannot prefill together "
                             f"(group sizes {sizes})")
        loop_lib.PrefillGroup([p._pre for p in pendings])

    def group_sizes(self, n_tokens: int) -> tuple[int, ...]:
        """How many prompts of n_tokens tokens may prefill together (`group`): 2, 4, 8, ... with k·width <=
        group_rows and k <= max_group (one compilation per size and chunk width; (): one by one)."""
        return self.group_sizes_of(chunk_size(n_tokens))

    def group_sizes_of(self, width: int) -> tuple[int, ...]:
        cap = min(self.max_group, self.group_rows // width)
        return tuple(k for k in (2 ** i for i in range(1, 31)) if k <= cap)

    def free(self) -> int:
        """Free slots (max_batch - active)."""
        return self.max_batch - len(self._live) - len(self._joining)

    def admit(self, pending: Pending) -> int:
        """The prefilled request into a free slot -> its handle (an int, stable while the request lives). Its
        remaining prefill chunks (if any) are enqueued first; the slot is written before the next round."""
        if self.free() <= 0:
            raise ValueError(f"no free slot (max_batch={self.max_batch}); release() a finished request first")
        pending.state  # noqa: B018 (the remaining chunks and the start, enqueued)
        h = self._next
        self._next += 1
        self._joining[h] = pending
        return h

    def release(self, handle) -> None:
        """Free the request's slot (done, cancelled, client gone); safe any time, also for unknown handles."""
        self._joining.pop(handle, None)
        if self._live.pop(handle, None) is not None:
            self._slots = [None if s == handle else s for s in self._slots]

    def _single_plan(self, req: Request, budget) -> loop_lib.Plan:
        """generate's plan for this request (so that one active request runs generate's compiled round)."""
        auto = budget == "auto"
        return loop_lib.make_plan(self.target, self.dcfg, self.method, self.budget if auto else (budget or 0),
                                  inject=self.oracle_len > 0, budgets=self.table.candidates if auto else ())

    # ------------------------------------------------------------------------------------------- layout
    def _slot_budget(self, live: _Live, B: int):
        if self.method != "ddtree":
            return None
        b = self.bucket_budgets[B]
        return b if live.budget == "auto" else min(int(live.budget), b)

    def _budget_array(self, B: int):
        if self.method != "ddtree":
            return None
        return jnp.asarray([self._slot_budget(self._live[h], B) if h is not None else 0 for h in self._slots],
                           jnp.int32)

    def _oracle_array(self):
        if self._mode == "single":
            o = self._live[self._slots[0]].oracle
            return jnp.asarray(o if o is not None else np.zeros((1,), np.int32))
        L = self.oracle_len or 1
        rows = [self._live[h].oracle if (h is not None and self._live[h].oracle is not None) else np.zeros((L,),
                np.int32) for h in self._slots]
        return jnp.asarray(np.stack(rows))

    def _to_batched(self, slot, budget):
        """A per-slot state (start or single form) in batched form."""
        b = None if budget is None else jnp.int32(budget)
        return _bound(self.target, "with_budget", _with_budget, donate_argnums=(0,))(slot, b)

    def _to_single(self, slot, live: _Live):
        costs = self.costs if live.budget == "auto" else None
        fn = _bound(self.target, ("as_single", self.out_len), functools.partial(_as_single, out_len=self.out_len),
                    donate_argnums=(0,))
        return sharding.place(fn(slot, costs), self.target.mesh)  # as generate places its state (tp > 1)

    def _resize_to(self, B: int):
        """Batched state of B slots (adjacent buckets at a time: few resize compilations), live slots kept in order."""
        cur = len(self._slots)
        while cur != B:
            order = [i for i, h in enumerate(self._slots) if h is not None]
            nxt = self._next_bucket(cur, B)
            assert len(order) <= nxt
            idx = order + [-1] * (nxt - len(order)) if nxt < cur else list(range(cur)) + [-1] * (nxt - cur)
            self._state = _bound(self.target, "resize", _resize)(self._state, jnp.asarray(idx, jnp.int32))
            self._slots = [self._slots[i] if i >= 0 else None for i in idx]
            cur = nxt

    def _next_bucket(self, cur: int, want: int) -> int:
        i = self.buckets.index(cur)
        return self.buckets[i + 1] if want > cur else self.buckets[i - 1]

    def _arrange(self):
        """Apply joins and leaves before the next call: the layout for the active count (single / bucket B)."""
        if self._mode != "empty" and not self._live:  # every request left: start afresh
            self._mode, self._state, self._slots = "empty", None, []
        n = len(self._live) + len(self._joining)
        if n == 0:
            self._oracle = None
            return
        changed = bool(self._joining)
        if n == 1:
            if self._joining:  # one joiner, nothing else: generate's round
                (h, p), = self._joining.items()
                self._joining.clear()
                live = self._live[h] = self._make_live(p)
                self._state = self._to_single(self._to_batched(p.state, None), live)
                self._mode, self._slots = "single", [h]
            elif self._mode == "batched":  # the last live slot out of the batch
                (h,) = self._live
                self._resize_to(self.buckets[0])  # down to 2 slots first: one extract shape (warmup compiles it)
                slot = _bound(self.target, "extract", _extract)(self._state, jnp.int32(self._slots.index(h)))
                self._state = self._to_single(slot, self._live[h])
                self._mode, self._slots, changed = "single", [h], True
        else:
            want = next(B for B in self.buckets if B >= n)
            if self._mode == "single":  # the running request becomes slot 0 of a bucket of 2
                (h,) = self._live
                self._state = self._grow_from_one(self._to_batched(self._state, 0 if self.method == "ddtree" else None))
                self._mode, self._slots, changed = "batched", [h, None], True
            elif self._mode == "empty":  # the first joiner becomes slot 0 of a bucket of 2
                h, p = next(iter(self._joining.items()))
                del self._joining[h]
                live = self._live[h] = self._make_live(p)
                self._state = self._grow_from_one(self._to_batched(p.state, self._slot_budget(live, 2)))
                self._mode, self._slots = "batched", [h, None]
            cur = len(self._slots)
            B = cur if cur // 2 < n <= cur else want
            if B != cur:
                self._resize_to(B)
                changed = True
            for h, p in list(self._joining.items()):
                live = self._live[h] = self._make_live(p)
                slot = self._to_batched(p.state, self._slot_budget(live, B))
                i = self._slots.index(None)
                self._state = _bound(self.target, "write", _write, donate_argnums=(0,))(self._state, slot,
                                                                                        jnp.int32(i))
                self._slots[i] = h
            self._joining.clear()
            if changed and self.method == "ddtree":
                self._state = self._state.replace(budget=self._budget_array(len(self._slots)))
        if changed or self._oracle is None:
            self._oracle = self._oracle_array()

    def _make_live(self, p: Pending) -> _Live:
        first = jnp.array(p.state.root, copy=True)  # its own buffer: the state is donated to the next call
        first.copy_to_host_async()
        return _Live(p.req, p.budget, self._single_plan(p.req, p.budget), p.oracle, first=first)

    def _grow_from_one(self, slot):
        """A batched state of 2 slots: `slot` (batched form) and an empty one."""
        one = _bound(self.target, "stack1", _stack1)(slot)
        return _bound(self.target, "resize", _resize)(one, jnp.asarray([0, -1], jnp.int32))

    # ------------------------------------------------------------------------------------------- rounds
    def _fn(self):
        """The bound round of the current layout (looked up once per layout, not hashed per call)."""
        tgt = self.target
        if self._mode == "single":
            live = self._live[self._slots[0]]
            if live.fn is None:
                live.fn = loop_lib.loop_fn(tgt, self.dcfg, live.single_plan, self.sync_every)
            return live.fn
        B = len(self._slots)
        fn = self._slot_fns.get(B)
        if fn is None:
            plan = batch_plan(tgt, self.dcfg, self.method, self.bucket_budgets[B], inject=self.oracle_len > 0)
            fn = self._slot_fns[B] = slots_fn(tgt, self.dcfg, plan, B, self.sync_every)
        return fn

    def _call(self):
        self._state, prog = self._fn()(self.target.leaves, self.dparams, self._state, self._oracle)
        for x in (prog.done, prog.n_out, prog.n_rounds, prog.out, prog.accepted):
            x.copy_to_host_async()
        return prog

    def step(self) -> dict[int, SlotUpdate]:
        """Enqueue the next call of sync_every rounds for all active slots and return the updates of the previous
        call (one call in flight ahead); {} when nothing is active."""
        prev = self._inflight
        self._inflight = None
        self._arrange()
        if self._mode != "empty":
            B = len(self._slots)
            snapshot = {h: i for i, h in enumerate(self._slots) if h is not None}
            budgets = {h: (self._live[h].budget if self._mode == "single" else self._slot_budget(self._live[h], B))
                       for h in snapshot}
            self._inflight = (self._call(), snapshot, self._mode, budgets)
        updates = self._read(prev) if prev is not None else {}
        # a request admitted for this call: its first token now (its start ran before this call's rounds: the read
        # waits for the start, not for the rounds), not one call later
        for h in list(self._inflight[1]) if self._inflight else []:
            live = self._live.get(h)
            if live is not None and live.first is not None and h not in updates:
                tok = int(np.asarray(live.first)[0])
                live.first, live.shown = None, max(live.shown, 1)
                updates[h] = SlotUpdate(tokens=[tok], done=False, rounds=0, accepted=0,
                                        budget=self._inflight[3][h])
        return updates

    def _read(self, inflight) -> dict[int, SlotUpdate]:
        prog, snapshot, mode, budgets = inflight
        done, n_out, n_rounds, out, acc = jax.device_get((prog.done, prog.n_out, prog.n_rounds, prog.out,
                                                          prog.accepted))
        updates = {}
        for h, i in snapshot.items():
            live = self._live.get(h)
            if live is None:  # released since
                continue
            if mode == "single":
                d, n, r, o, a = done, n_out, n_rounds, out[0], acc
            else:
                d, n, r, o, a = done[i], n_out[i], n_rounds[i], out[i, 0], acc[i]
            n = int(n)
            toks = o[live.shown:n].tolist() if n > live.shown else []
            live.shown = max(live.shown, n)
            live.done = bool(d)
            updates[h] = SlotUpdate(tokens=toks, done=bool(d), rounds=int(r), accepted=int(a), budget=budgets[h])
        return updates

    def drain(self) -> dict[int, SlotUpdate]:
        """The updates of the call in flight (none enqueued after it); {} when none is."""
        prev, self._inflight = self._inflight, None
        return self._read(prev) if prev is not None else {}

    # ------------------------------------------------------------------------------------------- warmup
    def programs(self, pendings) -> list:
        """(jitted function, abstract arguments) of the heavy programs a warm-up runs, for `precompile.compile_all`:
        per prepared request (`prefill`, not advanced; one per prefill width) its prefill, drafter pass and start and
        its width's group passes; the single-slot round of the first one's budget; every bucket's batched round. The
        rounds come first (the longest compilations: `compile_all` starts each as soon as it is lowered)."""
        A, shape_of = precompile_lib.abstract, precompile_lib.shape_of
        tgt, i32 = self.target, jax.ShapeDtypeStruct((), jnp.int32)
        prefills, start = [], None
        for p in pendings:
            js, start = p._pre.programs()
            prefills += js
            for k in self.group_sizes_of(p.width):
                prefills += loop_lib.PrefillGroup.programs(p._pre, k)
        jobs = []
        p = pendings[0]
        with_budget = _bound(tgt, "with_budget", _with_budget, donate_argnums=(0,))
        as_single = _bound(tgt, ("as_single", self.out_len), functools.partial(_as_single, out_len=self.out_len),
                           donate_argnums=(0,))
        single = shape_of(as_single, shape_of(with_budget, start, None), A(self.costs) if p.budget == "auto" else None)
        L = self.oracle_len or 1
        jobs.append((loop_lib.loop_fn(tgt, self.dcfg, self._single_plan(p.req, p.budget), self.sync_every),
                     (tgt.leaves, self.dparams, single, jax.ShapeDtypeStruct((L,), jnp.int32))))
        if self.buckets:
            slot = shape_of(with_budget, start, i32 if self.method == "ddtree" else None)
            resize = _bound(tgt, "resize", _resize)
            state = shape_of(_bound(tgt, "stack1", _stack1), slot)
            for B in self.buckets:
                state = shape_of(resize, state, jax.ShapeDtypeStruct((B,), jnp.int32))
                plan = batch_plan(tgt, self.dcfg, self.method, self.bucket_budgets[B], inject=self.oracle_len > 0)
                jobs.append((slots_fn(tgt, self.dcfg, plan, B, self.sync_every),
                             (tgt.leaves, self.dparams, state, jax.ShapeDtypeStruct((B, L), jnp.int32))))
        return jobs + prefills

    def warmup_widths(self, lengths=None) -> list[tuple[int, int]]:
        """The prefill widths `warmup` compiles, as (chunk width, a prompt length that uses it): every width a prompt
        that fits the caches can take, or (lengths) only those prompts' widths (and, with a prefix cache,
        PREFILL_CHUNK's); ValueError when none of `lengths` fits."""
        fits = lambda n: loop_lib.capacity(self.target, self.dcfg, self.method, self.budget, n, 2)[1] <= self.cache_len
        widths = [(w, n) for w, n in chunk_widths(self.target.config.max_position_embeddings - 2) if fits(n)]
        if lengths is not None:
            used = {chunk_size(int(n)) for n in lengths} | ({PREFILL_CHUNK} if self.prefix_cache is not None else set())
            widths = [(w, n) for w, n in widths if w in used]
            if not widths:
                raise ValueError(f"no prompt of lengths {sorted(set(lengths))} fits the cache ({self.cache_len} rows)")
        return widths

    def warmup(self, prompt_ids, progress=None, lengths=None) -> None:
        """Compile what a request can run: every prefill width (prompts up to the cache capacity), the single-slot
        round, every slot-count bucket and its joins / resizes (greedy, sampled and truncated requests share each
        program: the sampling class is data, `tree.posterior_by_mode`).
        lengths: the only prompt lengths that will come (a benchmark): only their chunk widths are compiled (and,
        with a prefix cache, PREFILL_CHUNK's: a resumed prefill's last few tokens, `loop.Prefill`) (at 27B
        on the H200 each width's prefill programs, alone and in groups of 2 / 4 / 8, take ≈ 4 × 50 s).
        progress(done, total, what): called after each stage (a prefill width, a bucket), e.g. to print it."""
        ids = check_ids(prompt_ids, "prompt_ids").tolist()
        pc = self.prefix_cache
        widths = self.warmup_widths(lengths)

        def prompt(n):
            return _repeat(ids, n)

        def run_all(reqs=(), pending=()):
            hs = [self.admit(p) for p in [self.prefill(r) for r in reqs] + list(pending)]
            left = set(hs)
            while left:
                for h, u in self.step().items():
                    if u.done and h in left:
                        self.release(h)
                        left.discard(h)
            self.drain()

        stages = list(self.buckets)
        pre = self.target.mesh is None and self.precompile
        total, done = len(widths) + len(stages) + pre, 0

        def tick(what):
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total, what)

        if pre:  # the heavy programs side by side in threads; what follows finds them compiled
            ps = []
            for w, n in widths:
                try:
                    ps.append(self.prefill(Request(prompt(n), 2)))
                except ValueError:
                    pass
            n = precompile_lib.compile_all(self.programs(ps)) if ps else 0
            tick(f"the prefill and round programs ({n}, side by side)")
        for w, n in widths:
            try:
                run_all([Request(prompt(n), 2)])
            except ValueError:
                pass
            for k in self.group_sizes(n):  # joiners prefilled together (`group`)
                if pc is not None:  # (no hit: a hit prefills on its own)
                    pc.clear()
                ps = [self.prefill(Request(prompt(n), 2)) for _ in range(k)]
                self.group(ps)
                run_all(pending=ps)
            groups = self.group_sizes(n)
            tick(f"prefill of {w}-token chunks" + (f" (and groups of {', '.join(map(str, groups))})" if groups else "")
                 + ", with the rounds they start")
        if pc is not None and len(pc):  # a hit's copies (one shape for all: the prompts' snapshots made the rest)
            jax.block_until_ready(pc.build(pc.snapshots()[-1], self.cache_len))
        base = prompt(min(len(ids), 64) if lengths is None else widths[0][1])  # (a compiled width)
        # join one at a time up to B, then leave down to one: every resize and bucket
        for B in stages:
            hs = []
            for k in range(B):
                hs.append(self.admit(self.prefill(Request(base, 4 * self.sync_every + 2))))
                self.step()
            for h in hs[:-1]:
                self.release(h)
                self.step()
            self.release(hs[-1])
            self.step()
            self.drain()
            tick(f"{B} slots: rounds, joins and leaves")
        if pc is not None:  # the warm-up's prompts are nobody's prefixes
            pc.clear()


def _repeat(ids: list, n: int) -> list:
    return (ids * (n // len(ids) + 1))[:n]


def single_slot_programs(target: Target, drafter, prompt_ids, **pool_kw) -> list:
    """The heavy programs of a warm-up that do not depend on the slot count (every prefill width alone, the start,
    the single-slot round) of a pool made with `pool_kw` (SlotPool's keyword arguments; max_batch and max_group
    ignored), for `precompile.compile_all`: what a server can compile while its weights load, before the device
    memory they leave fixes its slots (target and drafter may be abstract: `model.target.abstract_target`)."""
    pool = SlotPool(target, drafter, **dict(pool_kw, max_batch=1, max_group=1, precompile=False))
    ids = check_ids(prompt_ids, "prompt_ids").tolist()
    return pool.programs([pool.prefill(Request(_repeat(ids, n), 2)) for _, n in pool.warmup_widths()])


def generate_many(target: Target, requests, *, drafter=None, method: str = "ar", max_batch: int = 4, join_at=None,
                  tree_budget="auto", cache_len: int | None = None, sync_every: int = 1, slot_rows: int = 128,
                  budget_costs=None, _oracle_len: int = 0, pool: SlotPool | None = None) -> list[loop_lib.Generation]:
    """Run `requests` (`Request`s) through a SlotPool: request i joins at step join_at[i] (default 0) or, when no
    slot is free then, as soon as one is. -> one `loop.Generation` per request (tokens; stats: rounds, accepted,
    budgets reported per update, the step it joined)."""
    requests = list(requests)
    join_at = [0] * len(requests) if join_at is None else list(join_at)
    if pool is None:
        if cache_len is None:
            cache_len = max(loop_lib.cache_positions(target, drafter, method, tree_budget, len(r.ids), r.max_new,
                                                     budget_costs) for r in requests)
        pool = SlotPool(target, drafter, method=method, max_batch=max_batch, cache_len=cache_len,
                        tree_budget=tree_budget, budget_costs=budget_costs, slot_rows=slot_rows,
                        sync_every=sync_every, _oracle_len=_oracle_len)
    tokens = [[] for _ in requests]
    stats = [dict(rounds=0, accepted=0, budgets=[], joined=None) for _ in requests]
    handle_of = {}
    waiting = list(range(len(requests)))
    left = len(requests)
    step = 0
    while left:
        for i in list(waiting):
            if join_at[i] <= step and pool.free() > 0:
                handle_of[pool.admit(pool.prefill(requests[i]))] = i
                stats[i]["joined"] = step
                waiting.remove(i)
        ups = pool.step() if (handle_of or not waiting) else {}
        if not handle_of and not ups and not waiting:
            ups = pool.drain()
        for h, u in ups.items():
            i = handle_of.get(h)
            if i is None:
                continue
            tokens[i] += u.tokens
            stats[i].update(rounds=u.rounds, accepted=u.accepted)
            stats[i]["budgets"].append(u.budget)
            if u.done:
                pool.release(h)
                del handle_of[h]
                left -= 1
        step += 1
    pool.drain()
    out = []
    for t, s in zip(tokens, stats):
        s["mean_acceptance_length"] = s["accepted"] / s["rounds"] if s["rounds"] else 0.0
        out.append(loop_lib.Generation(tokens=t, acceptance_lengths=[], stats=s))
    return out
