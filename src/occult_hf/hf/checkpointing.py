"""Saving a model with occult_hf applied, and gathering its experts from the EP ranks.

- `save_pretrained(model, save_directory, ...)` (bound on the model instance by `apply_occult`)
  writes a vanilla checkpoint (all experts, in original order, gathered from the EP ranks) plus
  `occult_placement.json`, with `occult_config` on the config.
- `snapshot_experts(model)` gathers the experts ahead of a rank-0-only save.
- `gather_full_experts` (save, `unapply_occult`) and the EP configuration check
  (`check_ranks_agree`) run on a gloo group of the EP ranks made by `new_save_group`.

Saving under EP is collective: `save_pretrained` gathers the experts to EP rank 0, which writes. HF
Trainer calls `save_pretrained` on rank 0 only; `occult_hf.hf.trainer` (installed with `install()`)
hooks the Trainer's `save_model`, which every rank runs, to gather a snapshot of the experts first,
and rank 0's `save_pretrained` writes from that snapshot while it is current. A save
that needs a gather the other ranks never join fails after `OCCULT_SAVE_TIMEOUT_S` seconds (default
300) with an error that says so, instead of hanging; before it gathers, and at `apply_occult`, the ranks
check that they agree on the whole EP configuration (`occult_hf.distributed.agreement`).

A save is atomic per file and ordered: every file is first written into a staging directory inside
`save_directory` (a failure there leaves the previous checkpoint untouched), then renamed into place,
`occult_placement.json` first and `config.json` (which holds the placement inline) last.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .state import OccultState, state_of
from ..distributed.agreement import check_agreement, effective_setup
from ..distributed.collectives import gather_rows
from ..moe import OccultMoE
from ..placement import PLACEMENT_FILENAME

# ----- the EP ranks agree, and the group for gathers ------------------------------------------------


def new_save_group(ep_group):
    """A gloo group of the ranks of the process group `ep_group`, for the agreement check and the expert gathers
    (CPU tensors).

    Its own timeout is the process group's: ranks may reach `apply_occult` minutes apart (loading
    weights); each wait on it is bounded by `OCCULT_SAVE_TIMEOUT_S` instead (`agreement.bounded`).
    """
    ranks = dist.get_process_group_ranks(ep_group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def check_ranks_agree(state: OccultState, expert_weight: torch.Tensor, operation: str, model_config=None) -> None:
    """Collective (EP only): every rank holds the same effective EP setup (and `model_config`, when given),
    else an error on every rank."""
    if not state.ep.is_distributed:
        return
    setup = effective_setup(state.occult_config, state.block_paths, expert_weight, model_config)
    check_agreement(setup, state.save_group, operation, state.save_timeout_s)


def check_model_ranks_agree(model: nn.Module, state: OccultState, operation: str) -> None:
    expert_weight = model.get_submodule(state.block_paths[0]).local_experts.gate_up_proj
    check_ranks_agree(state, expert_weight, operation)


@torch.no_grad()
def gather_full_experts(module: OccultMoE, state: OccultState, to_all: bool):
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


# ----- saving -----------------------------------------------------------------------------------


def save_pretrained(model, save_directory, *args, **kwargs):
    """`save_pretrained` of a replaced model: a vanilla checkpoint plus `occult_placement.json`.

    Under EP every rank must call it unless `snapshot_experts(model)` ran since the last weight
    update (what the Trainer hook in `hf.trainer` does); EP rank 0 writes.
    """
    state = state_of(model)
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
    state = state_of(model)
    if not state.ep.is_distributed:
        return
    check_model_ranks_agree(model, state, "snapshot_experts")
    snapshot = {}
    for path in state.block_paths:
        weights = gather_full_experts(model.get_submodule(path), state, to_all=False)
        if weights is not None:
            snapshot[path] = weights
    state.snapshot = snapshot if state.ep.rank == 0 else None
    state.snapshot_versions = _expert_versions(model, state)


def _full_experts_for_save(model, state) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """`{path: (gate_up [E, 2I, H], down [E, H, I])}` on the writing rank (EP rank 0), None elsewhere."""
    if not state.ep.is_distributed:
        return {path: gather_full_experts(model.get_submodule(path), state, to_all=False) for path in state.block_paths}
    if state.snapshot_versions is not None and state.snapshot_versions == _expert_versions(model, state):
        return state.snapshot
    check_model_ranks_agree(model, state, "save_pretrained")
    full = {}
    for path in state.block_paths:
        full[path] = gather_full_experts(model.get_submodule(path), state, to_all=False)
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


__all__ = ["save_pretrained", "snapshot_experts"]
