"""tests/crash_rerun.py: a test that crashes its xdist worker once runs again and passes; one that crashes every
time fails; an ordinary failure is not retried. With xdist's default --dist load and with the Makefile's loadfile
(whose scheduler requeues a crashed worker's file itself)."""

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

BODY = textwrap.dedent("""
    import os, signal

    def _crash_first_time(name):
        marker = os.path.join(os.path.dirname(__file__), name)
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGSEGV)

    def test_crashes_once():
        _crash_first_time("crashed_once")

    def test_fine():
        pass
""")


def _run(tmp_path, body, dist):
    (tmp_path / "conftest.py").write_text(
        "from crash_rerun import pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary\n"
        "from crash_rerun import pytest_xdist_make_scheduler\n")
    (tmp_path / "test_it.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=HERE)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", dist, "-p", "no:cacheprovider",
                           "-o", "addopts=", "-o", "timeout=120", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("dist", ["load", "loadfile"])
def test_crash_is_retried_once(tmp_path, dist):
    r = _run(tmp_path, BODY, dist)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "CRASH-RERUN" in out and "test_crashes_once" in out, out
    assert "2 passed" in out, out


@pytest.mark.parametrize("dist", ["load", "loadfile"])
def test_second_crash_and_plain_failure_fail(tmp_path, dist):
    r = _run(tmp_path, BODY + textwrap.dedent("""
        def test_always_crashes():
            os.kill(os.getpid(), signal.SIGSEGV)

        def test_plain_failure():
            marker = os.path.join(os.path.dirname(__file__), "failed_before")
            assert not os.path.exists(marker), "retried"
            open(marker, "w").close()
            assert False, "plain failure"
    """), dist)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "2 failed" in out and "2 passed" in out, out
    assert "AssertionError: plain failure" in out and "AssertionError: retried" not in out, out
    assert "test_always_crashes" in out and "crashed while running" in out, out
