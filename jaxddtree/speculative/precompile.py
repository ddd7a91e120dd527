"""Compile the programs a call will run side by side, before it runs them (issue 40: start-up).

A jitted program's first call traces, lowers and compiles it, and the next program waits: a `generate` call's
prefill, drafter context pass, start and rounds compile one after the other (at 27B on the H200, 10-60 s each).
`compile_all` lowers and compiles them in threads from abstract arguments (shapes, dtypes, shardings): XLA's
compilation releases the GIL, and jax keeps each executable in its in-process cache, so the real calls that follow
(same function, same argument shapes and shardings) only trace and find it (tests/test_generate.py counts the
compilations). A job that fails is left to its real call, which raises the error where it belongs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax
import numpy as np

log = logging.getLogger(__name__)

# every job compile_all ran in this process, in the order they finished: {"name", "ints" (the shapes of its int
# arguments: the token widths that tell one program of a function from another), "start_s" (process clock),
# "lower_s", "compile_s", "ok"}. Benchmarks record the slowest (`slowest`): the critical path of a start-up.
timings: list[dict] = []


def abstract(tree):
    """A pytree's arrays as ShapeDtypeStructs (a committed array's sharding kept: an uncommitted one lowers
    unspecified, as its real call does); other leaves (ShapeDtypeStructs, None, Python scalars) as they are."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
        return x
    return jax.tree.map(one, tree)


def shape_of(fn, *args):
    """`jax.eval_shape(fn, *args)` placed as the real call places its outputs: a call with a committed argument
    (an array or a ShapeDtypeStruct with a sharding: one device) returns committed arrays on that device, else
    uncommitted ones (no sharding), so that the next program lowers as its real call does."""
    out = jax.eval_shape(fn, *args)
    placed = [x.sharding for x in jax.tree.leaves(args) if (x.committed if isinstance(x, jax.Array) else
              isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None)]
    if not placed:
        return out
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed[0]), out)


def _signature(fn, args):
    """What a program's compilation depends on: the function and its arguments' shapes, dtypes and placements
    (static arguments by value)."""
    def key(x):
        if isinstance(x, jax.Array):
            x = abstract(x)
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.shape, str(x.dtype), x.sharding
        try:
            hash(x)
        except TypeError:
            return id(x)
        return x
    leaves, treedef = jax.tree.flatten(args)
    return id(fn), treedef, tuple(key(x) for x in leaves)


def _int_shapes(args, most: int = 4) -> list:
    """The shapes of up to `most` integer arrays among args' leaves (token ids, lengths: what tells the programs of
    one function apart in `timings`)."""
    out = []
    for x in jax.tree.leaves(args):
        dt = getattr(x, "dtype", None)
        if dt is not None and jax.dtypes.issubdtype(dt, np.integer) and len(out) < most:  # (not PRNG keys)
            out.append(list(x.shape))
    return out


def slowest(n: int = 8, since: float = 0.0) -> list[dict]:
    """The n jobs of `timings` that took longest (lowering + compilation), slowest first; start_s counted from the
    process clock's `since` (a benchmark's start)."""
    top = sorted(timings, key=lambda r: -((r["lower_s"] or 0) + (r["compile_s"] or 0)))[:n]
    return [dict(r, start_s=round(r["start_s"] - since, 2)) for r in top]


def compile_all(jobs, workers: int | None = None) -> int:
    """jobs: (jitted function, args) pairs, args as the function takes them (arrays or ShapeDtypeStructs; static
    arguments as values), each distinct one lowered and compiled in a pool of `workers` threads (default: one per
    job, at most one per CPU core). -> how many compiled (a failed job is dropped: its real call raises)."""
    # each program once; one compiled before is lowered again and found in jax's cache (whose entries live as long
    # as their lowering: a record of our own could outlive them)
    jobs = list({_signature(fn, args): (fn, args) for fn, args in jobs}.values())
    if not jobs:
        return 0
    workers = workers or min(len(jobs), os.cpu_count() or 1)

    def one(job):
        fn, args = job
        t0 = time.perf_counter()
        rec = {"name": getattr(fn, "__name__", type(fn).__name__), "ints": _int_shapes(args),
               "start_s": round(t0, 3), "lower_s": None, "compile_s": None, "ok": False}
        try:
            lowered = fn.lower(*args)
            t1 = time.perf_counter()
            rec["lower_s"] = round(t1 - t0, 3)
            lowered.compile()
            rec["compile_s"], rec["ok"] = round(time.perf_counter() - t1, 3), True
        except Exception:  # noqa: BLE001 (the real call raises it)
            pass
        timings.append(rec)
        log.info("precompile %s %s: lowered in %s s, compiled in %s s", rec["name"], rec["ints"], rec["lower_s"],
                 rec["compile_s"])
        return rec["ok"]

    if workers == 1:
        return sum(one(item) for item in jobs)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precompile") as pool:
        return sum(pool.map(one, jobs))
