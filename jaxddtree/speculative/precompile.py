"""Compile the programs a call will run side by side, before it runs them (issue 40: start-up).

A jitted program's first call traces, lowers and compiles it, and the next program waits: a `generate` call's
prefill, drafter context pass, start and rounds compile one after the other (at 27B on the H200, 10-60 s each).
`compile_all` lowers them one after another (Python, one GIL) from abstract arguments (shapes, dtypes, shardings)
and compiles each in a thread as soon as it is lowered: XLA's compilation releases the GIL. A `Program`
(`model.executables`: what `Target.bind` makes of a jitted function) keeps the executable and runs it for calls
of those shapes (no trace), and writes it to the executables store when one is on; a program found there is loaded
in a thread instead, neither traced nor lowered (a warm start). Another jitted function's executable stays in jax's
in-process cache: its real call traces and finds it (tests/test_generate.py counts the compilations). A job that
fails is left to its real call, which raises the error where it belongs.
`background`: functions whose compilation goes on after `compile_all` returns (`generate`'s rounds: the prefill
runs and its first token is streamed meanwhile); `ready(fn)` waits for them before the first call (a second
compilation of a program in flight would start from scratch: jax's cache holds finished ones only).
A `Program` being compiled or loaded by one `compile_all` call (e.g. a server's thread compiling while the weights
load) is not compiled again by another: that call waits for it (`_in_flight`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import jax
import numpy as np

from jaxddtree.model import executables
from jaxddtree.model.executables import Program

log = logging.getLogger(__name__)

# every job compile_all ran in this process, in the order they finished: {"name", "ints" (the shapes of its int
# arguments: the token widths that tell one program of a function from another), "start_s" (process clock),
# "lower_s", "compile_s", "ok", and "save_s" (written to the executables store) or "load_s" (read from it)}. Benchmarks record the slowest (`slowest`): the critical path of a start-up.
timings: list[dict] = []

# id(jitted function) -> its background compilations still in flight (`compile_all(background=...)`, `ready`)
_pending: dict[int, list[concurrent.futures.Future]] = {}

# (id(Program), signature) -> a Future done when the compile_all call compiling or loading it now is (any thread)
_in_flight: dict[tuple, concurrent.futures.Future] = {}
_in_flight_lock = threading.Lock()


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
    out = None
    if isinstance(fn, Program):  # a program compiled or stored already: its outputs without a trace
        exe = fn.executables.get(executables.signature(args))
        out = exe.out_info if exe is not None else fn.out_shapes(args)
        if out is not None:
            out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)
    if out is None:
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
    top = sorted(timings, key=lambda r: -((r["lower_s"] or 0) + (r["compile_s"] or 0) + r.get("load_s", 0)))[:n]
    return [dict(r, start_s=round(r["start_s"] - since, 2)) for r in top]


def ready(fn=None) -> None:
    """Wait for fn's background compilations (`compile_all(..., background=(fn,))`; None: every function's); none in
    flight: return at once."""
    for key in list(_pending) if fn is None else [id(fn)]:
        for f in _pending.pop(key, ()):
            f.result()


def in_flight() -> int:
    """How many background compilations are still running."""
    return sum(not f.done() for fs in list(_pending.values()) for f in fs)


def compile_all(jobs, workers: int | None = None, background=()) -> int:
    """jobs: (jitted function, args) pairs, args as the function takes them (arrays or ShapeDtypeStructs; static
    arguments as values), each distinct one lowered and compiled. Lowering is Python (one GIL: threads would only
    interleave it), so this thread lowers the jobs one after another in the order given (put the longest program
    first: its compilation starts as soon as its own lowering ends) and hands each to a pool of `workers` threads
    (default: one per job, at most one per CPU core) that compile side by side (XLA releases the GIL).
    background: functions whose jobs are not waited for (`ready(fn)` waits); a job of a function with a
    background compilation still in flight is skipped (its real call waits for that one). -> how many compiled,
    background ones not counted (a failed job is dropped: its real call raises)."""
    # each program once; one compiled before is lowered again and found in jax's cache (whose entries live as long
    # as their lowering: a record of our own could outlive them)
    jobs = [(fn, args) for fn, args in {_signature(fn, args): (fn, args) for fn, args in jobs}.values()
            if not any(not f.done() for f in _pending.get(id(fn), ()))
            and not (isinstance(fn, Program) and fn.has(args))]  # (compiled or loaded before: nothing to do)
    if not jobs:
        return 0
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    later = {id(fn) for fn in background}

    def compile_one(rec, lowered, t1, fn, args):
        try:
            compiled = lowered.compile()
            rec["compile_s"], rec["ok"] = round(time.perf_counter() - t1, 3), True
        except Exception:  # noqa: BLE001 (the real call raises it)
            compiled = None
        if compiled is not None and isinstance(fn, Program):  # its calls run it; kept for the next start
            fn.add(args, compiled)
            t2 = time.perf_counter()
            if fn.save(args, compiled):
                rec["save_s"] = round(time.perf_counter() - t2, 3)
        timings.append(rec)
        log.info("precompile %s %s: lowered in %s s, compiled in %s s", rec["name"], rec["ints"], rec["lower_s"],
                 rec["compile_s"])
        return rec["ok"]

    def load_one(rec, fn, args):
        t0 = time.perf_counter()
        rec["ok"] = fn.load(args)
        rec["load_s"] = round(time.perf_counter() - t0, 3)
        timings.append(rec)
        log.info("precompile %s %s: loaded in %s s", rec["name"], rec["ints"], rec["load_s"])
        return rec["ok"]

    def lower(job):
        fn, args = job
        t0 = time.perf_counter()
        rec = {"name": getattr(fn, "__name__", type(fn).__name__), "ints": _int_shapes(args),
               "start_s": round(t0, 3), "lower_s": None, "compile_s": None, "ok": False}
        if isinstance(fn, Program) and fn.stored(args) is not None:
            return rec, "stored", t0
        try:
            lowered = fn.lower(*args)
        except Exception:  # noqa: BLE001 (the real call raises it)
            timings.append(rec)
            return rec, None, 0.0
        t1 = time.perf_counter()
        rec["lower_s"] = round(t1 - t0, 3)
        return rec, lowered, t1

    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precompile")
    try:
        futures = []
        for job in jobs:
            key, mine = None, None
            if isinstance(job[0], Program):  # compiled or loaded elsewhere right now: wait for that, not again
                key = (id(job[0]), executables.signature(job[1]))
                with _in_flight_lock:
                    other = _in_flight.get(key)
                    if other is None:
                        mine = _in_flight[key] = concurrent.futures.Future()
                if other is not None:
                    f = _when_done_elsewhere(other, *job)
                    (_pending.setdefault(id(job[0]), []) if id(job[0]) in later else futures).append(f)
                    continue
            try:
                rec, lowered, t1 = lower(job)
                f = None
                if lowered is not None:
                    f = (pool.submit(load_one, rec, *job) if isinstance(lowered, str) else
                         pool.submit(compile_one, rec, lowered, t1, *job))
            finally:
                if mine is not None:
                    _settle(key, mine, f)
            if f is None:
                continue
            if id(job[0]) in later:
                _pending.setdefault(id(job[0]), []).append(f)
            else:
                futures.append(f)
        return sum(f.result() for f in futures)
    finally:
        pool.shutdown(wait=False)  # the background jobs finish in its threads


def _settle(key, mine: concurrent.futures.Future, f) -> None:
    """`mine` (the in-flight entry of `key`) is done, and leaves `_in_flight`, when f is (at once without one)."""
    def done(_=None):
        with _in_flight_lock:
            if _in_flight.get(key) is mine:
                del _in_flight[key]
        mine.set_result(None)
    if f is None:
        done()
    else:
        f.add_done_callback(done)


def _when_done_elsewhere(other: concurrent.futures.Future, fn, args) -> concurrent.futures.Future:
    """A job another compile_all call is compiling or loading: a Future of whether fn has it once that one is done
    (no thread waits; if that one failed, this call's real call compiles it)."""
    f = concurrent.futures.Future()
    other.add_done_callback(lambda _: f.set_result(fn.has(args)))
    return f
