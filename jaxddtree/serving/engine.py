"""The generation engine: continuous batching of up to `max_batch` requests on the device, the others in a
bounded queue.

A scheduler thread drives a `SlotPool` (speculative/batch.py): each iteration it
  1. takes the next waiting job when a slot is free (`pool.prefill`: validated, nothing run yet), and with it the
     jobs right behind it in the queue whose prompts have its shape (chunk width and count), as many as the
     pool prefills together (`pool.group`: one pass per chunk for all of them, up to `prefill_tokens` rows),
  2. advances the joining prefill by passes of at most `prefill_tokens` rows in all per round (`Pending.advance`;
     every pass at once when no slot decodes, as nobody waits), and admits the jobs into free slots once their
     prefill is done, so that the running requests stall for at most one such pass per round,
  3. releases the slots of requests whose client went away,
  4. runs `pool.step()` (the next call of rounds for every active slot is enqueued; the previous call's tokens
     come back) and hands each slot's new tokens to its job: detokenised (`TextStream`), pushed to the job's
     asyncio queue (thread-safe, through the event loop), the job finished (`pool.release`) at max_tokens, a
     stop string or a stop id.
When nothing runs and nothing joins it blocks on the queue. The queue holds only waiting jobs (`queue_size` of
them; more get `QueueFull`, the app's 503); running and joining ones have left it. A failure fails the requests
it touches (a prefill: its request; a step: the running ones), never the server.

Every slot has caches of one capacity (`cache_len`, for `max_context` tokens) and max_tokens is data, so the
pool's compiled functions serve all requests; `warmup` compiles them before the server listens: nothing
compiles afterwards. How many slots fit is checked at start (`fit_max_batch`): the caches of `peak_slots(N)` slots
+ a working reserve must fit in the device's free memory.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxddtree.model.prefill import prompt_shape
from jaxddtree.text import TextStream, default_stop_ids
from jaxddtree.speculative import prefix_cache as prefix_lib
from jaxddtree.speculative.batch import Request, SlotPool, buckets
from jaxddtree.speculative.loop import capacity, resolve_budget

AUTO_MAX_BATCH = 16  # max_batch="auto": the largest power of two up to this that fits in memory
MAX_GROUP = 8  # joining prompts prefilled together at most (fewer where their caches would not fit: `fit_group`)
PREFILL_TOKENS = 2048  # default prompt rows prefilled per round while others decode (one pass at 27B ≈ 0.26 s)
CPU_AUTO_MAX_BATCH = 4  # ... on a device without memory statistics (the CPU)
GIB = 1 << 30
PREFIX_CACHE_SHARE = 0.8  # default prefix cache: this share of the memory the slots leave (the rest: its transients)
CPU_PREFIX_CACHE_GIB = 1.0  # ... on a device without memory statistics
REMEMBER = 8  # finished requests waiting for their prompt + completion to be snapshotted, at most (the newest kept)
_NOTHING = object()  # no job waiting


@dataclasses.dataclass
class _Remember:
    """A finished request's prompt + completion being prefilled for the prefix cache only (`SlotPool.remember`)."""
    ids: list[int]
    pending: Any
    width: int


def _extends(prompt, ids) -> bool:
    """Whether the token ids `prompt` start with `ids` (and go on)."""
    return len(prompt) > len(ids) and list(prompt[:len(ids)]) == list(ids)


def warmup_printer(prog: str):
    """A `warmup` progress callback printing one line per stage to stderr:
    "<prog>: warm-up 3/9 (41 s): prefill of 2048-token chunks compiled"."""
    t0 = time.perf_counter()

    def show(done, total, what):
        print(f"{prog}: warm-up {done}/{total} ({time.perf_counter() - t0:.0f} s): {what} compiled",
              file=sys.stderr, flush=True)
    return show


class QueueFull(Exception):
    """The bounded request queue is full."""


