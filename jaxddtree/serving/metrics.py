"""`GET /metrics`: the server's figures in Prometheus' text format (the `prometheus-client` library, as vLLM and
SGLang expose theirs), names prefixed `jaxddtree_`.

`ServerMetrics(engine)` has its own registry (several servers in one process do not mix) and becomes the engine's
observer: the scheduler thread reports each request's first token, its tokens and its end; the gauges read the
engine when scraped.
  requests_total{finish_reason}            finished requests (stop, length, cancelled, error)
  prompt_tokens_total, cached_prompt_tokens_total, generation_tokens_total
  time_to_first_token_seconds              histogram, from the request's arrival (queue included)
  inter_token_latency_seconds              histogram, one observation per token (a round's tokens share its time)
  running_requests (the batch size), waiting_requests (the queue), max_batch
  spec_rounds_total, spec_accepted_tokens_total, mean_acceptance_length (accepted / rounds)
  tree_budget_rounds_total{budget}         rounds per tree budget chosen (--budget auto's choices, batch buckets)
  prefix_cache_hit_rate                    cached / prompt tokens so far
  prefix_cache_bytes                       device bytes the prefix cache holds (0 without one)
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "jaxddtree_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self._sums = {"prompt": 0, "cached": 0, "rounds": 0, "accepted": 0}  # for the ratios
        self.requests = Counter(P + "requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Completion tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from a request's arrival to its first text",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time per generated token after the first",
                             buckets=ITL_BUCKETS, registry=r)
        self.rounds = Counter(P + "spec_rounds", "Speculative rounds of finished requests", registry=r)
        self.accepted = Counter(P + "spec_accepted_tokens", "Tokens those rounds produced", registry=r)
        self.budget_rounds = Counter(P + "tree_budget_rounds", "Rounds per tree budget chosen", ["budget"],
                                     registry=r)
        Gauge(P + "running_requests", "Requests in a slot or joining one (the batch)",
              registry=r).set_function(engine.running)
        Gauge(P + "waiting_requests", "Requests waiting in the queue", registry=r).set_function(engine.waiting)
        Gauge(P + "max_batch", "Slots: requests decoded at once at most",
              registry=r).set_function(lambda: engine.max_batch)
        Gauge(P + "mean_acceptance_length", "Tokens per speculative round, over finished requests",
              registry=r).set_function(lambda: self._ratio("accepted", "rounds"))
        Gauge(P + "prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens, over finished requests",
              registry=r).set_function(lambda: self._ratio("cached", "prompt"))
        Gauge(P + "prefix_cache_bytes", "Device bytes held by the prefix cache",
              registry=r).set_function(engine.prefix_cache_bytes)
        engine.observer = self

    def _ratio(self, a: str, b: str) -> float:
        with self._lock:
            return self._sums[a] / self._sums[b] if self._sums[b] else 0.0

    # ---- the engine's observer (called from the scheduler thread)
    def first_token(self, seconds: float):
        self.ttft.observe(seconds)

    def tokens(self, n: int, seconds_per_token: float):
        for _ in range(n):
            self.itl.observe(seconds_per_token)

    def finished(self, reason: str, info: dict):
        usage = info.get("usage") or {}
        got = {"prompt": usage.get("prompt_tokens", 0),
               "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
               "rounds": info.get("rounds", 0), "accepted": info.get("accepted", 0)}
        with self._lock:
            for k, v in got.items():
                self._sums[k] += v
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(got["prompt"])
        self.cached_tokens.inc(got["cached"])
        self.generation_tokens.inc(usage.get("completion_tokens", 0))
        self.rounds.inc(got["rounds"])
        self.accepted.inc(got["accepted"])
        for budget, n in (info.get("budget_rounds") or {}).items():
            self.budget_rounds.labels(budget=str(budget)).inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
