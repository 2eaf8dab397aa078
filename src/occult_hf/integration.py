"""Putting `OccultMoE` into a transformers model, taking it out, saving, loading, training, generating.

- `apply_occult(model, occult_config, group=None)` replaces every MoE block of a loaded model (one
  model instance; nothing in transformers' classes changes) and `unapply_occult(model)` puts the
  original blocks back with their (trained) weights.
- `install()` / `uninstall()` wrap `PreTrainedModel.from_pretrained` so that it accepts
  `occult_config=` (an `OccultConfig`, a dict or a JSON path) and re-applies the setup stored in a
  checkpoint's config. transformers raises `TypeError` on unknown `from_pretrained` keywords and
  has no loading hook a plugin can register, so a thin, reversible wrapper of that one classmethod
  is the smallest change that makes `AutoModelForCausalLM.from_pretrained(..., occult_config=...)`
  work: it pops the keyword, calls the original, and applies the config to the returned model.
- On the replaced model, per instance: `save_pretrained` writes a vanilla checkpoint (all experts, in
  original order, gathered from the EP ranks) plus `occult_placement.json`, with `occult_config` on
  the config; under EP `generate` always runs with `synced_gpus=True`, so ranks that finish early
  keep stepping (their forwards take part in the all-to-alls) until every rank is done.

Training under EP (the EP group is the data-parallel group): expert parameters and the runtime's
buffers are listed in `model._ddp_params_and_buffers_to_ignore`, so DDP neither broadcasts nor
all-reduces them; `LocalExperts` scales expert gradients by 1/D; and every `OccultMoE` owns a
one-element `ep_grad_norm_carrier` parameter whose gradient, set at the end of each backward, is the
norm of the other ranks' expert gradients of that layer. With it, any per-rank
`clip_grad_norm_(model.parameters())` (HF Trainer's included) computes the global 2-norm and every
rank applies the same clipping factor.

Saving under EP is collective: `save_pretrained` gathers the experts to EP rank 0, which writes. HF
Trainer calls `save_pretrained` on rank 0 only; `occult_hf.trainer_ep` (installed with `install()`)
hooks the Trainer's `save_model`, which every rank runs, to gather a snapshot of the experts first,
and rank 0's `save_pretrained` writes from that snapshot while it is current. A save
that needs a gather the other ranks never join fails after `OCCULT_SAVE_TIMEOUT_S` seconds (default
300) with an error that says so, instead of hanging; before it gathers, and at `apply_occult`, the ranks
check that they agree on the whole EP configuration (`occult_hf.agreement`).

A save is atomic per file and ordered: every file is first written into a staging directory inside
`save_directory` (a failure there leaves the previous checkpoint untouched), then renamed into place,
`occult_placement.json` first and `config.json` (which holds the placement inline) last.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
import types
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging as hf_logging

from .agreement import SAVE_TIMEOUT_ENV, bounded, check_agreement, effective_setup, save_timeout_s
from .collectives import GradNormCarrier, gather_rows
from .config import OccultConfig
from .ddp_ignore import RankLocalStateNames
from .dispatch import ExpertParallelGroup
from .launch import check_process_group_started
from .moe import OccultMoE
from .patches import adapter_for
from .placement import PLACEMENT_FILENAME, Placement

logger = hf_logging.get_logger(__name__)

_STATE_ATTR = "_occult_state"
_DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


@dataclass
class _OccultState:
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
    caller_keeps_lockstep: bool = False  # see `lockstep_managed_by_caller`

    @property
    def placement(self) -> Placement:
        return self.occult_config.placement


# ----- apply / unapply ------------------------------------------------------------------------


def apply_occult(model: nn.Module, occult_config: OccultConfig | dict | str | None = None, group=None) -> nn.Module:
    """Replace every MoE block of `model` by an `OccultMoE` (in place) and return `model`.

    Args:
        model: a loaded transformers model of a supported family.
        occult_config: an `OccultConfig`, a dict, a JSON path, or None for the defaults (exact,
            contiguous placement, dedup dispatch).
        group: the expert-parallel process group; None means the default group when
            `torch.distributed` is initialised, else one process with `num_devices` logical devices.

    Under EP every rank must call this (it creates a process group for saving) with the same config.
    """
    config = OccultConfig.coerce(OccultConfig() if occult_config is None else occult_config)
    if group is None:
        check_process_group_started()  # torchrun/accelerate started several processes: each must be a rank
    if getattr(model, _STATE_ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} already has occult_hf applied; call unapply_occult(model) first")
    adapter = adapter_for(model)
    blocks = list(adapter.iter_moe_blocks(model))
    if not blocks:
        raise ValueError(
            f"found no MoE block ({', '.join(adapter.block_class_names)}) in {type(model).__name__}; "
            f"is it already replaced or a model without routed experts?"
        )
    num_experts = adapter.num_experts(model.config)
    layers = [layer for layer, _, _ in blocks]
    placement = _load_placement(config.placement)
    ep = ExpertParallelGroup.resolve(group, config.num_devices)
    if not ep.is_distributed and config.num_devices is None and placement is not None:
        ep = ExpertParallelGroup(num_devices=placement.num_devices)  # one process: the placement's logical devices
    if placement is None:
        placement = Placement.contiguous(num_experts, ep.num_devices, layers)
    placement.validate_for(num_experts, layers, ep.num_devices)
    if placement.has_replicas and config.prune is not None:  # pruning picks devices by the primary homes only
        raise NotImplementedError(
            f"OccultConfig.prune={config.prune!r} with a placement that has replicated experts (layers "
            f"{sorted(placement.replicas)}) is not supported: pruning limits a token to N_d devices of the primary "
            f"map, and the replica rule could send a pair elsewhere; plan without num_redundant_experts to prune"
        )
    config = replace(config, placement=placement, num_devices=ep.num_devices)

    state = _OccultState(occult_config=config, ep=ep, block_paths=[path for _, path, _ in blocks])
    if ep.is_distributed:  # before anything changes: a disagreeing group leaves every model as it was
        state.save_timeout_s = save_timeout_s()
        state.save_group = _new_save_group(ep)
        _check_ranks_agree(state, _first_expert_weight(blocks[0][2]), "apply_occult")
    if config.prune == "similarity":  # the profile must describe exactly this model's MoE layers
        from .pruning import load_pruning_profile

        load_pruning_profile(config.profile).check_compatible(model)
    pruners = _build_pruners(config, adapter, blocks, placement, ep, adapter.top_k(model.config))
    grad_norm = GradNormCarrier(ep.group) if ep.is_distributed else None  # one all-reduce per backward
    for (layer, path, block), pruner in zip(blocks, pruners):
        _set_submodule(model, path, OccultMoE(block, adapter, layer, placement, config, ep, pruner, grad_norm))

    if ep.is_distributed:
        state.ddp_ignore_before = getattr(model, _DDP_IGNORE_ATTR, None)
        # computed when DDP reads it, so that a later wrapper (plain peft.get_peft_model) is covered too
        setattr(model, _DDP_IGNORE_ATTR, RankLocalStateNames(model, state.ddp_ignore_before))
        state.instance_methods["generate"] = types.MethodType(_generate_in_lockstep, model)
    state.instance_methods["save_pretrained"] = types.MethodType(_save_pretrained, model)
    for name, method in state.instance_methods.items():
        model.__dict__[name] = method
    model.__dict__[_STATE_ATTR] = state
    model.config.occult_config = config.to_dict()
    return model


def unapply_occult(model: nn.Module) -> nn.Module:
    """Put the original MoE blocks back, with the current expert weights of all ranks; return `model`.

    Under EP every rank must call it (the experts are all-gathered: every rank gets the full model).
    """
    state = _state(model)
    _check_model_ranks_agree(model, state, "unapply_occult")
    for path in state.block_paths:
        module = model.get_submodule(path)
        gate_up_E2IH, down_EHI = _gather_full_experts(module, state, to_all=True)
        _set_submodule(model, path, module.restore(gate_up_E2IH, down_EHI))
    for name in state.instance_methods:
        model.__dict__.pop(name, None)
    if state.ep.is_distributed:
        if state.ddp_ignore_before is None:
            model.__dict__.pop(_DDP_IGNORE_ATTR, None)
        else:
            setattr(model, _DDP_IGNORE_ATTR, state.ddp_ignore_before)
    del model.__dict__[_STATE_ATTR]
    if hasattr(model.config, "occult_config"):
        del model.config.occult_config
    return model


def occult_modules(model: nn.Module) -> dict[str, OccultMoE]:
    """`{module path: OccultMoE}` of a model with occult_hf applied, in layer order."""
    state = _state(model)
    return {path: model.get_submodule(path) for path in state.block_paths}


def occult_config_of(model: nn.Module) -> OccultConfig:
    """The resolved `OccultConfig` of a replaced model (placement as a `Placement`, num_devices set)."""
    return _state(model).occult_config


def reset_counters(model: nn.Module) -> None:
    """Zero every `OccultMoE`'s rows/pairs/bytes counters."""
    for module in occult_modules(model).values():
        module.reset_counters()


