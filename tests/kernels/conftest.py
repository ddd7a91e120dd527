"""Kernel tests run on the CPU (interpret mode + abstract-H200 lowering); the repo root must be importable."""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Pallas-Triton lowering and interpret mode warn (deprecated backend); harmless here.
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")

# Test directories that run in a process of their own (test_own_process.py), as XLA CPU compile segfaults in later,
# unrelated tests of the same xdist worker followed them (2026-12-01): mgpu/ (the Mosaic GPU kernels' interpreter and
# CUDA lowering) and gdn_slots/ (the GDN tree kernel under vmap, custom_vmap merging).
OWN_PROCESS_ENV = "JAXDDTREE_OWN_PROCESS"
OWN_PROCESS = ("mgpu", "gdn_slots")
collect_ignore = [] if os.environ.get(OWN_PROCESS_ENV) else list(OWN_PROCESS)
