"""What DDP must leave alone under expert parallelism, whatever wraps the model (plain peft included).

DDP reads `module._ddp_params_and_buffers_to_ignore` once, when it wraps `module`: parameters and
buffers named there are neither broadcast from rank 0 at construction nor all-reduced in backward.
Under EP each rank's experts (and their LoRA factors, and the runtime's own buffers) are its own, so
they must be listed, under their names *relative to the module DDP wraps*.

A static list written by `apply_occult` goes stale when the model is wrapped afterwards: plain
`peft.get_peft_model(model, config)` moves the experts under `base_model.model.` and (with
`target_parameters`) under `...experts.base_layer.`, and `PeftModel` forwards the attribute read to
the inner model, so DDP would get names that match nothing and broadcast rank 0's experts over
every other rank's, silently. `RankLocalStateNames` is therefore computed when DDP reads it: the
current names of every rank-local tensor, as seen from the transformers model and from a `PeftModel`
around it. peft also freezes every parameter that is not an adapter, including each layer's
`ep_grad_norm_carrier`, without which per-rank gradient clipping is no longer global (ranks would clip
by different factors and their replicated weights drift apart); reading the list makes the carriers
trainable again, as `peft_support.prepare_peft_model` does.
"""

from __future__ import annotations

import weakref

from torch import nn

from ..moe import OccultMoE

DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"
#: where `peft.PeftModel` holds the model it wraps (`PeftModel.base_model` is the tuner, `.model` the model)
PEFT_MODEL_PREFIX = "base_model.model."


def rank_local_names(model: nn.Module) -> list[str]:
    """Names (relative to `model`) of every distributed `OccultMoE`'s rank-local parameters and buffers:
    its experts' tensors (with any peft wrapper's base layer and LoRA factors) and the runtime's state."""
    names = []
    for path, module in model.named_modules():
        if not isinstance(module, OccultMoE) or not module.ep.is_distributed:
            continue
        names += [name for name, _ in module.experts.named_parameters(prefix=f"{path}.experts")]
        names += [name for name, _ in module.experts.named_buffers(prefix=f"{path}.experts")]
        names += [f"{path}.{name}" for name in module.runtime_state_names()]
    return names


def enable_grad_norm_carriers(model: nn.Module) -> None:
    """Make every distributed `OccultMoE`'s `ep_grad_norm_carrier` trainable (peft freezes it)."""
    for module in model.modules():
        if isinstance(module, OccultMoE) and module.ep.is_distributed:
            module.ep_grad_norm_carrier.requires_grad_(True)


class RankLocalStateNames:
    """`model._ddp_params_and_buffers_to_ignore` of an EP model, computed when DDP reads it.

    Iterating gives the names set before `apply_occult`, plus `rank_local_names(model)` as they are
    now, each also under `PEFT_MODEL_PREFIX` (DDP over a `PeftModel` reads this same attribute); and
    it re-enables the grad-norm carriers (see the module docstring). Holds the model weakly.
    """

    def __init__(self, model: nn.Module, before=None) -> None:
        self._model = weakref.ref(model)
        self.before = list(before or [])

    def __iter__(self):
        model = self._model()
        names = set(self.before)
        if model is not None:
            enable_grad_norm_carriers(model)
            local = rank_local_names(model)
            names |= set(local) | {PEFT_MODEL_PREFIX + name for name in local}
        return iter(sorted(names))

    def __len__(self) -> int:
        return len(list(self))

    def __repr__(self) -> str:
        return f"RankLocalStateNames({list(self)!r})"


__all__ = ["DDP_IGNORE_ATTR", "PEFT_MODEL_PREFIX", "RankLocalStateNames", "enable_grad_norm_carriers", "rank_local_names"]
