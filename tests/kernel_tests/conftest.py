"""Kernel tests run on the CPU (interpret mode + abstract-H200 lowering); the repo root must be importable."""

import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Pallas-Triton lowering and interpret mode warn (deprecated backend); harmless here.
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")
