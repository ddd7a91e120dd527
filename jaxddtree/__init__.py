"""jaxddtree: exact DDTree tree speculative decoding with a DFlash drafter for Qwen3.5/3.6 in JAX.

The public names load on first use (PEP 562), so `import jaxddtree.text` or `jaxddtree.model.config` (a command
line's argument and config checks) does not import jax first."""

from __future__ import annotations

import importlib
import os

# jax's GPU allocator takes 75 % of the card by default: 59 GiB of an 80 GB H100, less than the 27B bf16 weights
# (50 GiB) and their caches and temporaries. Unless the user set a fraction, take 92 % (read when the backend
# starts, i.e. after this import).
if not os.environ.get("XLA_CLIENT_MEM_FRACTION") and not os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.92"

_EXPORTS = {  # public name -> the module that defines it
    "score": "jaxddtree.api", "score_tree": "jaxddtree.api",
    "ConfigError": "jaxddtree.model.config", "TextConfig": "jaxddtree.model.config",
    "load_config": "jaxddtree.model.config",
    "CheckpointError": "jaxddtree.checkpoint.params",
    "load_drafter": "jaxddtree.checkpoint.load", "load_target": "jaxddtree.checkpoint.load",
    "Target": "jaxddtree.model.target", "random_target": "jaxddtree.model.target",
    "Generation": "jaxddtree.speculative.loop", "generate": "jaxddtree.speculative.loop",
    "Drafter": "jaxddtree.model.drafter", "PrefixCache": "jaxddtree.speculative.prefix_cache",
}

__all__ = ["CheckpointError", "ConfigError", "Drafter", "Generation", "PrefixCache", "Target", "generate",
           "load_drafter", "TextConfig", "load_config", "load_target", "random_target", "score", "score_tree"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxddtree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
