"""Smoke test of the test environment (what `make venv` installs).

Fails fast and clearly if the venv is broken, instead of deep inside a model test.
"""

import sys


def test_python_version():
    assert sys.version_info >= (3, 12), sys.version


def test_jax_version_and_cpu_backend():
    import jax
    import jax.numpy as jnp

    assert jax.__version__ == "0.11.2"
    x = jnp.arange(6.0).reshape(2, 3)
    assert float(jax.jit(lambda a: (a @ a.T).sum())(x)) == 83.0


def test_jax_stack_imports():
    import flax
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import safetensors.numpy  # noqa: F401
    import tokenizers  # noqa: F401
    from flax import nnx  # noqa: F401

    assert tuple(int(p) for p in flax.__version__.split(".")[:2]) >= (0, 12)


def test_torch_reference_stack():
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration  # noqa: F401

    assert tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 17)
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert float((a @ a.T).sum()) == 83.0
