"""DeepSeek-MoE 16B as a native transformers 5 model (`model_type "deepseek"`); see `modeling_deepseek`.

`register_deepseek()` makes `AutoConfig`, `AutoModel` and `AutoModelForCausalLM` resolve
`model_type "deepseek"` to these classes, and registers the weight conversion between the published
per-expert checkpoint layout (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) and the fused
`mlp.experts.gate_up_proj [E, 2I, H]` / `mlp.experts.down_proj [E, H, I]`: transformers applies it on
load and reverses it on save, so saved checkpoints keep the published layout.
"""

from __future__ import annotations

import transformers
from transformers import conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from .configuration_deepseek import DeepseekMoeConfig
from .modeling_deepseek import (
    DeepseekMoeBlock,
    DeepseekMoeForCausalLM,
    DeepseekMoeModel,
    DeepseekMoePreTrainedModel,
    DeepseekMoeTopkRouter,
)

MODEL_TYPE = DeepseekMoeConfig.model_type


def published_expert_conversion() -> list[WeightConverter]:
    """Published per-expert keys -> fused experts (transformers reverses it when saving)."""
    return [
        WeightConverter(
            source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns="mlp.experts.*.down_proj.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


def register_deepseek() -> None:
    """Register the config, the models and the weight conversion with transformers; idempotent.

    The conversion is registered under our model class names, not under the model type: a model of
    the published remote code (same model type, per-expert `ModuleList`) must load its keys unchanged.
    If transformers already maps `model_type "deepseek"` to other classes, that mapping is left alone.
    """
    config_mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    if MODEL_TYPE not in config_mapping:
        transformers.AutoConfig.register(MODEL_TYPE, DeepseekMoeConfig)
    if config_mapping[MODEL_TYPE] is not DeepseekMoeConfig:
        return
    for auto_class, model_class in (
        (transformers.AutoModel, DeepseekMoeModel),
        (transformers.AutoModelForCausalLM, DeepseekMoeForCausalLM),
    ):
        if DeepseekMoeConfig not in auto_class._model_mapping:
            auto_class.register(DeepseekMoeConfig, model_class)
    for model_class in (DeepseekMoeModel, DeepseekMoeForCausalLM):
        if model_class.__name__ not in conversion_mapping.USER_REGISTERED_MAPPINGS:
            conversion_mapping.register_checkpoint_conversion_mapping(model_class.__name__, published_expert_conversion())


__all__ = [
    "DeepseekMoeBlock",
    "DeepseekMoeConfig",
    "DeepseekMoeForCausalLM",
    "DeepseekMoeModel",
    "DeepseekMoePreTrainedModel",
    "DeepseekMoeTopkRouter",
    "published_expert_conversion",
    "register_deepseek",
]
