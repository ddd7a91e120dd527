"""tests/map_budget.py: JAX's compiled programs are dropped between two test files once the process holds more than
its share of vm.max_map_count mappings, never inside a file, never below the share."""

import types

import jax

import map_budget


def test_clears_between_files_only_past_the_share(monkeypatch):
    calls = []
    monkeypatch.setattr(jax, "clear_caches", lambda: calls.append(1))
    monkeypatch.setattr(map_budget, "cleared", [])
    monkeypatch.setattr(map_budget, "max_map_count", lambda: 1000)
    item = lambda nodeid: types.SimpleNamespace(nodeid=nodeid)
    a1, a2, b1 = item("tests/a.py::t1"), item("tests/a.py::t2"), item("tests/b.py::t1")
    monkeypatch.setattr(map_budget, "mappings", lambda: 900)
    map_budget.pytest_runtest_teardown(a1, a2)  # same file: kept
    assert calls == []
    map_budget.pytest_runtest_teardown(a2, b1)  # next file, 900 > 0.4 * 1000: cleared
    assert calls == [1] and map_budget.cleared[-1][:2] == ("tests/a.py", 900)
    map_budget.pytest_runtest_teardown(b1, None)  # the last test counts as a boundary too
    assert calls == [1, 1]
    monkeypatch.setattr(map_budget, "mappings", lambda: 300)
    map_budget.pytest_runtest_teardown(a2, b1)  # under the share: kept
    assert calls == [1, 1]


def test_reads_this_process():
    assert map_budget.mappings() > 0 and map_budget.max_map_count() > 0
