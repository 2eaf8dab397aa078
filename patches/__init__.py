"""occult_hf.patches: one adapter per supported model family, registered on import.

`adapter_for(model_or_config)` finds the adapter by `config.model_type`; the list of families and
their routing rules is in docs/models.md.
"""

from . import deepseek, deepseek_v2, deepseek_v3, olmoe, qwen2_moe, qwen3_moe  # noqa: F401  (registration)
from .base import MoEAdapter, RouterOutput, adapter_for, register_adapter, registered_adapters

__all__ = ["MoEAdapter", "RouterOutput", "adapter_for", "register_adapter", "registered_adapters"]
