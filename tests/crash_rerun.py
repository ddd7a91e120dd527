"""Run a test again, once, when it took its xdist worker down (a hard crash: segfault, abort).

Why: six full CPU runs across sessions 8-11 lost a worker to a segmentation fault inside XLA's CPU compiler,
each time in a different test that passes alone. The cause, found in session 11: the worker had used up
vm.max_map_count memory mappings (tests/map_budget.py now keeps it under). This retry stays as the net for a hard
crash: it is retried once in a fresh worker; a second crash of the same test fails it, and an ordinary failure
(an assertion, an exception) is never retried. Every retry is listed at the end of the run, so a crash stays
visible.

Loaded by tests/conftest.py (the controller process runs these hooks; without xdist they never fire).
"""

from __future__ import annotations

import pytest

MAX_CRASH_RERUNS = 1
_crashes: dict[str, int] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    n = _crashes.get(crashitem, 0)
    if n < MAX_CRASH_RERUNS:
        _crashes[crashitem] = n + 1
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _crashes:
        terminalreporter.write_sep("=", "tests retried after their worker crashed", yellow=True)
        for nodeid, n in sorted(_crashes.items()):
            terminalreporter.write_line(f"CRASH-RERUN {nodeid} ({n}x)")
