"""Keep a test process's memory mappings under the kernel's limit: between two test files, drop JAX's compiled
programs (`jax.clear_caches()`) once the process holds more than MAX_SHARE of `vm.max_map_count` mappings.

Why: every XLA CPU executable keeps hundreds of memory mappings alive (a 200-op program: 623 on this machine,
2026-12-02), and the jit caches keep every executable. One xdist worker of the suite reached 46,000 mappings
seven minutes in (the test_batch.py file alone adds 21,500); past vm.max_map_count (65,530 here) the next mmap fails
and XLA's CPU compiler dies of it ("LLVM compilation error: Cannot allocate memory", then a segmentation fault
in `backend_compile_and_load`: reproduced with vm.max_map_count lowered to 9,000 and programs compiled until the
limit). Six full CI runs lost a worker that way, each time in a different test that passes alone
(tests/crash_rerun.py: the retry that covered it). Clearing between files keeps fixtures intact (a file's own fixtures are torn down by then; the
session's keep their objects and compile again when next used).

Loaded by tests/conftest.py.
"""

from __future__ import annotations

import gc
import sys

import pytest

MAX_SHARE = 0.4  # of vm.max_map_count; one test file has added up to a third of the default 65,530
cleared: list[tuple[str, int, int]] = []  # (file, mappings before, after)


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to watch
        return 0


def _file(item) -> str | None:
    return None if item is None else item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    limit = max_map_count()
    if not limit or _file(item) == _file(nextitem):
        return
    before = mappings()
    if before > MAX_SHARE * limit:
        import jax
        jax.clear_caches()
        hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
        try:  # finalizers of objects earlier tests left in cycles (e.g. a server test's closed uvloop) stay quiet
            gc.collect()
        finally:
            sys.unraisablehook = hook
        cleared.append((_file(item), before, mappings()))
