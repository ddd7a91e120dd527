"""Timing helpers shared by the kernel benchmarks (benchmarks/bench_kernels.py, benchmarks/bench_gemv.py).

`QUICK = True` (the scripts' --dry mode: tiny shapes on a CPU) makes `wall_ms` time one call, no warm-up.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import statistics
import tempfile
import time

import jax

QUICK = False


def log(*a):
    print(*a, flush=True)


def save_json(path, results):
    """Write `results` to `path` as JSON (nothing when path is empty); non-JSON values as str."""
    if path:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


def wall_ms(f, args, reps=20, warmup=2):
    """Median wall time (ms) of f(*args) after warm-up, blocking on the result."""
    if QUICK:
        reps, warmup = 1, 0
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def gpu_profile(f, args, n=20, top=8, width=80, feed=None):
    """Profile n calls of f (after one warm-up call) and read the GPU's kernels from the trace. `feed(args,
    out) -> args` gives each call its arguments from the previous call's outputs (for functions that donate
    their inputs: a state updated in place). Returns {"us": GPU µs per call summed over its kernels,
    "launches": kernel launches per call, "top": the `top` kernels as (name[:width], µs per call, launches
    per call)}, or None without a GPU plane."""
    out = jax.block_until_ready(f(*args))
    if feed is not None:
        args = feed(args, out)
    d = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(d):
            for _ in range(n):
                out = f(*args)
                if feed is not None:
                    args = feed(args, out)
            jax.block_until_ready(out)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        pdata = jax.profiler.ProfileData.from_file(files[0])
        per = collections.defaultdict(float)
        cnt = collections.Counter()
        for plane in pdata.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
            for ln in lines:
                for ev in ln.events:
                    per[ev.name] += ev.duration_ns / 1e3 / n
                    cnt[ev.name] += 1
        if not per:
            return None
        best = sorted(per.items(), key=lambda kv: -kv[1])[:top]
        return {"us": sum(per.values()), "launches": sum(cnt.values()) / n,
                "top": [(k[:width], round(v, 2), cnt[k] // n) for k, v in best]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def gpu_us(f, args, n=20, top=8, width=80):
    """GPU time per call (µs), summed over its kernels, from a profiler trace of n calls, and the `top`
    kernels as (name[:width], µs per call, launches per call). (None, None) without a GPU plane."""
    p = gpu_profile(f, args, n=n, top=top, width=width)
    return (None, None) if p is None else (p["us"], p["top"])
