"""Fake slot pools for the server's scheduler tests: the `SlotPool` contract (jaxddtree.speculative.batch, see
its docstring) over per-request token lists, so that the scheduler's join / leave / cancel / wait logic is tested
apart from the batched rounds.

A request's rounds (lists of tokens; the first holds the first token alone) are made whole when it is admitted
(`rounds_of`), then `step()` hands out one round per active slot per call, one call late as the real pool does
(a call returns the updates of the previous call). Every call is logged in `log`: ("prefill", rid),
("advance", rid, chunk), ("start", rid), ("admit", rid, handle), ("step", handles), ("release", handle)."""

from __future__ import annotations

import dataclasses
import threading
import time

BUDGETS = (7, 15, 31, 63)


@dataclasses.dataclass
class Update:  # the contract's SlotUpdate
    tokens: list
    done: bool
    rounds: int
    accepted: int
    budget: object


class _Pending:
    """As loop.Prefill: one call per prompt chunk (the model's chunk_size), then one more for the start."""

    def __init__(self, pool, req, rid, chunks):
        self.pool, self.req, self.rid, self.chunks, self.done = pool, req, rid, chunks, 0

    mates = ()  # the pendings prefilled with it (FakePool.group): one advance() runs them all

    def advance(self) -> bool:
        for p in self.mates or (self,):
            p._advance()
        return self.done > self.chunks

    def _advance(self):
        if self.done > self.chunks:
            return
        self.done += 1
        self.pool.log.append(("advance", self.rid, self.done) if self.done <= self.chunks else ("start", self.rid))


@dataclasses.dataclass
class _Slot:
    rid: int
    rounds: list
    i: int = 0
    accepted: int = 0


