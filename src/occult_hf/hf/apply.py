"""Putting `OccultMoE` into a transformers model and taking it out; the loading hook.

- `apply_occult(model, occult_config, group=None)` replaces every MoE block of a loaded model (one
  model instance; nothing in transformers' classes changes) and `unapply_occult(model)` puts the
  original blocks back with their (trained) weights. The set-up it shares with transformers' own EP
  (`hf.native_ep.apply_occult_ep`) is `hf.setup`.
- `install()` / `uninstall()` make `AutoModelForCausalLM.from_pretrained(..., occult_config=...)`
  work and re-apply the setup stored in a checkpoint's config (the wrappers of transformers'
  classmethods live in `hf.compat`), and hook the Trainer's checkpoint save and resume
  (`hf.trainer`).
- On the replaced model, per instance: `save_pretrained` is `hf.checkpointing.save_pretrained` (a
  vanilla checkpoint plus `occult_placement.json`, gathered from the EP ranks) and pushes to the Hub
  through `hf.hub` (`_upload_modified_files` too, so that `push_to_hub` uploads what a save writes); under EP `generate`
  always runs with `synced_gpus=True`, so ranks that finish early keep stepping (their forwards take
  part in the all-to-alls) until every rank is done.

Training under EP (the EP group is the data-parallel group): expert parameters and the runtime's
buffers are listed in `model._ddp_params_and_buffers_to_ignore`, so DDP neither broadcasts nor
all-reduces them; `LocalExperts` scales expert gradients by 1/D; and every `OccultMoE` owns a
one-element `ep_grad_norm_carrier` parameter whose gradient, set at the end of each backward, is the
norm of the other ranks' expert gradients of that layer. With it, any per-rank
`clip_grad_norm_(model.parameters())` (HF Trainer's included) computes the global 2-norm and every
rank applies the same clipping factor.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
from torch import nn

from occult_hf.patches import adapter_for

from ..config import OccultConfig, stored_occult_config
from ..dispatch import ExpertParallelGroup
from ..dispatch.group import resolve_devices_per_node
from ..distributed.agreement import JOIN_TIMEOUT_ENV, arrive, effective_setup, join_timeout_s, save_timeout_s
from ..distributed.collectives import GradNormCarrier
from ..placement import Placement
from ..utils.logging import get_logger
from .blocks import LOADED_EXPERTS_ATTR, build_occult_block, check_experts_resident, restore_block, retire_original_block
from .checkpointing import check_model_ranks_agree, gather_full_experts, new_save_group
from .compat import PUSH_UPLOAD_METHOD, UNSET, cache_need, install_loading_hooks, loading_hooks_installed, uninstall_loading_hooks, with_max_cache_len
from .ddp import DDP_IGNORE_ATTR, RankLocalStateNames
from .hub import save_and_push, upload_described
from .launch import check_logical_devices, check_process_group_started
from .loading import load_scope
from .native_ep import apply_on_load, ep_blocks
from .peft_support import install_peft_hooks, uninstall_peft_hooks
from .setup import agree, build_pruners, resolve_config, resolve_placement
from .state import (
    BLOCKS, STATE_ATTR, OccultState, attach_state, config_without_setup, detach_state, forget_saved_description, state_of,
)
from .trainer import install_trainer_hooks, uninstall_trainer_hooks
from .weight_init import install_expert_init

logger = get_logger(__name__)


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
    if group is None:
        check_process_group_started()  # torchrun/accelerate started several processes: each must be a rank
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} already has occult_hf applied; call unapply_occult(model) first")
    process_group = ExpertParallelGroup.process_group(group)
    (config, adapter, blocks, ep), agreement_group = agree(
        "apply_occult",
        lambda: _resolve(model, occult_config, group),
        process_group,
        lambda: new_save_group(process_group),
        lambda resolved: effective_setup(resolved[0], _paths(resolved[2]), _first_expert_weight(resolved[2][0][2]), model.config, model),
    )
    state = OccultState(occult_config=config, ep=ep, block_paths=_paths(blocks), front_end=BLOCKS)
    if ep.is_distributed:
        # the dispatchers' host-to-host agreements run on the same group (in program order on every rank)
        state.ep = ep = replace(ep, host_group=agreement_group)
        state.agreement_group, state.save_timeout_s = agreement_group, save_timeout_s()
    state.ep = ep = ep.with_node_groups(config.devices_per_node)  # several nodes: the hierarchical exchange's groups
    top_k = adapter.top_k(model.config)
    rank = ep.rank if ep.is_distributed else None
    layouts = [config.placement.layout(layer, rank) for layer, _, _ in blocks]
    pruners, state.pruning_profile = build_pruners(config, adapter, model, layouts, top_k)
    grad_norm = GradNormCarrier(ep.group) if ep.is_distributed else None  # one all-reduce per backward
    modules = [  # every block built before any is swapped in: a layer that fails leaves the model as it was
        build_occult_block(block, adapter, layout, config, ep, top_k=top_k, pruner=pruner, grad_norm=grad_norm)
        for (_, _, block), layout, pruner in zip(blocks, layouts, pruners)
    ]
    for (_, path, _), module in zip(blocks, modules):
        _set_submodule(model, path, module)
        retire_original_block(module)

    if ep.is_distributed:
        state.ddp_ignore_before = getattr(model, DDP_IGNORE_ATTR, None)
        # computed when DDP reads it, so that a later wrapper (plain peft.get_peft_model) is covered too
        setattr(model, DDP_IGNORE_ATTR, RankLocalStateNames(model, state.ddp_ignore_before))
        state.instance_methods["generate"] = _generate_in_lockstep
    state.instance_methods["save_pretrained"] = save_and_push
    state.instance_methods[PUSH_UPLOAD_METHOD] = upload_described
    install_expert_init(model, state)
    attach_state(model, state)
    return model


def _resolve(model: nn.Module, occult_config, group):
    """This rank's own checks of `apply_occult`: `(config resolved, adapter, blocks, ep)`; the resolved config holds
    the `Placement` and the device count."""
    config = resolve_config(occult_config)
    adapter = adapter_for(model)
    blocks = list(adapter.iter_moe_blocks(model))
    if not blocks:
        raise ValueError(
            f"found no MoE block ({', '.join(adapter.block_class_names)}) in {type(model).__name__}; "
            f"is it already replaced or a model without routed experts?"
        )
    check_experts_resident(adapter, blocks)
    placement = Placement.from_setting(config.placement)
    ep = ExpertParallelGroup.resolve(group, config.num_devices)
    if not ep.is_distributed and config.num_devices is None and placement is not None:
        ep = ExpertParallelGroup(num_devices=placement.num_devices)  # one process: the placement's logical devices
    if not ep.is_distributed:  # a launcher that ran fewer processes than devices: an error unless asked for
        check_logical_devices(ep.num_devices, config.logical_devices)
    layers = [layer for layer, _, _ in blocks]
    placement = resolve_placement(placement, adapter.num_experts(model.config), ep.num_devices, layers)
    per_node = resolve_devices_per_node(config.devices_per_node, ep.num_devices, ep.is_distributed, placement.devices_per_node, ep.global_ranks)
    return replace(config, placement=placement, num_devices=ep.num_devices, devices_per_node=per_node), adapter, blocks, ep


def unapply_occult(model: nn.Module) -> nn.Module:
    """Put the original MoE blocks back, with the current expert weights of all ranks; return `model`.

    Under EP every rank must call it (the experts are all-gathered: every rank gets the full model). Each layer's
    gather fills its original block (held aside, one layer's gather on the host at a time), and the blocks go back
    into the model only once every layer's has: a gather that fails (a peer dies or stalls) leaves the model as it
    was, its filled blocks emptied again.
    """
    state = state_of(model, BLOCKS)
    check_model_ranks_agree(model, state, "unapply_occult")
    modules = {path: model.get_submodule(path) for path in state.block_paths}
    filled = []
    try:
        for module in modules.values():
            filled.append(module)
            restore_block(module, *gather_full_experts(module, state, to_all=True))
    except BaseException:
        for module in filled:
            retire_original_block(module)
        raise
    for path, module in modules.items():
        _set_submodule(model, path, module.original_block)
    detach_state(model)
    if state.ep.is_distributed:
        if state.ddp_ignore_before is None:
            model.__dict__.pop(DDP_IGNORE_ATTR, None)
        else:
            setattr(model, DDP_IGNORE_ATTR, state.ddp_ignore_before)
    return model


def occult_modules(model: nn.Module) -> dict:
    """`{module path: occult layer}` of a model with occult_hf applied, in layer order: the `OccultMoE` that
    `apply_occult` put in place of each MoE block, or, in a model loaded with transformers' EP
    (`ep_implementation="occult"`), the `OccultEP` that serves each block's experts. Both keep the counters that
    `reset_counters` zeroes and the `track` setting of `track_routing`."""
    state = state_of(model)
    if state.front_end == BLOCKS:
        return {path: model.get_submodule(path) for path in state.block_paths}
    return {path: impl for _, path, _, impl in ep_blocks(model)}


def occult_config_of(model: nn.Module) -> OccultConfig:
    """The resolved `OccultConfig` of a model with occult_hf applied (placement as a `Placement`, num_devices set)."""
    return state_of(model).occult_config


def reset_counters(model: nn.Module) -> None:
    """Zero every occult layer's rows/pairs/bytes counters (`occult_modules`)."""
    for module in occult_modules(model).values():
        module.stats.reset()


class track_routing:
    """Whether every occult layer (`occult_modules`) keeps its last routing and adds to its counters in each forward
    (on by default). Serving needs neither: off, a compiled decode step has one graph output, one kernel and a few
    guards per layer fewer (on an H200, about 0.09 ms of guards and graph launch a step for OLMoE:
    docs/runtime.md, "Counters").

    Applies at once, like `torch.set_grad_enabled`; as a context manager it also gives every block back the
    setting it had before (`with track_routing(model, False): model.generate(...)`). A compiled model traces
    again the first time it runs with the other setting (the setting is a constant of the graph)."""

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self._before = {}
        for module in occult_modules(model).values():
            self._before[module] = module.track
            module.track = bool(enabled)

    def __enter__(self) -> "track_routing":
        return self

    def __exit__(self, *exc_info) -> None:
        for module, tracked in self._before.items():
            module.track = tracked


def _paths(blocks) -> list[str]:
    return [path for _, path, _ in blocks]


def _first_expert_weight(block: nn.Module) -> torch.Tensor:
    """A routed-expert weight of `block` (its dtype and device are part of the setup the ranks compare): the one read
    for this rank at load when the block's own are still on the meta device."""
    loaded = block.__dict__.get(LOADED_EXPERTS_ATTR)
    return loaded[1] if loaded is not None else next(getattr(block, "experts", block).parameters())


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


# ----- install --------------------------------------------------------------------------------


def install() -> None:
    """Let `PreTrainedModel.from_pretrained` take `occult_config=` and restore saved occult setups.

    Idempotent; `uninstall()` puts the original classmethods back. Loading a checkpoint whose config
    holds `occult_config` applies it (pass `occult_config=None` to load the vanilla model). The
    wrappers and why they are needed: `hf.compat.install_loading_hooks`. The Trainer's
    checkpoint save and resume under EP are hooked too (`hf.trainer.install_trainer_hooks`), and peft's
    `PeftModel.save_pretrained` / `load_adapter` once peft is imported (`hf.peft_support.install_peft_hooks`).
    """
    if is_installed():
        return
    install_loading_hooks(_apply_on_load, _json_native, config_without_setup, load_scope)
    install_trainer_hooks()  # Trainer checkpoints and resume under EP
    install_peft_hooks()  # adapters saved and loaded whole under EP


def uninstall() -> None:
    """Undo `install()` (no-op when not installed)."""
    uninstall_peft_hooks()
    uninstall_trainer_hooks()
    uninstall_loading_hooks()


def is_installed() -> bool:
    return loading_hooks_installed()


def _json_native(occult_config, stored=None):
    """What the config stores for an `occult_config=` keyword that the Auto classes hand to a checkpoint's config
    holding `stored` (transformers JSON-dumps the config in a log line at any verbosity): `_as_json` of it. Not
    checked here: `hf.loading.load_scope` checks it where a failure reaches the other ranks."""
    occult_config = _as_json(occult_config)
    _note_override(stored, occult_config)
    return occult_config


def _as_json(value):
    """`value` with every `OccultConfig` and `Placement` in it as its dict and every path as a string."""
    if isinstance(value, (OccultConfig, Placement)):
        return value.to_dict()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


def _note_override(stored, given) -> None:
    """Say when a given `occult_config` (`_as_json` of it) replaces the one the checkpoint stores: whole, not merged (a
    stored pruning the given one leaves out is off), as transformers says for a given `quantization_config`."""
    if stored is None or given is None or given is UNSET or stored == given:
        return
    logger.warning(
        "occult_hf: from_pretrained(occult_config=...) replaces the occult_config the checkpoint stores, whole (no "
        "setting of it is kept); stored: %s",
        {name: value for name, value in stored.items() if name != "placement"} if isinstance(stored, dict) else stored,
    )


def _apply_on_load(model, occult_config, subfolder: str = ""):
    """Apply `occult_config`, else the config's stored `occult_config` (AutoModel passes a keyword that
    names an existing config attribute to the config, so both routes end here): through `apply_occult`,
    or, for a model whose experts transformers' own EP sharded, `hf.native_ep.apply_on_load`."""
    if occult_config is UNSET:
        occult_config = stored_occult_config(model.config, subfolder)  # strict, relative paths against the checkpoint
    else:
        _note_override(getattr(model.config, "occult_config", None), _as_json(occult_config))
    if occult_config is None:
        forget_saved_description(model.config)
        return model
    configured = apply_on_load(model, occult_config)
    return apply_occult(model, occult_config) if configured is None else configured


# ----- generate ---------------------------------------------------------------------------------


@contextlib.contextmanager
def lockstep_managed_by_caller(model: nn.Module):
    """Within the block, `model.generate` is transformers' own, without the forced `synced_gpus=True`.

    For callers that keep the EP ranks in step themselves (the lm-eval hook votes before every forward
    and pads ranks that run out of work): `synced_gpus`'s per-step all-reduce would interleave with the
    caller's own collectives.
    """
    state = state_of(model)
    previous, state.caller_keeps_lockstep = state.caller_keeps_lockstep, True
    try:
        yield model
    finally:
        state.caller_keeps_lockstep = previous


def _generate_in_lockstep(model, *args, **kwargs):
    """`generate` with `synced_gpus=True`: every forward of an EP model is a collective.

    The ranks meet first (a bounded wait, `OCCULT_JOIN_TIMEOUT_S`), so a `generate` that some rank does not call fails
    naming it instead of waiting in the first exchange. A rank that is done keeps stepping until every rank is, so
    each rank's cache must hold the longest prompt plus the most new tokens of any rank: transformers sizes a static
    cache it allocates to that (`max_cache_len`, which also gives every rank the same shapes), and a fixed-size cache
    passed in that is shorter is an error on every rank. Assisted decoding (`assistant_model=`) is refused:
    transformers' own `synced_gpus` handling of it fails once ranks finish at different steps.
    """
    state = state_of(model)
    if state.caller_keeps_lockstep:
        return type(model).generate(model, *args, **kwargs)
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            "generate(assistant_model=...) under expert parallelism: transformers' assisted decoding with synced_gpus "
            "(every rank steps until the last is done) fails once the ranks finish at different steps; use greedy, "
            "sampling, beam search or prompt_lookup_num_tokens"
        )
    if kwargs.get("synced_gpus") is False:
        logger.warning("occult_hf: generate(synced_gpus=False) would hang under expert parallelism; using True")
    kwargs["synced_gpus"] = True
    own = cache_need(model, args, kwargs)
    needs = list(arrive(state.agreement_group, "generate", join_timeout_s(), JOIN_TIMEOUT_ENV, own, advice=GENERATE_ADVICE).values())
    longest = max(n["prompt"] for n in needs) + max(n["new_tokens"] for n in needs) - 1
    short = [n["capacity"] for n in needs if 0 < n["capacity"] < longest]
    if short:
        raise ValueError(
            f"generate under expert parallelism: a cache passed as past_key_values holds {min(short)} positions, but the "
            f"ranks decode in lockstep until the last is done: {longest} (the longest prompt plus the most new tokens of "
            f"any rank, less one); pass caches of at least {longest} on every rank"
        )
    if own["allocates"]:
        args, kwargs = with_max_cache_len(args, kwargs, max(longest, *(n["at_least"] for n in needs)))
    return type(model).generate(model, *args, **kwargs)


#: what a `generate` some EP rank did not join should say
GENERATE_ADVICE = (
    "Under expert parallelism generate is collective, like every forward: call it on every rank (each with its own "
    "prompts), the same number of times"
)


__all__ = [
    "apply_occult",
    "unapply_occult",
    "occult_modules",
    "occult_config_of",
    "reset_counters",
    "track_routing",
    "install",
    "uninstall",
    "is_installed",
    "lockstep_managed_by_caller",
]
