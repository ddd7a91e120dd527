"""The Mosaic GPU kernels' tests: the interpreter's global state reset around every test."""

import pytest


@pytest.fixture(autouse=True)
def _reset_interpreter():
    """The interpreter keeps global state that an exception leaves behind (its docstring)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.reset_gpu_interpret_mode_state()
    yield
