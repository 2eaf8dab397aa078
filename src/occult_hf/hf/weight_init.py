"""transformers' weight initialisation reaches the routed experts of an occult_hf model.

A family's `_init_weights(module)` initialises its routed experts under a class check
(`isinstance(module, OlmoeExperts)`), which `LocalExperts` never passes: after `apply_occult`,
`model.init_weights()` or `model.apply(model._init_weights)` re-initialised every weight but the
routed experts, which kept their values. `install_expert_init` puts an `_init_weights` on each
`PreTrainedModel` of the model (transformers' `smart_apply` calls each one's own) that also runs the
family's init on a shallow copy of the experts module a `LocalExperts` replaces, holding the local
expert weights, and on an `OccultMoE`'s original block (Qwen3-Next initialises its router there): the
same init functions, on the tensors the block computes with (under EP, this rank's experts).

transformers skips what is already initialised by `_is_hf_initialized` flags, on modules
(`init_weights()`) and on tensors (every `transformers.initialization` function). The new modules and
local expert parameters take the flags of the ones they stand for, so `init_weights()` on a loaded
model leaves them as it leaves stock's, and a re-initialisation reaches them when it reaches stock's.
"""

from __future__ import annotations

import copy

from torch import nn

from .state import ModelMethod, OccultState
from ..experts import LocalExperts
from ..moe import OccultMoE

#: transformers' mark of a module or tensor that its weight initialisation must leave alone
FLAG = "_is_hf_initialized"


def install_expert_init(model: nn.Module, state: OccultState) -> None:
    """Give every `PreTrainedModel` in `model` (itself included) the `_init_weights` the module docstring describes,
    and the replacing modules the flags of the replaced ones."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.__dict__["_init_weights"] = ModelMethod(_init_weights_reaching_local_experts, module)
            state.module_attributes.append((module, "_init_weights"))
        elif isinstance(module, OccultMoE):
            _take_flag(module, module.original_block)
        elif isinstance(module, LocalExperts) and module.replaced_module is not None:
            _take_flag(module, module.replaced_module)
            for name, parameter in module.named_parameters(recurse=False):
                _take_flag(parameter, module.replaced_module._parameters.get(name))


def _take_flag(new, old) -> None:
    if getattr(old, FLAG, False):
        setattr(new, FLAG, True)


def _init_weights_reaching_local_experts(model: nn.Module, module: nn.Module) -> None:
    type(model)._init_weights(model, module)
    if isinstance(module, OccultMoE):
        type(model)._init_weights(model, module.original_block)
    elif isinstance(module, LocalExperts) and module.replaced_module is not None:
        stand_in = copy.copy(module.replaced_module)  # its own `_parameters` below: the original keeps its own
        stand_in._parameters = {name: module._parameters.get(name, p) for name, p in stand_in._parameters.items()}
        type(model)._init_weights(model, stand_in)


__all__ = ["install_expert_init"]
