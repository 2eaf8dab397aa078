"""Occult inside transformers' own expert parallelism: `DistributedConfig(ep_implementation="occult")`.

Shape legend (docs/conventions.md): T tokens on this rank, H hidden, E routed experts, L = E / D experts per
rank, D ranks of the EP mesh dimension, k experts per token, R received rows, N (row, local expert) pairs.

Since 5.23, transformers shards a MoE model's routed experts whole over the `ep` dimension of its
device mesh (`Shard(0)`: rank r holds stored experts `[r * L, (r + 1) * L)`), composes that with
FSDP2 (`fsdp_size`), data-parallel replicas (`dp_replicate_size`) and its Trainer, and lets an
`EPImplementation`, named by `DistributedConfig.ep_implementation` in `EPImplementationInterface`,
bring each experts module its tokens. Importing occult_hf registers `OccultEP` there as "occult"
(`register_ep_implementation`, a no-op on transformers < 5.23, where the registry does not exist):

- one row per (token, destination rank), the rank's local experts' outputs summed before the return
  trip: the project's own dispatcher (`occult_hf.dispatch`, `OccultConfig.dispatcher`) and expert
  kernels (`occult_hf.experts.local_experts`), the same code as the `occult_config` path, on the
  rank's local slice of transformers' expert parameters;
- gradients of the tokens, the routing weights and the expert weights come back through the
  dispatcher's reverse exchange; transformers' FSDP2 then reduces and scales the expert gradients
  exactly as it does for its own "all_to_all".

**Placement.** An equal-capacity co-activation placement is a permutation of the expert ids.
`apply_occult_ep(model, occult_config)` (what `from_pretrained(..., distributed_config=...,
occult_config=...)` calls) stores the experts in placement order, so that transformers' contiguous
`Shard(0)` gives rank d exactly the experts the placement puts on device d: the rows move between the
EP ranks in one all-to-all per expert tensor (each rank holds its own share plus, briefly, the share
it receives; never the full layer). The routers are not touched: the ids they return are the
original ones, and `OccultEP` maps them through the placement (`device_of_E`, `local_index_E`),
which keeps group-limited routers exact (DeepSeek-V3 chooses among contiguous groups of expert ids:
permuting the router's rows would change which experts form a group) and keeps `router_logits`, the
auxiliary loss and routing profiles in original expert order. `save_pretrained` restores the
original order on the gathered state dict, so checkpoints stay vanilla. Collaboration pruning
(`OccultConfig.prune`) acts on the router's output through the family adapter (a forward hook on the
router module, removed by `remove_occult_ep`). Placements with unequal capacities or replicated
experts need the `occult_config` path, which serves them; here they are a clear error.

**Nodes.** `apply_occult_ep` resolves the EP group's node layout as `apply_occult` does
(`dispatch.group.resolve_devices_per_node`: `OccultConfig.devices_per_node`, the launch's `$LOCAL_WORLD_SIZE` applied to
the `ep` dimension's global ranks, the placement's layout) and makes its node and rail subgroups once for every layer
(`ExpertParallelGroup.with_node_groups`, every EP group's on every rank), so that "auto" takes the hierarchical
exchange across nodes and node-limited pruning knows the nodes. A model never configured runs the mesh's group flat.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from occult_hf.patches import RouterOutput, adapter_for

from .checkpointing import (
    STAGING_PREFIX, add_pruning_files, new_save_group, publish_staged, record_running_limits, weight_files,
)
from .compat import PUSH_UPLOAD_METHOD
from .hub import upload_described, writes_files
from ..config import OccultConfig
from ..dispatch import DispatchSettings, ExpertParallelGroup, TokenDispatcher, TokenRouting, build_dispatcher
from ..dispatch.group import resolve_devices_per_node
from ..distributed.agreement import (
    JOIN_TIMEOUT_ENV, SAVE_TIMEOUT_ENV, EPPeerError, announce_failure, arrive, effective_setup, is_peer_failure,
    join_timeout_s, peer_error, save_timeout_s,
)
from ..experts import local_experts
from ..placement import Placement
from ..layout import LayerLayout
from ..stats import ExchangeStats
from ..utils.atomic import atomic_write_json
from ..utils.strict_json import read_json_file
from .setup import agree, build_pruners, resolve_config, resolve_placement
from .state import STATE_ATTR, TRANSFORMERS_EP, OccultState, attach_state, detach_state, state_of

#: the name under which `OccultEP` is registered in transformers' `EPImplementationInterface`
EP_IMPLEMENTATION_NAME = "occult"
#: the first transformers release with `EPImplementationInterface`
MIN_TRANSFORMERS_VERSION = "5.23"

_EP_ATTR = "_occult_ep"
_OTHER_PATH = (
    "use the occult_config path instead: from_pretrained(..., occult_config=OccultConfig(...)) without "
    "distributed_config (occult_hf's own EP group over torch.distributed)"
)


@functools.lru_cache(maxsize=1)
def transformers_ep_available() -> bool:
    """Whether the installed transformers has the expert-parallel registry (`EPImplementationInterface`, >= 5.23)."""
    try:
        from transformers.distributed import expert_parallel
    except ImportError:
        return False
    return all(hasattr(expert_parallel, name) for name in ("EPImplementation", "EPImplementationInterface"))


def _ep_base() -> type:
    if transformers_ep_available():
        from transformers.distributed.expert_parallel import EPImplementation

        return EPImplementation
    return object


class OccultEP(_ep_base()):
    """Occult's dispatch as a transformers `EPImplementation` (one instance per experts module).

    transformers calls it with `(hidden_states [T, H], top_k_index [T, k] int64 original expert ids,
    top_k_weights [T, k])`, this rank's batch, inside a context where the experts module's parameters
    are this rank's local `[L, 2I, H]` / `[L, H, I]` slices; it returns `[T, H]`, each token's weighted
    sum over its k experts. With tensor parallelism (`tp_size > 1`) the ranks of a TP group hold the same
    batch: each dispatches a disjoint row slice of it and the outputs are gathered over the group, as
    transformers' `AllToAllEP` does. Until `apply_occult_ep` configures it, it runs the contiguous placement
    with `OccultConfig()`'s defaults (dedup dispatch).

    Attributes:
        mesh_ep: the EP mesh dimension as occult_hf's `ExpertParallelGroup` (one node as far as it knows).
        ep: the group the dispatcher runs over: `mesh_ep`, with its node layout and subgroups once `apply_occult_ep`
            has resolved one (the hierarchical exchange where the group spans nodes).
        num_experts: `E`.
        layout: the layer's `LayerLayout` for this rank (rank d holds the experts the placement puts on device
            d, stored in the expert dimension in slot order: transformers' contiguous `Shard(0)`).
        occult_config: the settings it runs with.
        dispatcher: the `TokenDispatcher`, built by the first forward on the batch's device (and again after
            the placement, the settings or the device change).
        stats: the layer's `ExchangeStats` (rows and (token, expert) pairs this rank sent to each rank).
        last_topk_ids_Tk: `[T, k]` the routing the last call dispatched (after pruning; this rank's TP slice), what
            `OccultCallback`'s meters read, as they read `OccultMoE`'s (a reference, no copy); `last_devices_TD` is
            always None (no replicas on this path).
        track: whether each call keeps `last_topk_ids_Tk` and adds to `stats` (`track_routing`), as in `OccultMoE`.
    """

    track = True
    last_devices_TD = None

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh) -> None:
        if not transformers_ep_available():
            raise ImportError(
                f"ep_implementation={EP_IMPLEMENTATION_NAME!r} needs transformers >= {MIN_TRANSFORMERS_VERSION} "
                f"(EPImplementationInterface); {_OTHER_PATH}"
            )
        super().__init__(experts, ep_mesh, tp_mesh)
        _check_fused_layout(experts)
        self._experts = (experts,)  # a tuple: no module registration, no reference from an nn.Module tree
        self.mesh_ep = ExpertParallelGroup(num_devices=ep_mesh.size(), group=ep_mesh.get_group(), rank=ep_mesh.get_local_rank())
        self.num_experts = self.num_local_experts * self.mesh_ep.num_devices
        self.compute = ShardExperts(experts)
        # transformers builds this on the meta device, before the weights load: the dispatcher and the
        # statistics are made on the device of the first batch (and again if the model moves)
        self.dispatcher: TokenDispatcher | None = None
        self.stats = ExchangeStats(self.mesh_ep.num_devices)
        self.last_topk_ids_Tk: torch.Tensor | None = None
        contiguous = Placement.contiguous(self.num_experts, self.mesh_ep.num_devices, [0]).layout(0, self.mesh_ep.rank)
        self.configure(OccultConfig(), contiguous, None)
        setattr(experts, _EP_ATTR, self)  # how `apply_occult_ep` finds the instance transformers built

    @property
    def experts(self) -> nn.Module:
        return self._experts[0]

    @property
    def training(self) -> bool:
        """Whether the experts module is in training mode (the meters count training forwards only)."""
        return self.experts.training

    @property
    def expert_order(self) -> list[int]:
        """`[E]` the expert id stored at each position of the sharded expert dimension (`stored_order`)."""
        return stored_order(self.layout, self.num_local_experts)

    def configure(
        self, occult_config: OccultConfig, layout: LayerLayout, label: str | None = "experts", ep: ExpertParallelGroup | None = None
    ) -> None:
        """Run with these settings and this layout (the weights must already be stored in its order), over `ep`: the
        mesh's EP group with its node layout and subgroups (`ExpertParallelGroup.with_node_groups`), None: `mesh_ep`."""
        self.occult_config, self.layout, self._label = occult_config, layout, label
        self.ep = self.mesh_ep if ep is None else ep
        self.compute.backend, self.compute.deterministic = occult_config.expert_backend, occult_config.deterministic
        self.dispatcher = None  # rebuilt by the next forward

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        device = hidden_states.device
        if self.dispatcher is None or self.stats.sent_D2.device != device:
            settings = DispatchSettings.of(self.occult_config, top_k_index.shape[1])
            self.dispatcher = build_dispatcher(settings, self.ep, self.layout, device, label=self._label)
            self.stats.to(device)
        num_tokens, hidden = hidden_states.shape
        sliced = self.tp_mesh.size() > 1
        if sliced:  # the TP group shares the batch: each of its ranks dispatches a disjoint slice of it
            hidden_states, top_k_index, top_k_weights = (_tp_slice(t, self.tp_mesh) for t in (hidden_states, top_k_index, top_k_weights))
        if self.track:
            self.last_topk_ids_Tk = top_k_index.detach()
        out_TH, plan = self.dispatcher.run(hidden_states, TokenRouting(top_k_index, top_k_weights), self.compute)
        if sliced:
            out_TH = _tp_gather(out_TH, self.tp_mesh, num_tokens, hidden)
        if self.track:
            self.stats.record(plan.counts_D2, plan.row_bytes)
        return out_TH


class ShardExperts(nn.Module):
    """The local expert computation on transformers' experts module: `(x_RH, segments, pair_weight_N) -> out_RH`.

    Reads the module's `gate_up_proj` / `down_proj` / `act_fn` at call time: inside transformers'
    EP forward they are this rank's local slices (`[L, 2I, H]`, `[L, H, I]`), differentiable views of
    the sharded parameters, so the gradients reach transformers' (and FSDP2's) parameters. The
    dispatcher hands the weights to its autograd function as inputs (`parameters()`), which is how it
    knows to track the experts' graph when nothing else needs a gradient (frozen dense part).
    """

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self._experts = (experts,)  # not a child: its parameters are transformers' (and FSDP's), not ours
        self.backend = "auto"
        self.deterministic = False

    def parameters(self, recurse: bool = True):
        experts = self._experts[0]
        return iter((experts.gate_up_proj, experts.down_proj))

    def forward(self, x_RH, segments, pair_weight_N):
        experts = self._experts[0]
        gate_up_L2IH, down_LHI = _local(experts.gate_up_proj), _local(experts.down_proj)
        return local_experts(
            x_RH, segments, pair_weight_N, gate_up_L2IH, down_LHI, experts.act_fn, self.backend, self.deterministic
        )


def _tp_slice(tensor: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This rank's row slice of a tensor the TP group holds whole (`Replicate -> Shard(0)`: a local chunk,
    whose backward all-gathers the row gradients), as transformers' `AllToAllEP` slices it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()


def _tp_gather(out_TH: torch.Tensor, tp_mesh, num_tokens: int, hidden: int) -> torch.Tensor:
    """`[num_tokens, H]` on every rank of the TP group from each rank's `[T, H]` slice (`Shard(0) -> Replicate`)."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = DTensor.from_local(out_TH.contiguous(), tp_mesh, [Shard(0)], shape=(num_tokens, hidden), stride=(hidden, 1))
    return sharded.full_tensor()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a plain tensor as it is)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _check_fused_layout(experts: nn.Module) -> None:
    """The transformers 5 fused-experts layout the Occult kernels compute (gate rows first, no biases)."""
    missing = [name for name in ("gate_up_proj", "down_proj", "act_fn") if not hasattr(experts, name)]
    if missing or getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        raise NotImplementedError(
            f"ep_implementation={EP_IMPLEMENTATION_NAME!r} computes fused experts (gate_up_proj [E, 2I, H], down_proj "
            f"[E, H, I], no biases); {type(experts).__name__} differs ({', '.join(missing) or 'transposed or biased'}): "
            f"use ep_implementation='all_to_all' for this model"
        )


# ----- registration ------------------------------------------------------------------------------


def register_ep_implementation() -> bool:
    """Register `OccultEP` as "occult" in transformers' `EPImplementationInterface`; False (nothing done)
    on transformers < 5.23. Idempotent; refuses to replace a different implementation of that name."""
    if not transformers_ep_available():
        return False
    from transformers.distributed.expert_parallel import EPImplementationInterface

    current = EPImplementationInterface._global_mapping.get(EP_IMPLEMENTATION_NAME)
    if current is not None and current is not OccultEP:
        raise ValueError(
            f"transformers' EPImplementationInterface already has an implementation named {EP_IMPLEMENTATION_NAME!r} "
            f"({current.__module__}.{current.__qualname__}); occult_hf will not replace it"
        )
    EPImplementationInterface.register(EP_IMPLEMENTATION_NAME, OccultEP)
    return True


# ----- configuring a loaded model ------------------------------------------------------------------


def uses_occult_ep(model: nn.Module) -> bool:
    """Whether transformers built `OccultEP` for `model`'s experts (`DistributedConfig(ep_implementation="occult")`)."""
    return any(isinstance(getattr(m, _EP_ATTR, None), OccultEP) for m in model.modules())


def occult_ep_layers(model: nn.Module) -> dict[int, OccultEP]:
    """`{decoder layer: OccultEP}` of a model loaded with `ep_implementation="occult"`, in layer order."""
    return {layer: impl for layer, _, _, impl in ep_blocks(model)}


def ep_blocks(model: nn.Module) -> list[tuple[int, str, nn.Module, OccultEP]]:
    """`(decoder layer, module path, MoE block, its OccultEP)` of every MoE block of a model loaded with
    `ep_implementation="occult"`, in layer order; an error naming the block that another implementation serves."""
    adapter = adapter_for(model)
    blocks = []
    for layer, path, block in adapter.iter_moe_blocks(model):
        impl = getattr(adapter.experts_module(block), _EP_ATTR, None)
        if not isinstance(impl, OccultEP):
            raise ValueError(
                f"{path}.experts is not served by ep_implementation={EP_IMPLEMENTATION_NAME!r}: load the model with "
                f"from_pretrained(..., distributed_config=DistributedConfig(ep_size=D, fsdp_size=D, "
                f"ep_implementation={EP_IMPLEMENTATION_NAME!r}))"
            )
        blocks.append((layer, path, block, impl))
    if not blocks:
        raise ValueError(f"found no MoE block in {type(model).__name__}")
    return blocks


def _resolve(model: nn.Module, occult_config):
    """This rank's own checks of `apply_occult_ep`: `(config resolved, blocks)`; the resolved config holds the
    `Placement` and the device count."""
    config = resolve_config(occult_config)
    blocks = ep_blocks(model)
    first = blocks[0][3]
    ep, num_experts, per_rank = first.mesh_ep, first.num_experts, first.num_local_experts
    if config.num_devices not in (None, ep.num_devices):
        raise ValueError(
            f"OccultConfig.num_devices ({config.num_devices}) must equal DistributedConfig.ep_size ({ep.num_devices}); "
            f"a checkpoint saved by occult_hf holds the occult_config it ran with, which from_pretrained applies: pass "
            f"occult_config=OccultConfig(...) to load it at another ep_size, or occult_config=None"
        )
    layers = [layer for layer, _, _, _ in blocks]
    placement = resolve_placement(Placement.from_setting(config.placement), num_experts, ep.num_devices, layers)
    _check_equal_capacities(placement, layers, per_rank)
    per_node = resolve_devices_per_node(config.devices_per_node, ep.num_devices, ep.is_distributed, placement.devices_per_node, ep.global_ranks)
    return replace(config, placement=placement, num_devices=ep.num_devices, devices_per_node=per_node), blocks


def apply_occult_ep(model: nn.Module, occult_config: OccultConfig | dict | str | None = None) -> nn.Module:
    """Configure a model loaded with `DistributedConfig(ep_implementation="occult")`: placement, pruning,
    dispatch settings; return `model`. Collective: every rank of the world calls it with the same config
    (checked first: ranks that disagree all raise `EPConfigMismatchError`, naming the fields, and nothing
    changes).

    The placement (`OccultConfig.placement`) must give every device `E / D` experts in every layer and
    no replicas. The expert weights are moved between the EP ranks into placement order (one
    all-to-all per expert tensor and layer); calling it again with another placement moves them again.
    `save_pretrained` writes them in original order.
    """
    state = getattr(model, STATE_ATTR, None)
    if state is not None and state.front_end != TRANSFORMERS_EP:
        raise ValueError(f"{type(model).__name__} already has occult_hf applied by apply_occult; it cannot also run inside transformers' EP")
    # one gloo group of the world for every configuration check of this model: made at the first call
    group = state.agreement_group if state is not None else None
    (config, blocks), group = agree(
        "apply_occult_ep",
        lambda: _resolve(model, occult_config),
        dist.group.WORLD if dist.is_available() and dist.is_initialized() else None,
        lambda: group or new_save_group(dist.group.WORLD, "apply_occult_ep"),
        lambda resolved: effective_setup(
            resolved[0], [path for _, path, _, _ in resolved[1]], _local(resolved[1][0][3].experts.gate_up_proj),
            model.config, model,
        ),  # fmt: skip
    )
    ep = blocks[0][3].mesh_ep
    if config.devices_per_node is not None:  # several nodes: the hierarchical exchange's subgroups, shared by the layers
        ep = ep.with_node_groups(config.devices_per_node, _every_ep_group(ep, group))
    adapter, placement = adapter_for(model), config.placement
    layouts = [placement.layout(layer, ep.rank) for layer, _, _, _ in blocks]
    orders = [stored_order(layout, impl.num_local_experts) for layout, (_, _, _, impl) in zip(layouts, blocks)]
    if any(order != impl.expert_order for order, (_, _, _, impl) in zip(orders, blocks)):
        _check_rows_movable(model)
    pruners, pruning_profile = build_pruners(config, adapter, model, layouts, adapter.top_k(model.config))
    if state is not None:  # every check passed: replace the previous configuration
        detach_state(model)
    new_state = OccultState(
        occult_config=config, ep=ep, block_paths=[path for _, path, _, _ in blocks], front_end=TRANSFORMERS_EP,
        agreement_group=group, save_timeout_s=save_timeout_s(), pruning_profile=pruning_profile,
    )  # fmt: skip
    for (layer, _, block, impl), layout, order, pruner in zip(blocks, layouts, orders, pruners):
        if order != impl.expert_order:
            _move_expert_rows(impl, order)
        impl.configure(config, layout, f"layer {layer}", ep)
        if pruner is not None:  # on the block, as `OccultMoE.pruner`: where `pruning.pruners_of` finds it
            block.pruner = pruner
            new_state.module_attributes.append((block, "pruner"))
            new_state.hooks.append(adapter.router(block).register_forward_hook(_pruning_hook(block, pruner)))
    new_state.instance_methods["gather_sharded_state_dict_for_save"] = _gather_in_original_order
    new_state.instance_methods["save_pretrained"] = _save_described
    new_state.instance_methods[PUSH_UPLOAD_METHOD] = upload_described
    attach_state(model, new_state)
    return model


def _every_ep_group(ep: ExpertParallelGroup, group) -> list[tuple[int, ...]]:
    """The global ranks of every EP group of the world (transformers' mesh has one per data-parallel replica and
    pipeline stage), in the same order on every rank: collective over `group`, a group of the whole world."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, ep.global_ranks, group=group)
    return sorted(set(gathered))


def apply_on_load(model: nn.Module, occult_config) -> nn.Module | None:
    """`from_pretrained(..., occult_config=...)` on a model that transformers' own EP sharded: configure
    `ep_implementation="occult"` (returns the model), refuse another EP implementation with an error
    that says what to do, or None when transformers did not shard the experts (the `occult_config`
    path applies)."""
    if uses_occult_ep(model):
        return apply_occult_ep(model, occult_config)
    distributed_config = getattr(model.config, "distributed_config", None)
    if getattr(distributed_config, "ep_size", 1) > 1:
        raise ValueError(
            f"occult_config with DistributedConfig(ep_size={distributed_config.ep_size}, "
            f"ep_implementation={distributed_config.ep_implementation!r}): set ep_implementation="
            f"{EP_IMPLEMENTATION_NAME!r} to run Occult inside transformers' expert parallelism, or pass "
            f"occult_config=None to load without Occult (a checkpoint saved with occult_hf stores its occult_config)"
        )
    return None


def remove_occult_ep(model: nn.Module) -> nn.Module:
    """Undo `apply_occult_ep`: experts back in original order (collective), no pruning, default settings."""
    state = getattr(model, STATE_ATTR, None)
    if state is None or state.front_end != TRANSFORMERS_EP:
        raise ValueError(f"{type(model).__name__} has no apply_occult_ep configuration to remove")
    detach_state(model)
    for layer, _, _, impl in ep_blocks(model):
        contiguous = Placement.contiguous(impl.num_experts, impl.ep.num_devices, [layer]).layout(layer, impl.ep.rank)
        order = stored_order(contiguous, impl.num_local_experts)
        if impl.expert_order != order:
            _move_expert_rows(impl, order)
        impl.configure(OccultConfig(), contiguous, f"layer {layer}")
    return model


def occult_ep_config_of(model: nn.Module) -> OccultConfig:
    """The resolved `OccultConfig` (placement as a `Placement`) of a model configured by `apply_occult_ep`."""
    return state_of(model, TRANSFORMERS_EP).occult_config


def stored_order(layout: LayerLayout, per_rank: int) -> list[int]:
    """`[E]` the expert id stored at each position of transformers' sharded expert dimension for `layout`: rank d
    holds positions `[d * per_rank, (d + 1) * per_rank)`, its slots in order."""
    order = [0] * layout.num_experts
    for expert, (device, slot) in enumerate(zip(layout.primary_devices(), layout.local_index_E.tolist())):
        order[device * per_rank + slot] = expert
    return order


def _check_equal_capacities(placement: Placement, layers: list[int], per_rank: int) -> None:
    """transformers' `Shard(0)` gives every rank `E / D` experts: only such placements (no replicas) fit."""
    if placement.has_replicas:
        raise ValueError(
            f"OccultConfig.placement replicates experts (layers {sorted(placement.replicas)}); "
            f"DistributedConfig(ep_implementation={EP_IMPLEMENTATION_NAME!r}) holds each expert once (transformers' "
            f"Shard(0)): plan without num_redundant_experts, or {_OTHER_PATH}"
        )
    for layer in layers:
        capacities = placement.capacities(layer)
        if any(c != per_rank for c in capacities):
            raise ValueError(
                f"OccultConfig.placement gives the devices {capacities} experts at layer {layer}; "
                f"DistributedConfig(ep_implementation={EP_IMPLEMENTATION_NAME!r}) shards experts evenly "
                f"(transformers' Shard(0): E/D = {per_rank} per rank): plan a placement with equal capacities, or "
                f"{_OTHER_PATH}, which serves any capacities"
            )


def _check_rows_movable(model: nn.Module) -> None:
    """Moving expert rows between EP ranks needs each EP rank to hold its whole `[L, ...]` share."""
    distributed_config = getattr(model.config, "distributed_config", None)
    efsdp = getattr(distributed_config, "efsdp_size", 1)
    if efsdp != 1:
        raise NotImplementedError(
            f"a non-contiguous OccultConfig.placement with DistributedConfig(fsdp_size * tp_size / ep_size = "
            f"efsdp_size = {efsdp}) is not supported: FSDP2 splits each rank's experts further; set ep_size = "
            f"fsdp_size * tp_size (dp_replicate_size for more data parallelism), use placement='contiguous', or {_OTHER_PATH}"
        )


@torch.no_grad()
def _move_expert_rows(impl: OccultEP, order: list[int], stored: list[int] | None = None) -> None:
    """Store the experts in `order` (stored position -> expert id) instead of `stored` (default: `impl.expert_order`),
    moving rows between the EP ranks: rank r sends each rank q the rows q needs from r's share, in one
    `all_to_all_single` per expert tensor. Collective over the EP group."""
    per_rank, rank, num_devices = impl.num_local_experts, impl.ep.rank, impl.ep.num_devices
    position_of = {e: p for p, e in enumerate(impl.expert_order if stored is None else stored)}
    send_rows, send_splits, recv_splits, recv_order = [], [], [], []
    for q in range(num_devices):  # what q needs from r, in q's slot order
        wanted = [position_of[e] for e in order[q * per_rank : (q + 1) * per_rank]]
        mine = [p - rank * per_rank for p in wanted if p // per_rank == rank]
        send_rows += mine
        send_splits.append(len(mine))
    wanted_here = [position_of[e] for e in order[rank * per_rank : (rank + 1) * per_rank]]
    for s in range(num_devices):  # what r receives from s, in r's slot order
        from_s = [slot for slot, p in enumerate(wanted_here) if p // per_rank == s]
        recv_order += from_s
        recv_splits.append(len(from_s))
    for name in ("gate_up_proj", "down_proj"):
        local = _local(getattr(impl.experts, name))
        send = local.reshape(per_rank, -1)[torch.tensor(send_rows, dtype=torch.int64, device=local.device)].contiguous()
        received = send.new_empty((per_rank, send.shape[1]))
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=impl.ep.group)
        del send
        local.view(per_rank, -1).index_copy_(0, torch.tensor(recv_order, dtype=torch.int64, device=local.device), received)


def _pruning_hook(block: nn.Module, pruner):
    """A forward hook on the router: its `(logits, weights, ids)` with the routing pruned to N_d devices
    (the logits unchanged, so `router_logits` capture and auxiliary losses see the router's own output)."""
    def hook(router, inputs, output):
        logits_TE, topk_weights_Tk, topk_ids_Tk = output
        pruned = pruner.route(block, RouterOutput(logits_TE=logits_TE, topk_weights_Tk=topk_weights_Tk, topk_ids_Tk=topk_ids_Tk))
        return logits_TE, pruned.topk_weights_Tk, pruned.topk_ids_Tk

    return hook


def _save_described(model, save_directory, *args, **kwargs):
    """transformers' `save_pretrained`, with the pruners' limits in force (`OccultCallback`'s N_d schedule changes them)
    on the config it writes first (every rank calls it, for FSDP2's gather, so every rank records them alike); then the
    writing rank adds a pruned model's files, as the `occult_config` path's save does: the similarity profile (its
    source file may be gone by then) and the pruning description (`checkpointing.add_pruning_files`).

    Every wait on a peer is bounded, as on the `occult_config` path: the ranks meet first (`OCCULT_JOIN_TIMEOUT_S`: a
    rank that never calls the save is named), transformers' gathers and its closing barrier run under `peer_waits_bounded`
    (`OCCULT_SAVE_TIMEOUT_S`), and the ranks return together once the writing rank is done (the same bound; a rank that
    failed is named at once), so a reload right after the save reads the same, whole files on every rank."""
    state = state_of(model, TRANSFORMERS_EP)
    together = state.agreement_group is not None
    if together:
        arrive(state.agreement_group, _SAVE_OPERATION, join_timeout_s(), JOIN_TIMEOUT_ENV)
    try:
        with peer_waits_bounded(_SAVE_GATHER, state.save_timeout_s):
            result = _save_with_transformers(model, state, save_directory, args, kwargs)
    except Exception as error:  # the other ranks meet below: tell them
        if together:
            with contextlib.suppress(EPPeerError):  # the store died with its host: this rank's own error says more
                announce_failure(error, _SAVE_WRITTEN, state.agreement_group)
        raise
    if together:
        arrive(state.agreement_group, _SAVE_WRITTEN, state.save_timeout_s, SAVE_TIMEOUT_ENV)
    return result


#: the operation a native-EP save names in its errors, and its ranks' meeting once the writing rank is done
_SAVE_OPERATION = "save_pretrained"
_SAVE_GATHER = "save_pretrained (transformers' gather of the sharded weights)"
_SAVE_WRITTEN = "save_pretrained's files"


def _save_with_transformers(model, state, save_directory, args, kwargs):
    """transformers' save as `_save_described` runs it: staged (`_save_staged`), or in place for a sharded
    `distributed_checkpoint` (experts stored in original order meanwhile) or a push to the Hub."""
    record_running_limits(model, state)
    writer = kwargs.get("is_main_process", True) and writes_files(state)
    sharded = kwargs.get("distributed_checkpoint")
    if not (sharded or kwargs.get("push_to_hub")):
        return _save_staged(model, state, os.fspath(save_directory), writer, args, kwargs)
    if sharded:
        _clear_earlier_weights(state, os.fspath(save_directory))
    with _stored_in_original_order(model) if sharded else contextlib.nullcontext():
        result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    if writer:
        add_pruning_files(state, os.fspath(save_directory), os.fspath(save_directory))
    return result


def _clear_earlier_weights(state, target: str) -> None:
    """Before a `distributed_checkpoint` save writes its rank shards into `target`, transformers' writer (global rank
    0) removes the weight files an earlier save left there, and the ranks wait for it: transformers' loader reads every
    `.safetensors` file of a directory that holds rank shards as one checkpoint (torch's `HuggingFaceStorageReader`), so
    an earlier plain save's `model.safetensors` (or its shards, of any variant) or the rank shards of a save at more
    ranks would load mixed with the new shards, without an error. A save that fails after this leaves in `target` the
    rank shards it wrote and none of the earlier weights."""
    if writes_files(state):
        for name in weight_files(target):
            os.remove(os.path.join(target, name))
    if state.agreement_group is not None:
        advice = f"transformers' writer (rank 0) did not clear the earlier weights of {target!r} in time"
        arrive(state.agreement_group, _SAVE_CLEARED, state.save_timeout_s, SAVE_TIMEOUT_ENV, advice=advice)


#: the ranks' meeting once the writer has removed the earlier weights from a distributed checkpoint's directory
_SAVE_CLEARED = "save_pretrained's removal of the earlier weights"


@contextlib.contextmanager
def peer_waits_bounded(operation: str, timeout_s: float):
    """Within the block every gloo collective of this rank's process groups times out after `timeout_s` (their own
    timeouts are restored after it), and the backend's timeout or lost-peer error becomes `EPPeerError` naming
    `operation`. transformers' save runs its gathers (FSDP2's full state dict, DCP) on the mesh's groups with plain
    blocking collectives, which no `async_op` wait can bound from here. NCCL groups keep their timeout: its
    watchdog tears the process down instead of raising."""
    saved = _gloo_timeouts()
    for backend, _ in saved:
        backend._set_default_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, EPPeerError) or not is_peer_failure(error):
            raise
        raise peer_error(operation, timeout_s, error) from error
    finally:
        for backend, timeout in saved:
            backend._set_default_timeout(timeout)


def _gloo_timeouts() -> list:
    """`(backend, its timeout)` of the gloo backend of every process group this rank belongs to (the job's,
    transformers' mesh's, occult_hf's), through torch's private registry of groups: none where a torch release lacks
    it (the save then waits as long as the groups' own timeouts allow, as it would without occult_hf)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    backends = {}
    try:
        for group in list(dist.distributed_c10d._world.pg_map):
            for device in group._device_types:
                backend = group._get_backend(device)
                if isinstance(backend, dist.ProcessGroupGloo) and hasattr(backend, "_set_default_timeout"):
                    backends[id(backend)] = (backend, backend.options._timeout)
    except AttributeError:
        return []
    return list(backends.values())


def _save_staged(model, state, target: str, writer: bool, args, kwargs):
    """transformers' save into a staging folder inside `target` (every rank joins its gather; the writer writes), then
    the writer publishes it as the `occult_config` path's save does (`checkpointing.publish_staged`): a process that
    dies or fails while writing leaves the earlier checkpoint in `target` whole, where transformers writing in place
    left truncated weights beside a new config. (Sharded `distributed_checkpoint` saves and pushes to the Hub write
    in place: every rank writes its own shard, and the push uploads the folder it wrote.)"""
    staging = os.path.join(target, _NATIVE_STAGING)
    if writer:
        os.makedirs(target, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # a save that died before
    try:
        result = type(model).save_pretrained(model, staging, *args, **kwargs)
        if writer:
            add_pruning_files(state, staging, target)
            publish_staged(staging, target)
    finally:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
    return result


#: the staging folder of a native-EP save inside its target (a dot-folder: no loader reads it)
_NATIVE_STAGING = STAGING_PREFIX + "native"


@contextlib.contextmanager
def _stored_in_original_order(model):
    """Within the block every layer's experts are stored in original expert order, then in the placement's again
    (rows moved between the ranks, in place, both ways): transformers' distributed checkpoint writes the shards as
    stored, and a load moves them from original order into the placement's, so a checkpoint of rows in placement
    order came back permuted twice."""
    moved = []
    try:
        for _, _, _, impl in ep_blocks(model):
            order, original = impl.expert_order, list(range(impl.num_experts))
            if order != original:
                _move_expert_rows(impl, original)
                moved.append((impl, order))
        yield
    finally:
        for impl, order in moved:
            _move_expert_rows(impl, order, stored=list(range(impl.num_experts)))


def _gather_in_original_order(model, model_to_save, state_dict, distributed_config, *, save_on_this_rank=True):
    """transformers' gather of the sharded state dict for `save_pretrained`, with every layer's experts put
    back in original expert order (so the checkpoint is vanilla)."""
    gathered = type(model).gather_sharded_state_dict_for_save(
        model, model_to_save, state_dict, distributed_config, save_on_this_rank=save_on_this_rank
    )
    prefix = _prefix_of(model, model_to_save)
    for _, path, _, impl in ep_blocks(model):
        order_E = torch.tensor(impl.expert_order, dtype=torch.int64)
        if torch.equal(order_E, torch.arange(order_E.numel())):
            continue
        original_E = torch.argsort(order_E)  # stored position of each original expert
        for name in ("gate_up_proj", "down_proj"):
            key = f"{prefix}{path}.experts.{name}"
            if key in gathered:
                value = gathered[key]
                gathered[key] = value.index_select(0, original_E.to(value.device))
    return gathered


# ----- resuming training ------------------------------------------------------------------------

#: written beside the optimizer state by `save_optimizer`: the stored expert order it was saved in
EXPERT_ORDER_FILE = "occult_expert_order.json"


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory) -> None:
    """Save `optimizer`'s state under `directory` for resuming (collective: every rank calls it).

    transformers 5.24's `Trainer` refuses to checkpoint the optimizer of a model sharded at load time
    (`DistributedConfig`: "Resuming is not supported ..."), so training on this path resumes from
    `model.save_pretrained(checkpoint)` (vanilla weights, the placement in `config.json`) plus this:
    transformers' own sharded optimizer save (`transformers.distributed.checkpoint.save_optimizer_distributed`,
    torch DCP, each rank its shard). The experts' optimizer state is saved as stored, in placement order;
    the order is written beside it (`occult_expert_order.json`, `{layer: [expert id at each stored
    position]}`) and `load_optimizer` checks it, so that state is never loaded into another placement.

    The state is written into `<directory>.occult-staging` and moved in place of `directory` only once every rank has
    written its shard: a rank that fails or dies while writing leaves an earlier save in `directory` whole, where DCP
    writing in place left one rank's new shard beside the others' old ones, which loaded as one state. `directory`
    is replaced whole, so it must hold nothing but an optimizer save.
    """
    from transformers.distributed.checkpoint import save_optimizer_distributed

    directory = os.path.normpath(os.fspath(directory))  # "opt/" would put the staging folder inside "opt"
    staging = f"{directory}.occult-staging"
    writer = not dist.is_initialized() or dist.get_rank() == 0
    _check_holds_only_an_optimizer_save(directory)  # on every rank: one that raised alone would leave the others waiting
    if writer:
        shutil.rmtree(staging, ignore_errors=True)  # a save that died before
    if dist.is_initialized():  # nobody writes into the staging folder before it is empty
        arrive(None, _OPTIMIZER_SAVE, join_timeout_s(), JOIN_TIMEOUT_ENV)
    reshard(model)
    with peer_waits_bounded(f"{_OPTIMIZER_SAVE} (torch DCP's save of the shards)", save_timeout_s()):
        save_optimizer_distributed(model, optimizer, staging)  # collective: it returns once every rank has written
    if writer:
        try:
            orders = {str(layer): impl.expert_order for layer, impl in occult_ep_layers(model).items()}
            atomic_write_json(os.path.join(staging, EXPERT_ORDER_FILE), orders)
            _replace_folder(staging, directory)
        except Exception as error:  # the other ranks wait below: tell them
            if dist.is_initialized():
                announce_failure(error, _OPTIMIZER_PUBLISHED)
            raise
    if dist.is_initialized():
        arrive(None, _OPTIMIZER_PUBLISHED, save_timeout_s(), SAVE_TIMEOUT_ENV)


#: the operation an optimizer save names in its errors, and its ranks' meeting once the writing rank has put it in place
_OPTIMIZER_SAVE = "save_optimizer"
_OPTIMIZER_PUBLISHED = "save_optimizer's folder"


def _check_holds_only_an_optimizer_save(directory: str) -> None:
    """`save_optimizer` replaces `directory` whole: refuse one that holds anything else (a checkpoint's own folder)."""
    if not os.path.isdir(directory):
        return
    other = sorted(n for n in os.listdir(directory) if not (n.endswith(".distcp") or n in (".metadata", EXPERT_ORDER_FILE)))
    if other:
        raise ValueError(
            f"save_optimizer replaces {directory!r} whole, and it holds other files ({', '.join(other[:5])}): "
            f"give the optimizer state a folder of its own (e.g. os.path.join(checkpoint, 'optimizer'))"
        )


def _replace_folder(staging: str, directory: str) -> None:
    """Put the complete save `staging` in place of `directory`: the old folder is moved aside, the new one renamed in,
    the old one removed (an interruption in between leaves it as `<directory>.occult-replaced`)."""
    replaced = f"{directory}.occult-replaced"
    shutil.rmtree(replaced, ignore_errors=True)
    if os.path.isdir(directory):
        os.rename(directory, replaced)
    os.rename(staging, directory)
    shutil.rmtree(replaced, ignore_errors=True)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory) -> None:
    """Load the state `save_optimizer` wrote into `optimizer` (collective). The model must store its
    experts in the order they were saved in: load it from the checkpoint saved with the optimizer
    (`from_pretrained(checkpoint, distributed_config=DistributedConfig(..., ep_implementation="occult"))`
    restores the placement from its `config.json`), or with the same `OccultConfig.placement`."""
    from transformers.distributed.checkpoint import load_optimizer_distributed

    saved = _read_expert_orders(os.path.join(directory, EXPERT_ORDER_FILE))
    here = {layer: impl.expert_order for layer, impl in occult_ep_layers(model).items()}
    if saved != here:
        layer = next((l for l in sorted(here) if saved.get(l) != here[l]), None)
        raise ValueError(
            f"the optimizer state in {directory} was saved with the experts stored in order {saved.get(layer)} at "
            f"layer {layer}; this model stores {here.get(layer)}: load the model from the checkpoint saved with it "
            f"(from_pretrained(checkpoint, distributed_config=...) restores its placement) or pass the same "
            f"OccultConfig.placement"
        )
    reshard(model)
    load_optimizer_distributed(model, optimizer, str(directory))