def _state(model: nn.Module) -> _OccultState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} does not have occult_hf applied (see occult_hf.apply_occult)")
    return state


def _check_ranks_agree(state: _OccultState, expert_weight: torch.Tensor, operation: str) -> None:
    """Collective (EP only): every rank holds the same effective EP setup, else an error on every rank."""
    if not state.ep.is_distributed:
        return
    setup = effective_setup(state.occult_config, state.block_paths, expert_weight)
    check_agreement(setup, state.save_group, operation, state.save_timeout_s)


def _first_expert_weight(block: nn.Module) -> torch.Tensor:
    """A routed-expert weight of `block` (its dtype and device are part of the setup the ranks compare)."""
    return next(getattr(block, "experts", block).parameters())


def _check_model_ranks_agree(model: nn.Module, state: _OccultState, operation: str) -> None:
    expert_weight = model.get_submodule(state.block_paths[0]).local_experts.gate_up_proj
    _check_ranks_agree(state, expert_weight, operation)


def _load_placement(value) -> Placement | None:
    """The configured placement, or None for 'contiguous' (built once the device count is known)."""
    if isinstance(value, Placement):
        return value
    if value == "contiguous":
        return None
    if os.path.isfile(value) or os.path.isdir(value):
        return Placement.load(value)
    raise ValueError(
        f"OccultConfig.placement={value!r} is neither 'contiguous' nor an existing occult_placement.json "
        f"(or a directory holding one)"
    )


