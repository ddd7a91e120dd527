"""Kernel test directories that run in a fresh Python process each (tests/kernels/conftest.py says why): mgpu/ (the
Mosaic GPU tree / prefill attention on its interpreter and lowered for an abstract H200) and gdn_slots/ (the GDN tree
kernel under jax.vmap)."""

import os
import subprocess
import sys

import pytest

from tests.kernels.conftest import OWN_PROCESS, OWN_PROCESS_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("directory", OWN_PROCESS)
def test_in_their_own_process(directory):
    env = dict(os.environ, **{OWN_PROCESS_ENV: "1"})
    for attempt in range(2):  # killed by a signal (tests/crash_rerun.py: XLA CPU compile crashes): once more
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                            os.path.join(ROOT, "tests", "kernels", directory)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1200)
        if r.returncode >= 0:
            break
        print(f"CRASH-RERUN {directory}: the process died of signal {-r.returncode}", file=sys.stderr)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failed" not in r.stdout, tail
