"""Training small OLMoE models from scratch on a directory of text domains (`occult train`).

`prepare_data` (datasets + tokenizers: documents, held-out split, BPE, token streams), `train`
(transformers `Trainer`), `perplexity` / `capture_routing` / `routing_structure` (held-out quality
and learned-routing statistics). Recipes: `RECIPES` (`tiny`, `study`).
"""

from .data import PreparedData, prepare_data
from .evaluate import capture_routing, perplexity, routing_structure
from .recipes import RECIPES, Recipe, get_recipe
from .shipped import TINY_CHECKPOINT, demo_sources, tiny_checkpoint_path
from .train import train

__all__ = [
    "PreparedData",
    "RECIPES",
    "Recipe",
    "TINY_CHECKPOINT",
    "capture_routing",
    "demo_sources",
    "get_recipe",
    "perplexity",
    "prepare_data",
    "routing_structure",
    "tiny_checkpoint_path",
    "train",
]