def _build_pruners(config, adapter, blocks, placement, ep, top_k) -> list:
    if config.prune is None:
        return [None] * len(blocks)
    from .pruning import build_pruner

    pruners = []
    for layer, _, block in blocks:
        device_of_E = torch.tensor(placement.device_of(layer), dtype=torch.int64)
        pruners.append(
            build_pruner(config, adapter, block, layer, device_of_E, num_devices=ep.num_devices, top_k=top_k)
        )
    return pruners


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


# ----- from_pretrained ------------------------------------------------------------------------

_UNSET = object()


def install() -> None:
    """Let `PreTrainedModel.from_pretrained` take `occult_config=` and restore saved occult setups.

    Idempotent; `uninstall()` puts the original classmethods back. Loading a checkpoint whose config
    holds `occult_config` applies it (pass `occult_config=None` to load the vanilla model).

    Two classmethods are wrapped: `PreTrainedModel.from_pretrained` (pops the keyword, applies the
    config to the loaded model) and `PreTrainedConfig.from_dict`. The Auto classes load the config
    first and hand it every keyword that names one of its attributes, so for a checkpoint that
    occult_hf saved, `occult_config=<OccultConfig>` lands on the config, which transformers then
    JSON-dumps (its "Model config ..." log line, `save_pretrained`). The second wrapper turns the
    object into its JSON-native dict there, as transformers does for `quantization_config`.
    """
    from transformers import PreTrainedConfig, PreTrainedModel

    if is_installed():
        return

    def from_pretrained(original, cls, *args, **kwargs):
        occult_config = kwargs.pop("occult_config", _UNSET)
        model = original(cls, *args, **kwargs)
        return _apply_on_load(model, occult_config)

    def from_dict(original, cls, *args, **kwargs):
        if isinstance(kwargs.get("occult_config"), OccultConfig):
            kwargs["occult_config"] = kwargs["occult_config"].to_dict()
        return original(cls, *args, **kwargs)

    _wrap_classmethod(PreTrainedModel, "from_pretrained", from_pretrained)
    _wrap_classmethod(PreTrainedConfig, "from_dict", from_dict)
    from .trainer_ep import install_trainer_hooks  # Trainer checkpoints and resume under EP

    install_trainer_hooks()


def uninstall() -> None:
    """Undo `install()` (no-op when not installed)."""
    from transformers import PreTrainedConfig, PreTrainedModel

    from .trainer_ep import uninstall_trainer_hooks

    uninstall_trainer_hooks()
    for owner, name in ((PreTrainedModel, "from_pretrained"), (PreTrainedConfig, "from_dict")):
        original = getattr(owner.__dict__[name].__func__, "__occult_original__", None)
        if original is not None:
            setattr(owner, name, original)


def is_installed() -> bool:
    from transformers import PreTrainedModel

    return getattr(PreTrainedModel.__dict__["from_pretrained"].__func__, "__occult_original__", None) is not None


