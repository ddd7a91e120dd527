"""jaxddtree: exact DDTree tree speculative decoding with a DFlash drafter for Qwen3.5/3.6 in JAX.

The public names load on first use (PEP 562), so `import jaxddtree.text` or `jaxddtree.model.config` (a command
line's argument and config checks) does not import jax first."""

from __future__ import annotations

import importlib

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
