"""What occult_hf did to one model instance, kept on the model so that it can be undone.

One class for both front ends: `hf.apply.apply_occult` (the model's MoE blocks replaced by `OccultMoE`)
and `hf.native_ep.apply_occult_ep` (transformers' own expert parallelism runs `OccultEP` in its experts
modules). Model surgery creates and removes it, checkpointing saves from it and the Trainer hooks find the
model inside its wrappers by it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..config import OccultConfig
from ..dispatch import ExpertParallelGroup
from ..placement import Placement
from .model_card import PRUNING_CONFIG_KEY

#: the attribute of the model instance that holds its `OccultState`
STATE_ATTR = "_occult_state"
#: `OccultState.front_end` of a model whose blocks `apply_occult` replaced
BLOCKS = "blocks"
#: `OccultState.front_end` of a model configured inside transformers' expert parallelism
TRANSFORMERS_EP = "transformers_ep"


@dataclass
class OccultState:
    """What occult_hf did to one model, kept on the model so that it can be undone.

    Attributes:
        occult_config: the resolved `OccultConfig` (placement a `Placement`, `num_devices` set).
        ep: the expert-parallel group.
        block_paths: module paths of the MoE blocks, in layer order.
        front_end: `BLOCKS` or `TRANSFORMERS_EP`.
        agreement_group: a gloo group of the EP ranks for the agreement check and the experts' gathers (EP only).
        save_timeout_s: the bound on every wait on that group (EP only).
        instance_methods: name -> module-level function put on the model instance as a `ModelMethod` (removed on
            undo).
        hooks: forward hooks put on modules of the model (removed on undo).
        module_attributes: `(module, name)` of attributes put on modules of the model (removed on undo).
        ddp_ignore_before: the model's DDP ignore list before `apply_occult` (EP only).
        snapshot, snapshot_versions: EP rank 0's full experts for a save, and the parameter versions they are of.
        pruning_profile: the routing profile `apply_occult`'s similarity pruning was built from (None otherwise),
            kept so that a save can bundle it after its file has moved or a checkpoint rotation removed it.
        caller_keeps_lockstep: see `hf.apply.lockstep_managed_by_caller`.
    """

    occult_config: OccultConfig
    ep: ExpertParallelGroup
    block_paths: list[str]
    front_end: str = BLOCKS
    agreement_group: Any = None
    save_timeout_s: float = 0.0
    instance_methods: dict[str, Callable] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    module_attributes: list[tuple[nn.Module, str]] = field(default_factory=list)
    ddp_ignore_before: list[str] | None = None
    snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    snapshot_versions: tuple[int, ...] | None = None
    pruning_profile: Any = None
    caller_keeps_lockstep: bool = False

    @property
    def placement(self) -> Placement:
        return self.occult_config.placement


class ModelMethod:
    """A function bound to one model and put on the instance, like `types.MethodType`, but pickled as the function
    and the model: a bound method pickles as `getattr(model, function name)`, which the unpickler calls before the
    model has its attributes, so an occult model pickled whole (torch's save of the model object) could either not be
    loaded back or came back with transformers' own `save_pretrained` in place of occult's."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable, model: nn.Module) -> None:
        self.__func__, self.__self__ = function, model

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return ModelMethod, (self.__func__, self.__self__)

    def __repr__(self) -> str:
        return f"<occult_hf method {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


def state_of(model: nn.Module, front_end: str | None = None) -> OccultState:
    """The model's `OccultState`; a clear error when occult_hf is not applied to it (by `front_end`, if given)."""
    state = getattr(model, STATE_ATTR, None)
    if state is None or (front_end is not None and state.front_end != front_end):
        how = "occult_hf.apply_occult" if front_end != TRANSFORMERS_EP else "occult_hf.apply_occult_ep"
        raise ValueError(f"{type(model).__name__} does not have occult_hf applied (see {how})")
    return state


def attach_state(model: nn.Module, state: OccultState) -> None:
    """Put `state` and its per-instance methods on the model, and the config on `model.config` as
    JSON-native data (so that transformers can log and save it), on a config of the model's own
    (`_own_config`). A pruning description the loaded `config.json` carried goes: each save writes it
    anew from the config the model runs."""
    for name, function in state.instance_methods.items():
        model.__dict__[name] = ModelMethod(function, model)
    model.__dict__[STATE_ATTR] = state
    _own_config(model)
    forget_saved_description(model.config)
    model.config.occult_config = state.occult_config.to_dict()


def _own_config(model: nn.Module) -> None:
    """Give `model` and its modules a copy of their transformers config (sub-configs included): models built from one
    config object (`from_config(config)` twice) share it, and the setup stored there would otherwise be the last
    converted model's on all of them, which each one's save would write, and each one's `unapply_occult` take off."""
    copies: dict[int, Any] = {}  # id of each object of the config -> its copy (deepcopy's memo)
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]


def detach_state(model: nn.Module) -> OccultState:
    """Take the state, its instance methods, hooks and module attributes, and the stored config off the model; return
    the state."""
    state = model.__dict__.pop(STATE_ATTR)
    for handle in state.hooks:
        handle.remove()
    state.hooks.clear()
    for module, name in state.module_attributes:
        module.__dict__.pop(name, None)
    state.module_attributes.clear()
    for name in state.instance_methods:
        model.__dict__.pop(name, None)
    forget_saved_description(model.config)
    return state


def config_without_setup(config):
    """`config`, or where it holds occult_hf's entries (a converted model's config) a copy without them: what
    `from_config` builds a model on. That model is plain (`apply_occult` converts it), and with the entries it would
    save an occult setup it never ran, which its reload would apply."""
    if not any(hasattr(config, key) for key in ("occult_config", PRUNING_CONFIG_KEY)):
        return config
    plain = copy.deepcopy(config)
    forget_saved_description(plain)
    return plain


def forget_saved_description(config) -> None:
    """Take occult_hf's entries (`occult_config`, `occult_pruning`) off a transformers config: a model that no longer
    runs what they describe must not save them again."""
    for key in ("occult_config", PRUNING_CONFIG_KEY):
        if hasattr(config, key):
            delattr(config, key)
