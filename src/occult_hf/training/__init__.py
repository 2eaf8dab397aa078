"""Training small OLMoE models from scratch on a directory of text domains (`occult train`).

`prepare_data` (datasets + tokenizers: documents, held-out split, BPE, token streams), `train`
(transformers `Trainer`), `perplexity` / `capture_routing` / `routing_structure` (held-out quality
and learned-routing statistics). Recipes: `RECIPES` (`tiny`, `study`).
"""

from .data import PreparedData, prepare_data
from .evaluate import capture_routing, perplexity, routing_structure
from .recipes import RECIPES, Recipe, get_recipe
from .train import train

#: the checkpoint that ships in the package (made by `occult train --recipe tiny`), for `occult demo`
TINY_CHECKPOINT = "tiny_olmoe"


def tiny_checkpoint_path():
    """The path of the shipped tiny checkpoint (a directory inside the installed package)."""
    from importlib import resources

    return resources.files("occult_hf") / "data" / TINY_CHECKPOINT


__all__ = [
    "PreparedData",
    "RECIPES",
    "Recipe",
    "TINY_CHECKPOINT",
    "capture_routing",
    "get_recipe",
    "perplexity",
    "prepare_data",
    "routing_structure",
    "tiny_checkpoint_path",
    "train",
]
