"""Training recipes: the model and the run that `occult train --recipe NAME` makes.

A recipe is everything needed to re-make a checkpoint from its corpus: the `OlmoeConfig` fields, the data
settings (which corpus domains train, how much text, the held-out fraction, the tokenizer's vocabulary) and
the Trainer settings (steps, batch, sequence length, learning rate, seed). It is written next to the
checkpoint as `recipe.json`, its domains named (`train_domains`), so a shipped checkpoint says how it was made.

- `tiny`: a CPU model for the tests and the main job (`occult demo`): E=32 experts, top-4, 4 layers
  at hidden 64, trained on a slice of every domain of the corpus in about a minute on 2 cores.
- `study`: an OLMoE-like model for one GPU (64 fine-grained experts, top-8, 8 layers at hidden
  512, expert width 256), trained for a fixed time budget on two of the three domains so that the
  third (Python standard-library code) is new to it when the quality study fine-tunes on it (the domains
  of the project's development corpus: python_docs, kernel_docs, python_stdlib_code).
- `study_long`: the same model and data trained for a fixed 1,300 steps x 64 x 512 = 42.6M tokens
  (4.4 passes over the 9.7M training tokens of python_docs + kernel_docs), the quality study's
  stronger base; 218.4M parameters. Its 400 s time budget only shortens the schedule on a GPU slower than an H200.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..utils.checks import check_count

#: the Recipe fields that are counts, and their least values (a bool is not a count)
_COUNT_MINIMA = {
    "num_experts": 1, "top_k": 1, "hidden_size": 1, "intermediate_size": 1, "num_layers": 1, "num_heads": 1,
    "vocab_size": 1, "seq_len": 1, "max_steps": 1, "batch_size": 1, "warmup_steps": 0, "seed": 0,
}  # fmt: skip


@dataclass
class Recipe:
    """How one model is trained (see the module docstring for the two recipes)."""

    name: str = field(metadata={"help": "recipe name (`tiny`, `study`)"})
    # ----- model (OlmoeConfig fields) -----
    num_experts: int = field(default=32, metadata={"help": "routed experts per MoE layer (E)"})
    top_k: int = field(default=4, metadata={"help": "experts per token (k)"})
    hidden_size: int = field(default=64, metadata={"help": "model width (H)"})
    intermediate_size: int = field(default=32, metadata={"help": "width of one expert (fine-grained: below H)"})
    num_layers: int = field(default=4, metadata={"help": "decoder layers, each with an MoE block"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    router_aux_loss_coef: float = field(default=0.01, metadata={"help": "weight of the load-balancing loss"})
    # ----- data -----
    vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary (trained on the training split)"})
    train_domains: tuple[str, ...] | None = field(
        default=None, metadata={"help": "domains the model is trained on (None: every domain of the prepared data)"}
    )
    heldout_fraction: float = field(default=0.05, metadata={"help": "last documents of each domain held out"})
    max_chars_per_domain: int | None = field(
        default=None, metadata={"help": "text kept per domain and split (training, held-out), in characters (None: all)"}
    )
    seq_len: int = field(default=128, metadata={"help": "packed sequence length"})
    # ----- Trainer -----
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "sequences per step"})
    learning_rate: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps"})
    lr_scheduler: str = field(default="cosine", metadata={"help": "transformers scheduler name"})
    time_budget_s: float | None = field(default=None, metadata={"help": "stop training after this many seconds"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPU)"})
    torch_compile: bool = field(
        default=False,
        metadata={"help": "compile the model for training (TrainingArguments(torch_compile=True)): faster on a GPU after a "
                  "compile of about a minute, and not bitwise repeatable (inductor picks its kernels by timing them)"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the weights, the data order and the held-out sample"})

    def __post_init__(self) -> None:
        for name, minimum in _COUNT_MINIMA.items():
            check_count(f"Recipe {self.name}: {name}", getattr(self, name), minimum)
        if isinstance(self.train_domains, str):  # tuple() would split it into one-letter domains
            raise ValueError(
                f"Recipe {self.name}: train_domains {self.train_domains!r} must be None or a list of domain names"
            )
        if self.train_domains is not None:
            self.train_domains = tuple(self.train_domains)
            if not self.train_domains or not all(isinstance(d, str) and d for d in self.train_domains):
                raise ValueError(f"Recipe {self.name}: train_domains {list(self.train_domains)} must be None or domain names")
        if self.top_k > self.num_experts:
            raise ValueError(f"Recipe {self.name}: top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        fraction = self.heldout_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
            raise ValueError(f"Recipe {self.name}: heldout_fraction ({self.heldout_fraction}) must be in (0, 1)")
        budget = self.time_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf):
            raise ValueError(f"Recipe {self.name}: time_budget_s ({budget!r}) must be None or a finite number of seconds > 0")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"Recipe {self.name}: hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with `changes` (unknown names are an error that lists the fields)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"Recipe has no field(s) {unknown}; its fields are {sorted(names)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["train_domains"] = None if self.train_domains is None else list(self.train_domains)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def model_config(self):
        """The `OlmoeConfig` of this recipe (token ids 0, 1, 2 are pad, bos, eos as the tokenizer makes them)."""
        from transformers import OlmoeConfig

        return OlmoeConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=max(1024, self.seq_len),
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            router_aux_loss_coef=self.router_aux_loss_coef,
            output_router_logits=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )


RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(
        name="tiny",
        max_chars_per_domain=400_000,
        max_steps=150,
        batch_size=8,
        seq_len=128,
        learning_rate=3e-3,
    ),
    "study": Recipe(
        name="study",
        num_experts=64,
        top_k=8,
        hidden_size=512,
        intermediate_size=256,
        num_layers=8,
        num_heads=8,
        vocab_size=8192,
        train_domains=("python_docs", "kernel_docs"),
        seq_len=512,
        max_steps=3000,
        batch_size=64,
        learning_rate=1e-3,
        warmup_steps=100,
        time_budget_s=240.0,
        bf16=True,
    ),
}
RECIPES["study_long"] = RECIPES["study"].replace(name="study_long", max_steps=1300, time_budget_s=400.0)


def get_recipe(name: str, **changes: Any) -> Recipe:
    """The named recipe, with `changes` applied."""
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is not known; choose one of {sorted(RECIPES)}")
    return RECIPES[name].replace(**changes) if changes else RECIPES[name]
