"""Native transformers 5 classes for MoE models that transformers itself does not ship.

`register_models()` (called when occult_hf is imported) registers them with transformers' Auto
classes, so `AutoModelForCausalLM.from_pretrained` loads their published checkpoints without
`trust_remote_code`:

- `deepseek` (`occult_hf.models.deepseek`): DeepSeek-MoE 16B (deepseek-ai/deepseek-moe-16b-base, -chat).
"""

from .deepseek import register_deepseek


def register_models() -> None:
    """Register every native model class with transformers (idempotent)."""
    register_deepseek()


__all__ = ["register_models", "register_deepseek"]
