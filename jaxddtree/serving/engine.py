"""The single-worker generation engine: one request at a time on the device, the others in a bounded queue.

A worker thread runs `jaxddtree.generate` for each job (`sync_every=1`: the host loop keeps the next round
enqueued while it streams the last one's tokens); its `on_tokens` callback detokenises each round's tokens
(`TextStream`), hands the text deltas to the job's asyncio queue (thread-safe, through the event loop) and stops
the generation early, by raising, when the client went away, a stop string appeared or max_tokens were reached.
Every request uses caches of one capacity (`cache_len`, for `max_context` tokens) and max_tokens is data, so
one compiled round per temperature class serves all requests; `warmup` compiles it, and every prefill chunk
width, before the server listens: nothing compiles afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from typing import Any

from jaxddtree.model.prefill import chunk_widths
from jaxddtree.text import TextStream, default_stop_ids
from jaxddtree.speculative.loop import capacity, check_memory, generate, resolve_budget


class QueueFull(Exception):
    """The bounded request queue is full."""


class _Stop(Exception):
    """Raised from on_tokens to end a generation early; `reason` is the finish reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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

    def cancel(self):
        self.cancelled.set()

    def push(self, kind: str, value: Any):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Engine:
    """Owns the model pair and the worker thread. `submit` queues a job (QueueFull when the queue is full);
    the job's events are ("delta", text) ..., then ("done", info) or ("error", message)."""

    def __init__(self, target, drafter, tokenizer, *, name: str = "jaxddtree", method: str = "ddtree",
                 budget: int | str = "auto", max_context: int | None = None, queue_size: int = 64, stop_ids=None,
                 default_max_tokens: int = 256, budget_costs=None):
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
        # one line, before anything is compiled, when the caches for max_context do not fit (ValueError)
        check_memory(target, drafter if dcfg else None, self.cache_len, self.max_context, 0, chunk)
        self.queue_size = queue_size
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.busy = False
        self._thread = threading.Thread(target=self._work, name="jaxddtree-generate", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- asyncio side
    def submit(self, job: Job) -> Job:
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self.queue_size} requests are already waiting") from None
        return job

    def waiting(self) -> int:
        return self._queue.qsize()

    def close(self):
        self._queue.put(None)

    # ---------------------------------------------------------------- worker side
    def warmup(self, prompt_ids, temperatures=(0.0,)):
        """Compile everything a request can run: the prefill of every chunk width a prompt of up to max_context
        tokens uses (prompts of those lengths, made from `prompt_ids`), the request setup and the round of each
        temperature class (greedy, sampling: every T > 0 shares one), with a few rounds each."""
        ids = list(prompt_ids) or [0]
        for _, n in chunk_widths(self.max_context - 2):
            prompt = (ids * (n // len(ids) + 1))[:n]
            for t in temperatures:
                self._generate(prompt, 2, float(t), 0, on_tokens=lambda new: None)
                if t > 0:  # the sampling round with truncation (top_k / top_p / min_p: one compilation for all)
                    self._generate(prompt, 2, float(t), 0, on_tokens=lambda new: None, top_p=0.5)

    def _generate(self, ids, max_new, temperature, seed, on_tokens, top_k=0, top_p=1.0, min_p=0.0):
        return generate(self.target, ids, drafter=self.drafter if self.method != "ar" else None,
                        method=self.method, max_new_tokens=max_new, tree_budget=self.budget,
                        budget_costs=self.budget_costs, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, seed=seed, stop_ids=self.stop_ids, sync_every=1, on_tokens=on_tokens,
                        cache_len=self.cache_len)

    def _work(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                continue
            self.busy = True
            try:
                self._run(job)
            except Exception as e:  # a failed generation fails its request, never the server
                self.counts["failed"] += 1
                job.push("error", f"generation failed: {type(e).__name__}: {e}")
            finally:
                self.busy = False

    def _run(self, job: Job):
        stream = TextStream(self.tokenizer, job.stop)
        kept: list[int] = []  # completion tokens (up to max_tokens / the stop string)
        calls = [0, 0]  # on_tokens calls, tokens emitted by generate
        t0 = time.perf_counter()
        ttft = [None]

        def on_tokens(new):
            if job.cancelled.is_set():
                raise _Stop("cancelled")
            calls[0] += 1
            calls[1] += len(new)
            new = list(new)[:job.max_tokens - len(kept)]
            kept.extend(new)
            delta, hit = stream.feed(new)
            if delta:
                if ttft[0] is None:
                    ttft[0] = time.perf_counter() - t0
                job.push("delta", delta)
            if hit:
                raise _Stop("stop")
            if new and new[-1] in self.stop_ids:
                raise _Stop("stop")
            if len(kept) >= job.max_tokens:
                raise _Stop("length")

        room = self.max_context - len(job.prompt_ids)
        stats = None
        try:
            gen = self._generate(job.prompt_ids, min(job.max_tokens, room), job.temperature, job.seed, on_tokens,
                                 top_k=job.top_k, top_p=job.top_p, min_p=job.min_p)
            stats = gen.stats
            finish = "stop" if kept and kept[-1] in self.stop_ids else "length"
        except _Stop as s:
            finish = s.reason
        if finish == "cancelled":
            self.counts["cancelled"] += 1
            job.push("done", {"finish_reason": "cancelled"})
            return
        rest = stream.finish()
        if rest:
            job.push("delta", rest)
        wall = time.perf_counter() - t0
        rounds = stats["rounds"] if stats else max(calls[0] - 1, 0)
        mean_acc = stats["mean_acceptance_length"] if stats else ((calls[1] - 1) / rounds if rounds else 0.0)
        self.counts["completed"] += 1
        job.push("done", {
            "finish_reason": finish,
            "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(kept),
                      "total_tokens": len(job.prompt_ids) + len(kept)},
            "speculative": {"method": self.method, "tree_budget": self.budget if self.method == "ddtree" else None,
                            "rounds": rounds, "mean_acceptance_length": mean_acc,
                            "time_to_first_token_s": ttft[0], "wall_s": wall,
                            "tokens_per_s": len(kept) / wall if wall > 0 else 0.0,
                            **({"budget_counts": stats["budget_counts"]} if stats and "budget_counts" in stats
                               else {})},
        })
