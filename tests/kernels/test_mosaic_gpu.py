"""The Mosaic GPU kernels' tests (tests/kernels/mgpu/: the tree / prefill attention on the Mosaic GPU interpreter and
their CUDA lowering for an abstract H200) in a fresh Python process (conftest.py says why)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MGPU_ENV = "JAXDDTREE_MGPU_SUBPROCESS"  # tests/kernels/conftest.py collects tests/kernels/mgpu/ only when it is set


def test_mosaic_gpu_kernels_in_their_own_process():
    env = dict(os.environ, **{MGPU_ENV: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        os.path.join(ROOT, "tests", "kernels", "mgpu")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failed" not in r.stdout, tail