def _read_expert_orders(path: str) -> dict[int, list[int]]:
    """`{layer: stored position -> expert id}` from the file `save_optimizer` wrote beside the optimizer state,
    checked: an error naming the file, not a bare AttributeError or int() failure on a damaged one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: save the optimizer with occult_hf.hf.native_ep.save_optimizer")
    data = read_json_file(path, "expert order")
    if not isinstance(data, dict):
        raise ValueError(f"expert order {path!r} must hold an object {{layer: [expert ids]}}, got {type(data).__name__}")
    orders = {}
    for layer, order in data.items():
        if not layer.isdecimal() or not isinstance(order, list) or not all(
            isinstance(e, int) and not isinstance(e, bool) for e in order
        ):
            raise ValueError(f"expert order {path!r}: entry {layer!r}: {order!r} is not a layer number with a list of expert ids")
        orders[int(layer)] = order
    return orders


def reshard(model: nn.Module) -> nn.Module:
    """Put every FSDP2 module of `model` back on its sharded parameters. A forward outside training (transformers
    sets `reshard_after_forward=False` on some modules) leaves unsharded parameters registered; an optimizer
    built then, or a sharded optimizer save, would see those instead of the sharded ones (transformers'
    Trainer does the same before it builds its optimizer). A no-op on sharded modules."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def _prefix_of(model: nn.Module, model_to_save: nn.Module) -> str:
    """Key prefix of `model`'s modules in `model_to_save`'s state dict ('' when they are the same model)."""
    for name, module in model_to_save.named_modules():
        if module is model:
            return f"{name}." if name else ""
    return ""


__all__ = [
    "EP_IMPLEMENTATION_NAME",
    "MIN_TRANSFORMERS_VERSION",
    "OccultEP",
    "ShardExperts",
    "ep_blocks",
    "apply_occult_ep",
    "apply_on_load",
    "occult_ep_config_of",
    "load_optimizer",
    "occult_ep_layers",
    "register_ep_implementation",
    "remove_occult_ep",
    "reshard",
    "save_optimizer",
    "transformers_ep_available",
    "uses_occult_ep",
]
