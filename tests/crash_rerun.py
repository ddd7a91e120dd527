"""Run a test again, once, when it took its xdist worker down (a hard crash: segfault, abort).

Why: six full CPU runs across sessions 8-11 lost a worker to a segmentation fault inside XLA's CPU compiler,
each time in a different test that passes alone. The cause, found in session 11: the worker had used up
vm.max_map_count memory mappings (tests/map_budget.py now keeps it under). This retry stays as the net for a hard
crash: it is retried once in a fresh worker; a second crash of the same test fails it, and an ordinary failure
(an assertion, an exception) is never retried. Every retry is listed at the end of the run, so a crash stays
visible.

With `--dist loadfile` (the Makefile's; `loadscope` likewise) xdist itself puts a crashed worker's file back in the
queue, the crashed test included, and its scheduler has no `mark_test_pending`: `pytest_xdist_make_scheduler`
gives it one that leaves the requeue alone, and drops a test that crashed twice from the requeue (no third run).

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile / loadscope: xdist's scheduler with the retry's two needs (see the module docstring)."""
    dist = config.getvalue("dist")
    if dist not in ("loadfile", "loadscope"):
        return None
    from xdist.scheduler import LoadFileScheduling, LoadScopeScheduling

    class Rerun(LoadFileScheduling if dist == "loadfile" else LoadScopeScheduling):
        def remove_node(self, node):
            """xdist 3.8's remove_node, except that a crashed test that already had its rerun is marked done
            before its unit goes back in the queue (it fails, and does not run a third time)."""
            workload = self.assigned_work.pop(node)
            if not self._pending_of(workload):
                return None
            crashitem = next(nodeid for unit in workload.values() for nodeid, done in unit.items() if not done)
            if _crashes.get(crashitem, 0) >= MAX_CRASH_RERUNS:
                for unit in workload.values():
                    if crashitem in unit:
                        unit[crashitem] = True
            self.workqueue.update(workload)
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def mark_test_pending(self, item):
            pass  # remove_node requeued the crashed test's unit, with the crashed test still pending in it

        def _assign_work_unit(self, node):
            """The longest files first (tests/file_seconds.py), so that no long file starts last and leaves one
            worker running it alone (xdist orders the scopes by their number of tests: the few-test subprocess
            files, the longest, went last)."""
            if not getattr(self, "_longest_first", False):
                self._longest_first = True
                from file_seconds import seconds
                order = sorted(self.workqueue, key=lambda scope: -seconds(scope, len(self.workqueue[scope])))
                for scope in order:
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return Rerun(config, log)


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _crashes:
        terminalreporter.write_sep("=", "tests retried after their worker crashed", yellow=True)
        for nodeid, n in sorted(_crashes.items()):
            terminalreporter.write_line(f"CRASH-RERUN {nodeid} ({n}x)")