def _wrap_classmethod(owner, name: str, wrapper) -> None:
    """Replace `owner.name` (a classmethod) by `wrapper(original_function, cls, ...)`; keep the original."""
    current = owner.__dict__[name]
    original = current.__func__

    @functools.wraps(original)
    def wrapped(cls, *args, **kwargs):
        return wrapper(original, cls, *args, **kwargs)

    wrapped.__occult_original__ = current
    setattr(owner, name, classmethod(wrapped))


def _apply_on_load(model, occult_config):
    """Apply `occult_config`, else the config's stored `occult_config` (AutoModel passes a keyword that
    names an existing config attribute to the config, so both routes end here)."""
    if occult_config is _UNSET:
        occult_config = getattr(model.config, "occult_config", None)
    if occult_config is None:
        if hasattr(model.config, "occult_config"):
            del model.config.occult_config
        return model
    return apply_occult(model, occult_config)


# ----- generate ---------------------------------------------------------------------------------


@contextlib.contextmanager
def lockstep_managed_by_caller(model: nn.Module):
    """Within the block, `model.generate` is transformers' own, without the forced `synced_gpus=True`.

    For callers that keep the EP ranks in step themselves (the lm-eval hook votes before every forward
    and pads ranks that run out of work): `synced_gpus`'s per-step all-reduce would interleave with the
    caller's own collectives.
    """
    state = _state(model)
    previous, state.caller_keeps_lockstep = state.caller_keeps_lockstep, True
    try:
        yield model
    finally:
        state.caller_keeps_lockstep = previous


def _generate_in_lockstep(model, *args, **kwargs):
    """`generate` with `synced_gpus=True`: every forward of an EP model is a collective."""
    if _state(model).caller_keeps_lockstep:
        return type(model).generate(model, *args, **kwargs)
    if kwargs.get("synced_gpus") is False:
        logger.warning("occult_hf: generate(synced_gpus=False) would hang under expert parallelism; using True")
    kwargs["synced_gpus"] = True
    return type(model).generate(model, *args, **kwargs)


# ----- saving -----------------------------------------------------------------------------------


def _save_pretrained(model, save_directory, *args, **kwargs):
    """`save_pretrained` of a replaced model: a vanilla checkpoint plus `occult_placement.json`.

    Under EP every rank must call it unless `snapshot_experts(model)` ran since the last weight
    update (what the Trainer hook in `trainer_ep` does); EP rank 0 writes.
    """
    state = _state(model)
    if kwargs.get("state_dict") is not None:
        raise ValueError(
            "save_pretrained(state_dict=...) is not supported on an occult_hf model: its state dict holds each "
            "rank's local experts; call save_pretrained without state_dict to write the vanilla checkpoint"
        )
    kwargs.pop("state_dict", None)
    is_main_process = kwargs.pop("is_main_process", True)
    full_experts = _full_experts_for_save(model, state)
    if full_experts is None or not is_main_process:
        return None
    state_dict = _vanilla_state_dict(model, state, full_experts)
    if os.path.isfile(save_directory):
        raise FileExistsError(f"save_pretrained: {os.fspath(save_directory)!r} is a file, expected a directory")
    os.makedirs(save_directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".occult_save-", dir=save_directory)
    try:
        state.placement.save(os.path.join(staging, PLACEMENT_FILENAME))
        result = type(model).save_pretrained(model, staging, *args, state_dict=state_dict, **kwargs)
        _publish(staging, os.fspath(save_directory))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


#: weight files transformers writes (and removes when stale): model.safetensors, shards, their index
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _publish(staging: str, target: str) -> None:
    """Move a complete save from `staging` into `target`: placement first, config last, then drop stale shards.

    Every file is whole before the first rename, so a failure while writing leaves `target` as it
    was; the renames themselves take microseconds (a crash among them can leave whole files of two
    saves, which load: weights are always in the original expert order).
    """
    names = sorted(os.listdir(staging))
    last = [n for n in ("config.json",) if n in names]
    first = [n for n in (PLACEMENT_FILENAME,) if n in names]
    for name in first + [n for n in names if n not in first and n not in last] + last:
        source, destination = os.path.join(staging, name), os.path.join(target, name)
        if os.path.isdir(source):
            shutil.rmtree(destination, ignore_errors=True)
        os.replace(source, destination)
    for name in os.listdir(target):  # what transformers' own save removes: weights of an older sharding
        if _WEIGHT_FILE.fullmatch(name) and name not in names and os.path.isfile(os.path.join(target, name)):
            os.remove(os.path.join(target, name))


