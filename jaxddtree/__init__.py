"""jaxddtree: exact DDTree tree speculative decoding with a DFlash drafter for Qwen3.5/3.6 in JAX."""

from jaxddtree.api import score, score_tree
from jaxddtree.config import ConfigError, TextConfig, load_config
from jaxddtree.loading import CheckpointError
from jaxddtree.target import Target, load_target, random_target
from jaxddtree.loop import Generation, generate
from jaxddtree.drafter import Drafter, load_drafter

__all__ = ["CheckpointError", "ConfigError", "Drafter", "Generation", "Target", "generate", "load_drafter", "TextConfig", "load_config", "load_target",
           "random_target", "score", "score_tree"]