class _JobQueue:
    """The bounded FIFO of waiting jobs (thread-safe): put_nowait (QueueFull past `maxsize`), get (blocking or not),
    and take_run: the run of jobs at its head that match (a prefill group), as one step."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()

    def put_nowait(self, job):
        with self._cv:
            if job is not None and len(self._items) >= self.maxsize:
                raise queue.Full
            self._items.append(job)
            self._cv.notify()

    def get(self, block: bool = True):
        with self._cv:
            while block and not self._items:
                self._cv.wait()
            if not self._items:
                raise queue.Empty
            return self._items.popleft()

    def take_run(self, match, limit: int) -> list:
        """Up to `limit` jobs from the head while match(job) holds (the close sentinel never matches)."""
        with self._cv:
            out = []
            while len(out) < limit and self._items and self._items[0] is not None and match(self._items[0]):
                out.append(self._items.popleft())
            return out

    def count_run(self, match, limit: int) -> int:
        with self._cv:
            n = 0
            for j in self._items:
                if n >= limit or j is None or not match(j):
                    break
                n += 1
            return n

    def peek(self):
        """The job at the head (None: the close sentinel), or _NOTHING when nothing waits."""
        with self._cv:
            return self._items[0] if self._items else _NOTHING

    def qsize(self) -> int:
        with self._cv:
            return sum(j is not None for j in self._items)


@dataclasses.dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    top_k: int = 0      # sampling truncation (generate's top_k / top_p / min_p); the defaults: off
    top_p: float = 1.0
    min_p: float = 0.0
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = 0.0  # time.perf_counter() at submit

    def cancel(self):
        self.cancelled.set()

    def push(self, kind: str, value: Any):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # its event loop is closed (the server shut down): nobody listens
            pass


@dataclasses.dataclass
class _Run:
    """A job in the scheduler: joining (`pending`, its prefill under way) or running in slot `handle`."""
    job: Job
    stream: TextStream
    t0: float  # left the queue
    pending: Any = None
    chunks: int = 1  # the prompt's prefill chunks
    width: int = 1  # their rows
    advanced: int = 0  # advance() calls so far
    mates: list = dataclasses.field(default_factory=list)  # the runs prefilled with it (itself included)
    handle: int | None = None
    kept: list[int] = dataclasses.field(default_factory=list)  # completion tokens (up to max_tokens / a stop)
    ttft: float | None = None
    rounds: int = 0
    accepted: int = 0
    budget_rounds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    budget: Any = None
    peers: int = 1  # most requests running at once while it ran (itself included)
    cached: int = 0  # prompt tokens whose caches were reused (a prefix cache's hit; 0 without one)
    cut: bool = False  # ended by a stop string (its kept tokens run past the text the client got)
    last: float | None = None  # time of its latest tokens


def _slot_bytes(target, drafter, cache_len: int) -> int:
    """Device bytes of one slot's caches on one device: the target's (split by heads over tp) + the drafter's."""
    n = target.cache_bytes(cache_len) // target.tp
    if drafter is not None:
        n += sum(x.size * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(jax.eval_shape(lambda: drafter.init_cache(1, cache_len))))
    return n


def _reserve_bytes(cfg, chunk: int, slot_rows: int) -> int:
    """Working memory besides the caches: a prefill chunk's activations (loop.check_memory's rule: the MLP's
    gate|up rows dominate), a batched verify's fp32 logits (slot_rows rows, twice), 1 GiB to spare."""
    return 2 * chunk * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * 4 + 2 * slot_rows * cfg.vocab_size * 4 + GIB


