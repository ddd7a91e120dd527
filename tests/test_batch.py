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

import os
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
from jaxddtree.speculative import batch as batch_lib  # noqa: E402
from jaxddtree.speculative import loop as loop_lib  # noqa: E402
from jaxddtree.speculative.batch import Request  # noqa: E402

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