class FakePool:
    """Contract-shaped; subclasses give `rounds_of(req)`. `delay`: seconds each step() takes (a round's time)."""

    delay = 0.0

    def __init__(self, target, drafter, *, method="ddtree", max_batch=1, cache_len, tree_budget="auto",
                 budget_costs=None, slot_rows=128, sync_every=1, max_group=1, group_rows=2048, prefix_cache=None):
        self.target, self.drafter, self.method, self.max_batch = target, drafter, method, max_batch
        self.cache_len, self.tree_budget, self.budget_costs, self.slot_rows = cache_len, tree_budget, budget_costs, \
            slot_rows
        self.max_group = max_group
        self.log, self.slots, self.inflight, self._rid = [], {}, {}, 0
        self.lock = threading.Lock()  # the tests read `log` from another thread
        self.most_active = 0

    def warmup(self, prompt_ids):
        pass

    def prefill(self, req):
        if len(req.ids) + req.max_new > self.cache_len:
            raise ValueError(f"prompt ({len(req.ids)} tokens) + max_new ({req.max_new}) exceeds cache_len")
        self._rid += 1
        self.log.append(("prefill", self._rid))
        from jaxddtree.model.prefill import chunk_size
        n = len(req.ids)
        return _Pending(self, req, self._rid, -(-n // chunk_size(n)))

    def group_sizes(self, n_tokens) -> tuple:
        """As SlotPool: powers of two up to max_group (1: one by one)."""
        return tuple(k for k in (2, 4, 8, 16) if k <= self.max_group)

    def group(self, pendings) -> None:
        pendings = list(pendings)
        assert len(pendings) in self.group_sizes(0) and all(p.done == 0 for p in pendings)
        assert len({p.chunks for p in pendings}) == 1, "a group of prompts of different shapes"
        self.log.append(("group", tuple(p.rid for p in pendings)))
        for p in pendings:
            p.mates = pendings

    def free(self) -> int:
        return self.max_batch - len(self.slots)

    def admit(self, pending) -> int:
        assert pending.done > pending.chunks, "admit() before the prefill is done"
        assert self.free() > 0, "admit() with no free slot"
        h = min(set(range(self.max_batch)) - set(self.slots))  # handles are reused, as slot indices
        self.slots[h] = _Slot(pending.rid, self.rounds_of(pending.req))
        self.most_active = max(self.most_active, len(self.slots))
        self.log.append(("admit", pending.rid, h))
        return h

    def budget(self):
        n = len(self.slots)
        if self.method != "ddtree":
            return None
        if n <= 1:
            return self.tree_budget
        B = 1 << (n - 1).bit_length()
        fit = max([b for b in BUDGETS if B * (b + 1) <= self.slot_rows] or [1])
        return fit if self.tree_budget == "auto" else min(fit, int(self.tree_budget))

    def step(self) -> dict:
        if self.delay:
            time.sleep(self.delay)
        self.log.append(("step", tuple(sorted(self.slots))))
        prev, self.inflight = self.inflight, {}
        budget = self.budget()
        for h, s in self.slots.items():
            if s.i >= len(s.rounds):
                continue  # done: its rounds change nothing until it is released
            toks = s.rounds[s.i]
            if s.i:
                s.accepted += len(toks)
            s.i += 1
            self.inflight[h] = Update(tokens=list(toks), done=s.i == len(s.rounds), rounds=s.i - 1,
                                      accepted=s.accepted, budget=budget)
        return prev

    def release(self, handle) -> None:
        self.log.append(("release", handle))
        self.slots.pop(handle, None)
        self.inflight.pop(handle, None)


class ScriptedPool(FakePool):
    """Generates `script(prompt_text) -> text` (then the engine's first stop id) in rounds of `per_round` tokens,
    so that tags and UTF-8 characters are split across stream events; records the decoded prompts."""

    def __init__(self, engine, script, per_round=5, delay=0.0):
        super().__init__(engine.target, engine.drafter, method=engine.method, max_batch=engine.max_batch,
                         cache_len=engine.cache_len, tree_budget=engine.budget, slot_rows=engine.slot_rows)
        self.engine, self.script, self.per_round, self.delay = engine, script, per_round, delay
        self.prompts = []

    def rounds_of(self, req):
        from jaxddtree.text import encode_text
        tok = self.engine.tokenizer
        prompt = tok.decode(req.ids)
        self.prompts.append(prompt)
        ids = encode_text(tok, self.script(prompt)) + list(self.engine.stop_ids[:1])
        ids = ids[:req.max_new]
        return [ids[:1]] + [ids[i:i + self.per_round] for i in range(1, len(ids), self.per_round)]


class GeneratePool(FakePool):
    """Each request's rounds from `jaxddtree.generate` alone (sync_every=1: one list per round): the pool's
    tokens as the contract defines them (made at admit), handed out a round per 5 ms step."""

    delay = 0.005

    def warmup(self, prompt_ids, temperatures=(0.0, 1.0)):
        from jaxddtree.model.prefill import chunk_widths
        ids = list(prompt_ids) or [0]
        for _, n in chunk_widths(self.cache_len):
            if n + 256 > self.cache_len:  # not a prompt the server takes (its caches hold max_context + a verify)
                continue
            prompt = (ids * (n // len(ids) + 1))[:n]
            for t in temperatures:
                self._generate(prompt, 2, t, 0)
                if t > 0:
                    self._generate(prompt, 2, t, 0, top_p=0.5)

    def _generate(self, ids, max_new, temperature, seed, stop_ids=(), **trunc):
        import jaxddtree
        rounds = []
        jaxddtree.generate(self.target, ids, drafter=self.drafter, method=self.method, max_new_tokens=max_new,
                           tree_budget=self.tree_budget, budget_costs=self.budget_costs, temperature=temperature,
                           seed=seed, stop_ids=list(stop_ids), sync_every=1, on_tokens=rounds.append,
                           cache_len=self.cache_len, **trunc)
        return rounds

    def rounds_of(self, req):
        return self._generate(req.ids, req.max_new, req.temperature, req.seed, req.stop_ids, top_k=req.top_k,
                              top_p=req.top_p, min_p=req.min_p)
