"""What `apply_occult` did to one model instance, kept on the model so that it can be undone.

Shared by model surgery (`hf.apply`, which creates and removes it), checkpointing
(`checkpointing`, which saves from it) and the Trainer hooks (`hf.trainer`, which find the model
inside its wrappers by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import OccultConfig
from ..dispatch import ExpertParallelGroup
from ..placement import Placement

#: the attribute of the model instance that holds its `OccultState`
STATE_ATTR = "_occult_state"


@dataclass
class OccultState:
    """What `apply_occult` did to one model, kept on the model so that it can be undone."""

    occult_config: OccultConfig  # placement resolved to a `Placement`
    ep: ExpertParallelGroup
    block_paths: list[str]
    save_group: Any = None  # gloo group of the EP ranks for gathers at save time (EP only)
    save_timeout_s: float = 0.0  # the save group's bound on every wait (EP only)
    ddp_ignore_before: list[str] | None = None
    snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # EP rank 0: path -> full weights
    snapshot_versions: tuple[int, ...] | None = None
    instance_methods: dict[str, Any] = field(default_factory=dict)
    caller_keeps_lockstep: bool = False  # see `hf.apply.lockstep_managed_by_caller`

    @property
    def placement(self) -> Placement:
        return self.occult_config.placement


def state_of(model: nn.Module) -> OccultState:
    """The model's `OccultState`; a clear error when occult_hf is not applied to it."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} does not have occult_hf applied (see occult_hf.apply_occult)")
    return state


def attach_state(model: nn.Module, attr: str, state, occult_config: OccultConfig) -> None:
    """Put `state` and its per-instance methods on the model, and the config on `model.config` as
    JSON-native data (so that transformers can log and save it). Shared by both ways of applying occult
    (`apply_occult` and transformers' EP registry), whose states differ but attach alike."""
    for name, method in state.instance_methods.items():
        model.__dict__[name] = method
    model.__dict__[attr] = state
    model.config.occult_config = occult_config.to_dict()
