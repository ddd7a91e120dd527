"""Kernel tests run on the CPU (interpret mode + abstract-H200 lowering); the repo root must be importable."""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Pallas-Triton lowering and interpret mode warn (deprecated backend); harmless here.
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")

# The Mosaic GPU kernels' tests (interpreter + CUDA lowering) run in a process of their own
# (test_mosaic_gpu.py): Mosaic GPU's lowering and interpreter are suspected of leaving process state behind
# (two XLA CPU compile segfaults in later, unrelated tests of the same xdist worker, 2026-12-01).
MGPU_ENV = "JAXDDTREE_MGPU_SUBPROCESS"
collect_ignore = [] if os.environ.get(MGPU_ENV) else ["mgpu"]
