"""jaxddtree: exact DDTree tree speculative decoding with a DFlash drafter for Qwen3.5/3.6 in JAX."""

from jaxddtree.api import score, score_tree
from jaxddtree.model.config import ConfigError, TextConfig, load_config
from jaxddtree.checkpoint.params import CheckpointError
from jaxddtree.checkpoint.load import load_drafter, load_target
from jaxddtree.model.target import Target, random_target
from jaxddtree.speculative.loop import Generation, generate
from jaxddtree.model.drafter import Drafter

__all__ = ["CheckpointError", "ConfigError", "Drafter", "Generation", "Target", "generate", "load_drafter", "TextConfig", "load_config", "load_target",
           "random_target", "score", "score_tree"]