def snapshot_experts(model: nn.Module) -> None:
    """Collective: gather every layer's experts to EP rank 0 (CPU) for a later rank-0-only save.

    The snapshot serves `save_pretrained` until the expert weights change (checked with the local
    parameters' version counters).
    """
    state = _state(model)
    if not state.ep.is_distributed:
        return
    _check_model_ranks_agree(model, state, "snapshot_experts")
    snapshot = {}
    for path in state.block_paths:
        weights = _gather_full_experts(model.get_submodule(path), state, to_all=False)
        if weights is not None:
            snapshot[path] = weights
    state.snapshot = snapshot if state.ep.rank == 0 else None
    state.snapshot_versions = _expert_versions(model, state)


def _full_experts_for_save(model, state) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """`{path: (gate_up [E, 2I, H], down [E, H, I])}` on the writing rank (EP rank 0), None elsewhere."""
    if not state.ep.is_distributed:
        return {path: _gather_full_experts(model.get_submodule(path), state, to_all=False) for path in state.block_paths}
    if state.snapshot_versions is not None and state.snapshot_versions == _expert_versions(model, state):
        return state.snapshot
    _check_model_ranks_agree(model, state, "save_pretrained")
    full = {}
    for path in state.block_paths:
        full[path] = _gather_full_experts(model.get_submodule(path), state, to_all=False)
    return full if state.ep.rank == 0 else None


def _expert_versions(model, state) -> tuple[int, ...]:
    versions = []
    for path in state.block_paths:
        experts = model.get_submodule(path).local_experts
        versions += [experts.gate_up_proj._version, experts.down_proj._version]
    return tuple(versions)


def _vanilla_state_dict(model, state, full_experts) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each block's local experts replaced by the family's vanilla entries."""
    state_dict = model.state_dict()
    for path in state.block_paths:
        module = model.get_submodule(path)
        runtime_names = {f"{path}.{name}" for name in module.runtime_state_names()}
        for name in list(state_dict):
            if name.startswith(f"{path}.experts.") or name in runtime_names:
                del state_dict[name]
        for key, value in module.place_full_experts(*full_experts[path]).items():
            state_dict[f"{path}.{key}"] = value
    return state_dict


def _new_save_group(ep: ExpertParallelGroup):
    """A gloo group of the EP ranks for the agreement check and the expert gathers (CPU tensors).

    Its own timeout is the process group's: ranks may reach `apply_occult` minutes apart (loading
    weights); each wait on it is bounded by `OCCULT_SAVE_TIMEOUT_S` instead (`agreement.bounded`).
    """
    ranks = dist.get_process_group_ranks(ep.group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


@torch.no_grad()
def _gather_full_experts(module: OccultMoE, state: _OccultState, to_all: bool):
    """The layer's full `(gate_up [E, 2I, H], down [E, H, I])` in original expert order.

    One process: the local weights themselves. EP: a gloo gather to EP rank 0 (`to_all=False`; other
    ranks get None) or an all-gather (`to_all=True`), through CPU, padded to the largest capacity.
    """
    experts = module.local_experts
    if not state.ep.is_distributed:
        return experts.gate_up_proj.detach(), experts.down_proj.detach()
    placement, layer = state.placement, module.layer_idx
    gathered = []
    for weight_L in (experts.gate_up_proj, experts.down_proj):
        parts = gather_rows(
            weight_L.detach().cpu(), 0, placement.capacities(layer), state.save_group, to_all,
            what=f"gathering the experts (save_pretrained/unapply_occult) of layer {layer}", timeout_s=state.save_timeout_s,
        )
        if parts is None:  # gathered to EP rank 0
            gathered.append(None)
            continue
        full = torch.empty((placement.num_experts, *weight_L.shape[1:]), dtype=weight_L.dtype)
        for device, part in enumerate(parts):
            full[placement.experts_on(layer, device)] = part
        gathered.append(full)
    if gathered[0] is None:
        return None
    return gathered[0], gathered[1]


# ----- HF Trainer -------------------------------------------------------------------------------


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class OccultCheckpointCallback(_trainer_callback_base()):
    """Kept for compatibility; checkpoints under expert parallelism no longer need a callback.

    It used to gather the experts for rank 0's save when `control.should_save` was set, which failed
    when it ran before `DefaultFlowCallback` (`OccultCallback.attach` put it there). Importing
    occult_hf now hooks the Trainer's save and resume themselves (`occult_hf.trainer_ep`), on every
    rank, whatever the callbacks and their order.
    """


__all__ = [
    "apply_occult",
    "unapply_occult",
    "occult_modules",
    "occult_config_of",
    "reset_counters",
    "snapshot_experts",
    "install",
    "uninstall",
    "is_installed",
    "lockstep_managed_by_caller",
    "OccultCheckpointCallback",
    "SAVE_TIMEOUT_ENV",
]