def prefix_cache_budget(gb, memory: dict | None, target) -> int:
    """Device bytes of the prefix cache: `gb` GiB when given (0: off); by default PREFIX_CACHE_SHARE of what the
    slots leave (`fit_max_batch`'s figures: free - peak slots - reserve), CPU_PREFIX_CACHE_GIB without memory
    statistics; 0 (off) with tensor parallelism (not supported yet)."""
    if gb is not None:
        if not float(gb) >= 0:
            raise ValueError(f"prefix_cache_gb must be >= 0, got {gb}")
        if float(gb) > 0 and getattr(target, "tp", 1) > 1:
            raise ValueError("the prefix cache needs --tp 1 (use --prefix-cache-gb 0)")
        return int(float(gb) * GIB)
    if getattr(target, "tp", 1) > 1:
        return 0
    if memory is None:
        return int(CPU_PREFIX_CACHE_GIB * GIB)
    left = memory["free_gib"] - memory["peak_slots"] * memory["slot_gib"] - memory["reserve_gib"]
    return int(max(0.0, left) * PREFIX_CACHE_SHARE * GIB)


def peak_slots(max_batch: int, group: int = 1) -> int:
    """Slots' caches alive at once at the worst moment of a pool of max_batch slots: the largest bucket and the one
    below it while the batch is resized between them (the resize copies), + a joining request's caches (a prefill
    group of `group` > 1 requests: twice theirs, stacked while they prefill and copied out at the end)."""
    bs = (1,) + buckets(max_batch)
    return bs[-1] + (bs[-2] if len(bs) > 1 else 0) + (2 * group if group > 1 else 1)


def fit_group(target, drafter, cache_len: int, max_batch: int, rows: int, slot_rows: int = 128, device=None,
              want: int = MAX_GROUP) -> int:
    """The most joining requests to prefill together (a power of two <= want and <= max_batch; 1: one by one) whose
    caches fit besides max_batch slots' (`peak_slots(max_batch, group)`); unchecked on a device without memory
    statistics."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    g = 1
    while g * 2 <= min(want, max_batch):
        g *= 2
    if not stats or "bytes_limit" not in stats:
        return g
    slot = _slot_bytes(target, drafter, cache_len)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    reserve = _reserve_bytes(target.config, rows, slot_rows)
    while g > 1 and peak_slots(max_batch, g) * slot + reserve > free:
        g //= 2
    return g


def fit_max_batch(target, drafter, cache_len: int, max_context: int, chunk: int, max_batch, slot_rows: int = 128,
                  device=None) -> tuple[int, dict | None]:
    """-> (max_batch, memory figures or None). `max_batch` "auto": the largest power of two <= AUTO_MAX_BATCH
    whose slots fit (CPU_AUTO_MAX_BATCH on a device without memory statistics; 1 with tensor parallelism); an int:
    checked. N slots need `peak_slots(N)` x one slot's caches + a working reserve (`_reserve_bytes`) in the device's
    free memory (the weights already loaded). ValueError (one line) when it does not fit, naming the largest
    max_batch that does."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    auto = isinstance(max_batch, str)
    if auto and max_batch.strip().lower() != "auto":
        raise ValueError(f"max_batch must be an int >= 1 or 'auto', got {max_batch!r}")
    if not auto and int(max_batch) < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if getattr(target, "tp", 1) > 1:  # batched rounds run on one device
        if not auto and int(max_batch) > 1:
            raise ValueError(f"--max-batch {max_batch} needs --tp 1: batched rounds run on one device")
        auto, max_batch = False, 1
    if not stats or "bytes_limit" not in stats:
        return (CPU_AUTO_MAX_BATCH if auto else int(max_batch)), None
    slot = _slot_bytes(target, drafter, cache_len)
    reserve = _reserve_bytes(target.config, chunk, slot_rows)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    fits = 0
    while fits < 4096 and peak_slots(fits + 1) * slot + reserve <= free:
        fits += 1
    mem = {"slot_gib": slot / GIB, "reserve_gib": reserve / GIB, "free_gib": free / GIB, "fits": fits,
           "cache_positions": cache_len}
    where = (f"on {device.device_kind}: one slot's caches for max_context {max_context} ({cache_len} positions) take "
             f"{slot / GIB:.2f} GiB, the working reserve {reserve / GIB:.1f} GiB, {free / GIB:.1f} GiB are free")
    if fits < 1:
        raise ValueError(f"not even one request fits {where}; lower --max-context")
    if auto:
        n = 1
        while n * 2 <= min(AUTO_MAX_BATCH, fits):
            n *= 2
        mem["peak_slots"] = peak_slots(n)
        return n, mem
    n = int(max_batch)
    if n > fits:
        raise ValueError(f"--max-batch {n} does not fit {where} (at most {peak_slots(n)} slots' caches at once: "
                         f"resizes and a joining request); at most --max-batch {fits} fits (or lower --max-context)")
    mem["peak_slots"] = peak_slots(n)
    return n, mem


class Engine:
    """Owns the model pair, the slot pool and the scheduler thread. `submit` queues a job (QueueFull when the
    queue is full); the job's events are ("delta", text) ..., then ("done", info) or ("error", message).

    max_batch: requests decoded at once (an int, or "auto": what fits in memory, `fit_max_batch`); slot_rows:
    the pool's verify rows per batched round (each slot's tree budget shrinks as the batch grows); prefill_tokens:
    the prompt rows prefilled per round while others decode (their stall per round: at least one chunk), also the
    most rows of one pass of joining prompts prefilled together;
    pool_factory(target, drafter, **SlotPool's keyword arguments): the pool (default: speculative.batch.SlotPool;
    tests pass fakes)."""

    def __init__(self, target, drafter, tokenizer, *, name: str = "jaxddtree", method: str = "ddtree",
                 budget: int | str = "auto", max_context: int | None = None, queue_size: int = 64, stop_ids=None,
                 default_max_tokens: int = 256, budget_costs=None, max_batch: int | str = 1, slot_rows: int = 128,
                 prefill_tokens: int = PREFILL_TOKENS, pool_factory: Callable | None = None,
                 prefix_cache_gb: float | None = None, prefix_cache_grid: int = prefix_lib.GRID):
        cfg = target.config
        self.target, self.drafter, self.tokenizer, self.name = target, drafter, tokenizer, name
        self.method = method if drafter is not None else "ar"
        self.budget = budget
        self.default_max_tokens = default_max_tokens  # chat completions without max_tokens (completions: 16)
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.stop_ids = default_stop_ids(cfg, tokenizer) if stop_ids is None else list(stop_ids)
        dcfg = drafter.config if self.method != "ar" else None
        # budget="auto": its round-time table resolved once (a CostTable; None: the default), the caches sized for
        # the widest verify (the largest candidate)
        widest, self.budget_costs = resolve_budget(budget, self.method, cfg.vocab_size, dcfg, budget_costs)
        chunk, self.cache_len = capacity(target, dcfg, self.method, widest, self.max_context, 0)
        if int(prefill_tokens) < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.prefill_tokens = int(prefill_tokens)
        rows = max(chunk, self.prefill_tokens)  # the widest prefill pass
        # one line, before anything is compiled, when the slots' caches for max_context do not fit (ValueError)
        self.max_batch, self.memory = fit_max_batch(target, drafter if dcfg else None, self.cache_len,
                                                    self.max_context, rows, max_batch, slot_rows)
        self.prefill_group = fit_group(target, drafter if dcfg else None, self.cache_len, self.max_batch, rows,
                                       slot_rows) if self.max_batch > 1 else 1
        if self.memory is not None:
            self.memory["prefill_group"] = self.prefill_group
            self.memory["peak_slots"] = peak_slots(self.max_batch, self.prefill_group)
        self.slot_rows = slot_rows
        # the prefix cache: prefix_cache_gb GiB (None: PREFIX_CACHE_SHARE of the memory left after the slots'
        # peak and the working reserve; CPU_PREFIX_CACHE_GIB on a device without memory statistics; 0: off)
        self.prefix_cache_budget = prefix_cache_budget(prefix_cache_gb, self.memory, target)
        self.prefix_cache = (prefix_lib.PrefixCache(target, drafter if dcfg else None, self.prefix_cache_budget,
                                                    grid=prefix_cache_grid)
                             if self.prefix_cache_budget > 0 else None)
        if self.memory is not None:
            self.memory["prefix_cache_gib"] = self.prefix_cache_budget / GIB
        extra = {"prefix_cache": self.prefix_cache} if self.prefix_cache is not None else {}
        self.pool = (pool_factory or SlotPool)(
            target, drafter if dcfg else None, method=self.method, max_batch=self.max_batch,
            cache_len=self.cache_len, tree_budget=budget, budget_costs=self.budget_costs, slot_rows=slot_rows,
            sync_every=1, max_group=self.prefill_group, group_rows=self.prefill_tokens, **extra)
        self.queue_size = queue_size
        self._queue = _JobQueue(max(1, queue_size))
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        # observer: None or an object with first_token(s), tokens(n, s_per_token), finished(reason, info) called
        # from the scheduler thread (serving/metrics.py's ServerMetrics)
        self.observer = None
        self.busy = False
        self._running = 0  # requests in slots or joining
        # the end of a finished request (issue 39): its prompt + completion, prefilled from the prompt's end in idle
        # time and snapshotted (`_remember_step`): (ids, prompt length) of the finished ones, newest last; the one
        # under way; how many of both (read by `remembering`, from any thread); snapshots made so far
        self._to_remember: collections.deque = collections.deque()
        self._remembering: _Remember | None = None
        self._remember_left = 0
        self.remembered = 0
        self._thread = threading.Thread(target=self._work, name="jaxddtree-scheduler", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- asyncio side
    def submit(self, job: Job) -> Job:
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        job.submitted = time.perf_counter()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self.queue_size} requests are already waiting") from None
        return job

    def waiting(self) -> int:
        return self._queue.qsize()

    def running(self) -> int:
        """Requests in a slot or joining one."""
        return self._running

    def close(self):
        self._queue.put_nowait(None)

    def remembering(self) -> bool:
        """Whether finished requests' ends are still to be snapshotted (tests wait for it to settle)."""
        return self._remember_left > 0

    def prefix_cache_bytes(self) -> int:
        """Device bytes the pool's prefix cache holds (0: the pool has none)."""
        return int(getattr(self.pool, "prefix_cache_bytes", 0) or 0)

    def _observe(self, what: str, *args):
        if self.observer is not None:
            try:
                getattr(self.observer, what)(*args)
            except Exception as e:  # metrics never fail a request
                print(f"jaxddtree.serving: metrics: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def warmup(self, prompt_ids, progress=None, lengths=None):
        """Compile everything a request can run (`pool.warmup`: every prefill width, the single-slot round, the
        round of every slot-count bucket, joins and resizes; greedy and sampled requests share each program),
        before the server listens. lengths: the prompt lengths a benchmark sends (only their prefill widths).
        progress(done, total, what): called after each stage (`SlotPool.warmup`)."""
        self.pool.warmup(list(prompt_ids) or [0], progress=progress, lengths=lengths)

    # ---------------------------------------------------------------- scheduler side
    def _request(self, job: Job):
        room = self.max_context - len(job.prompt_ids)
        return Request(ids=list(job.prompt_ids), max_new=min(job.max_tokens, room), temperature=job.temperature,
                       top_k=job.top_k, top_p=job.top_p, min_p=job.min_p, seed=job.seed,
                       stop_ids=tuple(self.stop_ids))

    def _work(self):
        runs: dict[int, _Run] = {}  # by pool handle
        joining: list[_Run] = []  # prefilling: a job, or jobs prefilled together, then the rest of its batch
        closing = False
        while True:
            self.busy, self._running = bool(runs or joining), len(runs) + len(joining)
            pool = self.pool
            # 0. a finished request's end into the prefix cache, while no other job waits (`_remember_step`)
            if not joining and (self._remembering is not None or self._to_remember):
                self._remember_pick(pool, closing)
            # 1. the next waiting job(s), when a slot is free (blocking when there is nothing else to do)
            if not joining and self._remembering is None and not closing and pool.free() > 0:
                try:
                    job = self._queue.get(block=not runs)
                except queue.Empty:
                    job = _NOTHING
                if job is None:  # close()
                    closing = True
                elif job is not _NOTHING:
                    pool = self.pool  # (read again: the wait may have been long)
                    try:
                        joining = self._join(pool, job)
                    except Exception as e:  # fails the request (a 500 / an error event), never the scheduler
                        self.counts["failed"] += 1
                        job.push("error", f"generation failed: {type(e).__name__}: {e}")
                        self._observe("finished", "error", {})
                        joining = []
            if closing and not runs and not joining:
                return
            # 2. prefill passes of the joining job(s) (up to prefill_tokens rows; all when no slot decodes), admits
            if joining:
                joining = self._advance(pool, joining, runs)
            elif self._remembering is not None:
                self._remember_step(bool(runs))
            # 3. clients gone
            for h, r in list(runs.items()):
                if r.job.cancelled.is_set():
                    del runs[h]
                    self._release(pool, h)
                    self._cancelled(r)
            # 4. the next call of rounds; the previous call's tokens to their jobs
            if runs:
                n = len(runs)
                for r in runs.values():
                    r.peers = max(r.peers, n)
                try:
                    updates = pool.step()
                except Exception as e:  # fails the running requests, not the server
                    for h, r in list(runs.items()):
                        del runs[h]
                        self._release(pool, h)
                        self._fail(r, e)
                    continue
                for h, u in updates.items():
                    r = runs.get(h)
                    if r is None:  # released since (cancelled): its late tokens are dropped
                        continue
                    try:
                        finish = self._feed(r, u)
                    except Exception as e:
                        finish = e
                    if finish is not None:
                        del runs[h]
                        self._release(pool, h)
                        if isinstance(finish, Exception):
                            self._fail(r, finish)
                        elif finish == "cancelled":
                            self._cancelled(r)
                        else:
                            self._finish(r, finish)

    def _join(self, pool, job: Job) -> list[_Run]:
        """The job, and the jobs right behind it whose prompts have its shape as many as prefill together with it
        (`pool.group_sizes`, free slots) -> their runs (validated: a request that does not fit fails alone)."""
        sizes = pool.group_sizes(len(job.prompt_ids)) if pool.free() > 1 else ()
        jobs = [job]
        if sizes:
            shape = prompt_shape(len(job.prompt_ids))

            def match(j):
                return prompt_shape(len(j.prompt_ids)) == shape and not j.cancelled.is_set()
            limit = min(max(sizes), pool.free()) - 1
            n = 1 + self._queue.count_run(match, limit)
            jobs += self._queue.take_run(match, max([1] + [g for g in sizes if g <= n]) - 1)
        runs = []
        for j in jobs:
            if j.cancelled.is_set():
                self.counts["cancelled"] += 1
                self._observe("finished", "cancelled", {})  # (never prefilled: no tokens)
                continue
            n = len(j.prompt_ids)
            w, chunks = prompt_shape(n)
            r = _Run(job=j, stream=TextStream(self.tokenizer, j.stop), t0=time.perf_counter(), chunks=chunks,
                     width=w)
            try:
                r.pending = pool.prefill(self._request(j))
            except Exception as e:  # ValueError: the request does not fit the pool (one line)
                self._fail(r, e)
                continue
            r.cached = int(getattr(r.pending, "cached_tokens", 0) or 0)  # set by a pool with a prefix cache
            r.chunks = int(getattr(r.pending, "chunks", chunks))
            r.mates = [r]
            runs.append(r)
        # a prompt resumed from the prefix cache prefills on its own (its chunks start where its hit ends)
        k = max([1] + [g for g in sizes if g <= len(runs)]) if not any(r.cached for r in runs) else 1
        if k > 1:
            try:
                pool.group([r.pending for r in runs[:k]])
            except ValueError as e:  # not expected (one shape, a size the pool takes): then one by one
                print(f"jaxddtree.serving: {e}; these requests prefill one by one", file=sys.stderr, flush=True)
            else:
                for r in runs[:k]:
                    r.mates = runs[:k]
        return runs

    def _advance(self, pool, joining: list[_Run], runs: dict) -> list[_Run]:
        """Prefill passes of the joining runs, head first (a group's pass runs all its members' chunks): at most
        `prefill_tokens` rows in all while others decode (at least one pass; a start after the last chunk is not
        counted), every pass when nothing decodes; members admitted once their prefill is done -> the runs still
        joining."""
        spent = 0
        while joining:
            mates = joining[0].mates
            if all(m.job.cancelled.is_set() for m in mates):  # nobody waits for this prefill any more
                for m in mates:
                    joining.remove(m)
                    self._cancelled(m)
                continue
            rows = len(mates) * mates[0].width if mates[0].advanced < mates[0].chunks else 0
            if runs and spent and spent + rows > self.prefill_tokens:
                break
            try:
                done = mates[0].pending.advance()
            except Exception as e:
                for m in mates:
                    joining.remove(m)
                    self._fail(m, e)
                continue
            spent += rows
            for m in mates:
                m.advanced += 1
            if not done:
                continue
            for m in mates:
                joining.remove(m)
                if m.job.cancelled.is_set():
                    self._cancelled(m)
                    continue
                try:
                    m.handle = pool.admit(m.pending)
                except Exception as e:
                    self._fail(m, e)
                    continue
                m.pending = None
                runs[m.handle] = m
        return joining

    def _remember_pick(self, pool, closing: bool):
        """Start snapshotting a finished request's prompt + completion (`SlotPool.remember`: a prefill resumed from
        its prompt's end, never admitted; its cost is the completion's length) when no job waits, or when the job at
        the head of the queue extends it (an agent's next step: it waits the few passes and then hits deep); drop
        the one under way when another job waits (that job goes first) or the server closes."""
        if closing:
            if self._remembering is not None:
                self._remember_done()
            self._remember_left -= len(self._to_remember)
            self._to_remember.clear()
            return
        head = self._queue.peek()
        cur = self._remembering
        if cur is not None:
            if head is not _NOTHING and (head is None or not _extends(head.prompt_ids, cur.ids)):
                self._remember_done()
            return
        while self._to_remember:
            if head is _NOTHING:
                ids, n = self._to_remember[-1]
            else:
                ids, n = next(((i, n) for i, n in reversed(self._to_remember)
                               if head is not None and _extends(head.prompt_ids, i)), (None, 0))
                if ids is None:
                    return
            try:
                pending = pool.remember(ids, min_hit=n)
            except Exception as e:  # never fails the server; the next request just hits less deep
                print(f"jaxddtree.serving: prefix cache: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                pending = None
            if pending is not None:  # (set before the entry leaves the list: `remembering` stays true)
                self._remembering = _Remember(ids, pending, int(getattr(pending, "width", 1)))
            self._to_remember.remove((ids, n))
            if pending is not None:
                return
            self._remember_left -= 1

    def _remember_step(self, decoding: bool):
        """Prefill passes of the snapshot under way: at most `prefill_tokens` rows while others decode (at least
        one pass), all of them otherwise; dropped once every chunk is enqueued (the snapshot recorded)."""
        cur, spent = self._remembering, 0
        while not cur.pending.prefilled:
            if decoding and spent and spent + cur.width > self.prefill_tokens:
                return
            try:
                cur.pending.advance()
            except Exception as e:
                print(f"jaxddtree.serving: prefix cache: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._remember_done()
                return
            spent += cur.width
        self.remembered += 1
        self._remember_done()

    def _remember_done(self):
        self._remembering = None
        self._remember_left -= 1

    def _feed(self, r: _Run, u) -> str | None:
        """A slot's update into its job -> the finish reason when the job ends, else None."""
        if r.job.cancelled.is_set():
            return "cancelled"
        r.budget_rounds[_budget_key(u.budget)] += max(0, u.rounds - r.rounds)
        r.rounds, r.accepted, r.budget = u.rounds, u.accepted, u.budget
        new = list(u.tokens)[:r.job.max_tokens - len(r.kept)]
        r.kept.extend(new)
        delta, hit = r.stream.feed(new)
        now = time.perf_counter()
        if new:
            if r.last is not None:
                self._observe("tokens", len(new), (now - r.last) / len(new))
            r.last = now
        if delta:
            if r.ttft is None:
                r.ttft = now - r.t0
                self._observe("first_token", now - r.job.submitted)
            r.job.push("delta", delta)
        if hit:
            r.cut = True
            return "stop"
        if new and new[-1] in self.stop_ids:
            return "stop"
        if len(r.kept) >= r.job.max_tokens:
            return "length"
        if u.done:
            return "stop" if r.kept and r.kept[-1] in self.stop_ids else "length"
        return None

    def _release(self, pool, handle):
        try:
            pool.release(handle)
        except Exception:  # a release that fails leaves the slot to the pool; the request is over either way
            pass

    def _cancelled(self, r: _Run):
        self.counts["cancelled"] += 1
        r.job.push("done", {"finish_reason": "cancelled"})
        self._observe("finished", "cancelled", self._info(r))

    def _fail(self, r: _Run, e: Exception):
        self.counts["failed"] += 1
        msg = str(e) if isinstance(e, ValueError) else f"generation failed: {type(e).__name__}: {e}"
        r.job.push("error", msg)
        self._observe("finished", "error", self._info(r))

    def _info(self, r: _Run) -> dict:
        """A request's figures for the observer: usage, rounds, accepted tokens, rounds per budget."""
        return {"usage": self._usage(r), "rounds": r.rounds, "accepted": r.accepted,
                "budget_rounds": {k: v for k, v in r.budget_rounds.items() if v} if self.method == "ddtree" else {}}

    def _usage(self, r: _Run) -> dict:
        n = len(r.job.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": len(r.kept), "total_tokens": n + len(r.kept),
                "prompt_tokens_details": {"cached_tokens": r.cached}}

    def _finish(self, r: _Run, finish: str):
        rest = r.stream.finish()
        if rest:
            if r.ttft is None:
                r.ttft = time.perf_counter() - r.t0
            r.job.push("delta", rest)
        wall = time.perf_counter() - r.t0
        job = r.job
        budgets = {k: v for k, v in r.budget_rounds.items() if v}
        if self.method == "ddtree":  # the budget most of its rounds used (they shrink while the batch is large)
            budget = max(budgets, key=budgets.get) if budgets else _budget_key(r.budget if r.budget is not None
                                                                               else self.budget)
        else:
            budget = None
        self.counts["completed"] += 1
        self._observe("finished", finish, self._info(r))
        if self.prefix_cache is not None and r.kept and not r.cut and hasattr(self.pool, "remember"):
            # (before the client hears of it: `remembering` is then already true)
            self._to_remember.append((list(job.prompt_ids) + list(r.kept), len(job.prompt_ids)))
            self._remember_left += 1
            if len(self._to_remember) > REMEMBER:
                self._to_remember.popleft()
                self._remember_left -= 1
        job.push("done", {
            "finish_reason": finish,
            "usage": self._usage(r),
            "speculative": {"method": self.method, "tree_budget": budget,
                            "tree_budget_rounds": budgets if self.method == "ddtree" else None,
                            "rounds": r.rounds, "mean_acceptance_length": r.accepted / r.rounds if r.rounds else 0.0,
                            "batch": r.peers, "max_batch": self.max_batch,
                            "time_to_first_token_s": r.ttft, "queue_s": r.t0 - job.submitted, "wall_s": wall,
                            "tokens_per_s": len(r.kept) / wall if wall > 0 else 0.0},
        })


def _budget_key(b):
    """A budget as a JSON key: "auto", an int as a string, "chain" for None (AR / DFlash)."""
    return "chain" if b is None else str(b)
