"""`OccultMoE`: the replacement MoE block (DESIGN.md §3): route, (prune), dispatch, local experts, combine.

Shape legend: B batch, S sequence, T = B*S tokens on this rank, H hidden, E routed experts, k experts
per token, D devices, L local experts.

The block is built from the model's own block and its family adapter and keeps both:
- the original block object (not registered as a child, so it adds no parameters), which the
  adapter routes with and which `restore()` hands back, weights written back, for `unapply_occult`;
- the block's own children except its routed experts (the router module instance, shared experts,
  gates), its direct parameters and buffers, registered here under the same names, so that
  transformers' `router_logits` capture still finds the router and the state-dict keys of
  everything but the routed experts are the vanilla ones;
- `experts`, a `LocalExperts` with this rank's experts only (`[L, 2I, H]`, `[L, H, I]` in local-slot
  order). In one process it holds all E experts in original order (the block's own fused
  parameters when the family stores them fused, so nothing is copied). Routed-expert parameters of
  the original block that the runtime does not share are emptied (their storage released) until
  `restore()` refills them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from .distributed.collectives import GradNormCarrier
from .config import OccultConfig
from .dispatch import (
    AutoHints,
    DispatchPlan,
    ExpertParallelGroup,
    TokenDispatcher,
    TokenRouting,
    build_dispatcher,
    dispatcher_class,
)
from .dispatch.base import stage
from .experts import LocalExperts
from .placement import Placement

#: where `hf.loading` leaves a block's local experts, read per rank: (expert ids, gate_up [L,2I,H], down [L,H,I])
LOADED_EXPERTS_ATTR = "_occult_loaded_experts"

if TYPE_CHECKING:
    from .pruning import CollaborationPruner


class OccultMoE(nn.Module):
    """An MoE block that dispatches one copy of a token per destination device (or per expert).

    After each forward: `last_topk_ids_Tk` (`[T, k]` int64, detached) is the routing actually
    dispatched (after pruning), `last_devices_TD` (`[T, D]` bool or None) the devices pruning limited
    each token to when the layer has replicated experts, and `rows_sent` `[D]`, `pairs_sent`
    `[D]` and `bytes_sent` `[D]` (int64) have accumulated, per destination device, the rows this rank sent,
    the (token, expert) pairs they carried and the bytes of the dispatch (activations and routing
    metadata; the combine returns the same rows, activations only). `forwards` counts the forwards
    since `reset_counters()`. In one process the destinations are the logical devices.
    A forward adds the dispatch plan's `[D, 2]` counts to one buffer (`sent_D2`) and one to `forwards`: two
    kernels (the three counters cost five); the three are views or products of that buffer, made when read.
    `top_k` (the model's experts per token) is what `dispatcher="auto"` estimates the padded exchange's
    padding from (`dispatch.auto`).
    """

    def __init__(
        self,
        block: nn.Module,
        adapter,
        layer_idx: int,
        placement: Placement,
        occult_config: OccultConfig,
        ep: ExpertParallelGroup,
        pruner: "CollaborationPruner | None" = None,
        grad_norm: GradNormCarrier | None = None,
        *,
        top_k: int,
    ) -> None:
        super().__init__()
        if placement.num_devices != ep.num_devices:
            raise ValueError(
                f"placement is for num_devices={placement.num_devices} but the expert-parallel group has "
                f"{ep.num_devices} devices"
            )
        self._original = (block,)  # a tuple hides the block from nn.Module registration
        self.adapter = adapter
        self.layer_idx = int(layer_idx)
        self.dispatch_mode = occult_config.dispatch
        self.ep = ep
        self.pruner = pruner
        self.last_topk_ids_Tk: torch.Tensor | None = None
        self.last_devices_TD: torch.Tensor | None = None

        experts_module = adapter.experts_module(block)
        for name, child in block.named_children():
            if child is not experts_module:
                self.add_module(name, child)
        for name, param in block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in block.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in block._non_persistent_buffers_set)

        device_of_E = placement.device_of(layer_idx)
        num_experts = placement.num_experts
        homes = placement.homes(layer_idx)
        replicated = any(len(h) > 1 for h in homes)
        if ep.is_distributed:  # this rank's slots: every expert with a home here (primary or replica)
            expert_ids = placement.experts_on(layer_idx, ep.rank)
            local_index_E = placement.local_slot(layer_idx)
            slot_ED = placement.slot_table(layer_idx)
        else:  # one process computes every expert once; the devices are logical
            expert_ids = list(range(num_experts))
            local_index_E = expert_ids
            slot_ED = np.repeat(np.arange(num_experts)[:, None], ep.num_devices, axis=1)
        gate_up_E2IH, down_EHI = adapter.expert_weights(block)
        if gate_up_E2IH.shape[0] != num_experts:
            raise ValueError(
                f"layer {layer_idx} has {gate_up_E2IH.shape[0]} routed experts but the placement is for "
                f"num_experts={num_experts}"
            )
        loaded = block.__dict__.pop(LOADED_EXPERTS_ATTR, None)  # this rank's experts, read per rank at load
        if gate_up_E2IH.is_meta:
            if loaded is None or loaded[0] != list(expert_ids):
                raise ValueError(
                    f"layer {layer_idx}: the routed experts are on the meta device and the experts read at load "
                    f"({None if loaded is None else loaded[0]}) are not this rank's {list(expert_ids)}: load with "
                    f"from_pretrained(..., occult_config=<the same OccultConfig>) on every rank"
                )
            gate_up_local = nn.Parameter(loaded[1], requires_grad=gate_up_E2IH.requires_grad)
            down_local = nn.Parameter(loaded[2], requires_grad=down_EHI.requires_grad)
            gate_up_E2IH = loaded[1]  # its device is where the runtime's buffers go
        else:
            gate_up_local = _local_parameter(gate_up_E2IH, expert_ids, num_experts)
            down_local = _local_parameter(down_EHI, expert_ids, num_experts)
        self.experts = LocalExperts(
            gate_up_local,
            down_local,
            torch.tensor(expert_ids, dtype=torch.int64),
            adapter.act_fn(block),
            backend=occult_config.expert_backend,
            deterministic=occult_config.deterministic,
            grad_scale=1.0 / ep.num_devices if ep.is_distributed else 1.0,
        )
        device = gate_up_E2IH.device
        self._dispatcher_settings = dict(
            name=occult_config.dispatcher,
            ep=ep,
            device_of_E=device_of_E,
            local_index_E=local_index_E,
            num_local_experts=self.experts.num_local_experts,
            mode=self.dispatch_mode,
            chunks=occult_config.dispatch_chunks,
            timeout_s=occult_config.exchange_timeout_s,
            layer=f"layer {self.layer_idx}",
            home_table_EM=placement.home_table(layer_idx) if replicated else None,
            slot_ED=slot_ED if replicated else None,
            replica_choice=occult_config.replica_choice,
            hints=AutoHints(
                tuple(int(d) for d in device_of_E), top_k, self.dispatch_mode, occult_config.dispatch_chunks,
                pruned=pruner is not None, expert_backend=occult_config.expert_backend,
            ),
            pin_slack=placement.pin_slack_of(layer_idx),
        )
        self.dispatcher: TokenDispatcher = build_dispatcher(**self._dispatcher_settings, device=device)
        self._track_replicas(homes, expert_ids)
        self.register_buffer("device_of_E", torch.tensor(device_of_E, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("local_index_E", torch.tensor(local_index_E, dtype=torch.int64, device=device), persistent=False)
        # the statistics (see the class docstring): rows and pairs sent, the bytes by row size, the forwards
        self.register_buffer("sent_D2", torch.zeros(ep.num_devices, 2, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("bytes_offset_D", torch.zeros(ep.num_devices, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self._row_bytes = 0  # the first forward's dispatch row size: bytes_sent = bytes_offset_D + rows_sent * it
        if ep.is_distributed:
            self.ep_grad_norm_carrier = nn.Parameter(
                torch.zeros(1, dtype=torch.float32, device=device), requires_grad=self.experts.gate_up_proj.requires_grad
            )
            # one all-reduce per backward for all layers that share `grad_norm` (a model's layers do)
            self._grad_norm = grad_norm if grad_norm is not None else GradNormCarrier(ep.group)
            self._grad_norm.register(self)
        self._release_unshared_expert_storage()

    def _apply(self, fn, recurse=True):
        """`.to()`/`.cuda()`: with `dispatcher="auto"`, choose again for the new device (a model is often
        built on the CPU and moved to its GPU afterwards, where a device-specific implementation may serve)."""
        module = super()._apply(fn, recurse)
        if self._dispatcher_settings["name"] == "auto":
            device = self.device_of_E.device
            if not isinstance(self.dispatcher, dispatcher_class("auto", self.ep, device, self._dispatcher_settings["hints"])):
                self.dispatcher = build_dispatcher(**self._dispatcher_settings, device=device)
        return module

    def train(self, mode: bool = True) -> "OccultMoE":
        """Also the replaced block: the adapter routes with it and the family reads its mode (DeepSeek-MoE
        computes its balance loss only in training). Unregistered, it would keep the mode it had when it was
        replaced: `from_pretrained` returns eval mode, so a model converted then and trained dropped the loss."""
        super().train(mode)
        self.original_block.train(mode)
        return self

    # ----- forward ----------------------------------------------------------------------
    @property
    def original_block(self) -> nn.Module:
        return self._original[0]

    @property
    def local_experts(self) -> LocalExperts:
        """The `LocalExperts`, also when PEFT has wrapped `experts`: LoRA on the fused expert weights
        (`target_parameters`) puts `ParamWrapper`s around it, whose forward applies the adapters, so
        the forward calls `self.experts` while attributes are read here."""
        experts = self.experts
        while not isinstance(experts, LocalExperts):
            experts = experts.base_layer
        return experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        block = self.original_block
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        with stage("route"):
            routing = self.adapter.route(block, hidden_states)
        # pruning may also limit each token's devices (with replicas: which home serves a pair)
        dispatched = TokenRouting(routing.topk_ids_Tk, routing.topk_weights_Tk)
        if self.pruner is not None:
            dispatched = self.pruner.route(block, routing)
        self.last_topk_ids_Tk = dispatched.topk_ids_Tk.detach()
        self.last_devices_TD = dispatched.devices_TD

        shared = []  # the shared experts need no exchange: the dispatcher issues them while its rows are on the wire
        routed_TH, plan = self.dispatcher.run(
            x_TH, dispatched, self.experts, concurrent=lambda: shared.append(self.adapter.shared_output(block, x_TH))
        )
        self._count(plan)

        routed_TH = self.adapter.attach_aux_loss(block, routed_TH, routing.aux_loss)
        shared_TH = shared[0]
        out_TH = routed_TH if shared_TH is None else routed_TH + shared_TH
        if self.ep.is_distributed and torch.is_grad_enabled() and self.ep_grad_norm_carrier.requires_grad:
            out_TH = _OnBackward.apply(out_TH, self._grad_norm.queue)
        return out_TH.reshape(shape)

    def runtime_state_names(self) -> list[str]:
        """Names (relative to this module) of the runtime's own per-rank buffers and parameters, which
        are not part of a checkpoint and which DDP must not synchronise."""
        names = ["device_of_E", "local_index_E", "sent_D2", "bytes_offset_D", "forwards"]
        return names + (["ep_grad_norm_carrier"] if self.ep.is_distributed else [])

    def on_device(self, name: str, device: torch.device) -> torch.Tensor:
        """The host-side index tensor `name` (`copy_weight_L`, `replica_slots`, `replica_rows`: fixed when the
        block is built) on `device`, copied there once: a copy from pageable host memory in every backward
        would wait for the GPU (a host synchronisation per layer)."""
        cache = self.__dict__.setdefault("_device_copies", {})
        key = (name, torch.device(device))
        if key not in cache:
            cache[key] = getattr(self, name).to(device)
        return cache[key]

    def _record_replica_grad(self, index: int, grad_L: torch.Tensor | None) -> None:
        """Parameter hook: keep this backward's contribution to the replicated copies' gradients
        (`[num_replicated, ...]` fp32), which `collectives.sum_replica_grads` sums over the holders.
        (The pipelined dispatcher's outer Function hands the parameters None: their gradients come from
        its inner backward, which calls this hook with them.)"""
        if grad_L is None:
            return
        slots, rows = self.on_device("replica_slots", grad_L.device), self.on_device("replica_rows", grad_L.device)
        part = torch.zeros((self.num_replicated, *grad_L.shape[1:]), dtype=torch.float32, device=grad_L.device)
        part.index_add_(0, rows, grad_L.detach()[slots].float())
        pending = self.replica_pending[index]
        self.replica_pending[index] = part if pending is None else pending + part

    def _track_replicas(self, homes: list[list[int]], expert_ids: list[int]) -> None:
        """Replicated experts: which local slots are copies of an expert with several homes, and where
        its gradient goes in the layer's batched sum over the holders (`collectives.sum_replica_grads`)."""
        distributed = self.ep.is_distributed
        replicated_E = [e for e, h in enumerate(homes) if len(h) > 1]
        self.num_replicated = len(replicated_E) if distributed else 0
        row_of = {e: i for i, e in enumerate(replicated_E)}
        held = [(slot, row_of[e]) for slot, e in enumerate(expert_ids) if e in row_of] if distributed else []
        self.replica_slots = torch.tensor([s for s, _ in held], dtype=torch.int64)
        self.replica_rows = torch.tensor([r for _, r in held], dtype=torch.int64)
        # 1 / homes of each local slot: the global gradient norm counts an expert once, not once per copy
        self.copy_weight_L = torch.tensor(
            [1.0 / len(homes[e]) if distributed else 1.0 for e in expert_ids], dtype=torch.float32
        )
        self.__dict__.pop("_device_copies", None)  # `on_device`'s copies are of the tables just replaced
        self.replica_pending: list[torch.Tensor | None] = [None, None]
        if self.num_replicated:
            for index, param in enumerate((self.local_experts.gate_up_proj, self.local_experts.down_proj)):
                if param.requires_grad:
                    param.register_hook(partial(self._record_replica_grad, index))

    @torch.no_grad()
    def set_replicas(self, placement: Placement) -> None:
        """Give this layer the replicas of `placement`, whose primary homes must be this layer's (what
        `placement.rebalance.replan_replicas` makes). Collective under EP: every rank calls it.

        Each rank's new slots are its homes under `placement`; a copy it did not hold is copied from the
        expert's primary holder (one broadcast per replicated expert and weight, every rank joins, in
        expert order), so every copy equals its primary bit for bit. The dispatcher, the local slots and
        the replica gradient bookkeeping are rebuilt. The expert parameters are new tensors: an optimizer
        built before must be rebuilt (re-home between training runs, or while serving).
        """
        import torch.distributed as dist

        layer = self.layer_idx
        if [int(d) for d in placement.device_of(layer)] != self.device_of_E.tolist():
            raise ValueError(
                f"layer {layer}: set_replicas needs the layer's primary homes {self.device_of_E.tolist()}, the new placement "
                f"has {list(placement.device_of(layer))}: only the redundant copies may move (replan_replicas keeps primaries)"
            )
        experts = self.experts
        if not isinstance(experts, LocalExperts):
            raise ValueError(f"layer {layer}: set_replicas does not support adapters (PEFT) on the routed experts")
        homes = placement.homes(layer)
        replicated = any(len(h) > 1 for h in homes)
        if self.ep.is_distributed:
            old_ids, new_ids = experts.expert_ids.tolist(), placement.experts_on(layer, self.ep.rank)
            params = (experts.gate_up_proj, experts.down_proj)
            weights = [param.new_empty((len(new_ids), *param.shape[1:])) for param in params]
            for slot, expert in enumerate(new_ids):
                if expert in old_ids:
                    for new, param in zip(weights, params):
                        new[slot] = param[old_ids.index(expert)]
            for expert in (e for e, h in enumerate(homes) if len(h) > 1):  # from the primary holder, every rank joins
                primary = int(self.device_of_E[expert])
                source = dist.get_global_rank(self.ep.group, primary)
                for new, param in zip(weights, params):
                    part = param[old_ids.index(expert)].contiguous() if self.ep.rank == primary else param.new_empty(param.shape[1:])
                    dist.broadcast(part, src=source, group=self.ep.group)
                    if expert in new_ids:
                        new[new_ids.index(expert)] = part
            experts.gate_up_proj = nn.Parameter(weights[0], requires_grad=params[0].requires_grad)
            experts.down_proj = nn.Parameter(weights[1], requires_grad=params[1].requires_grad)
            experts.expert_ids = torch.tensor(new_ids, dtype=torch.int64, device=experts.expert_ids.device)
            self.local_index_E.copy_(torch.as_tensor(placement.local_slot(layer), dtype=torch.int64))
            slot_ED = placement.slot_table(layer)
        else:
            new_ids = experts.expert_ids.tolist()
            slot_ED = np.repeat(np.arange(len(homes))[:, None], self.ep.num_devices, axis=1)
        self._dispatcher_settings.update(
            local_index_E=self.local_index_E.tolist(),
            num_local_experts=len(new_ids),
            home_table_EM=placement.home_table(layer) if replicated else None,
            slot_ED=slot_ED if replicated else None,
            pin_slack=placement.pin_slack_of(layer),
        )
        self.dispatcher = build_dispatcher(**self._dispatcher_settings, device=self.device_of_E.device)
        self._track_replicas(homes, new_ids)

    # ----- statistics -------------------------------------------------------------------
    def _count(self, plan: DispatchPlan) -> None:
        """Two kernels per forward (plan.counts_D2 needs no gradient). The row size is the first forward's; a
        forward with rows of another size (another activation dtype) adds the difference of its bytes to
        `bytes_offset_D` itself (two kernels more), so a CUDA graph that captured it replays that too."""
        if not self._row_bytes:
            self._row_bytes = plan.row_bytes
        elif plan.row_bytes != self._row_bytes:
            self.bytes_offset_D.add_(plan.counts_D2[:, 0] * (plan.row_bytes - self._row_bytes))
        self.sent_D2.add_(plan.counts_D2)
        self.forwards.add_(1)

    @property
    def rows_sent(self) -> torch.Tensor:
        """`[D]` int64 (a view of `sent_D2`): rows sent to each device since `reset_counters()`."""
        return self.sent_D2[:, 0]

    @property
    def pairs_sent(self) -> torch.Tensor:
        """`[D]` int64 (a view of `sent_D2`): (token, expert) pairs those rows carried."""
        return self.sent_D2[:, 1]

    @property
    def bytes_sent(self) -> torch.Tensor:
        """`[D]` int64: bytes of those rows (activations and routing metadata), made when read."""
        return self.bytes_offset_D + self.sent_D2[:, 0] * self._row_bytes

    @torch.no_grad()
    def reset_counters(self) -> None:
        for buffer in (self.sent_D2, self.bytes_offset_D, self.forwards):
            buffer.zero_()

    # ----- weights ----------------------------------------------------------------------
    @torch.no_grad()
    def place_full_experts(self, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor) -> dict[str, torch.Tensor]:
        """The vanilla state-dict entries (keys relative to the block) of the routed experts, given the
        full `[E, 2I, H]` / `[E, H, I]` weights in original expert order."""
        return self.adapter.expert_state_dict(self.original_block, gate_up_E2IH, down_EHI)

    @torch.no_grad()
    def restore(self, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor) -> nn.Module:
        """The original block with the given full expert weights written back into its own parameters."""
        block = self.original_block
        for key, value in self.place_full_experts(gate_up_E2IH, down_EHI).items():
            param = block.get_parameter(key)
            if param is value:
                continue
            new = value.detach().to(device=self.local_experts.gate_up_proj.device, dtype=param.dtype).clone()
            if param.is_meta:  # read per rank at load (`hf.loading`): never allocated, so a new parameter
                owner_path, _, name = key.rpartition(".")
                setattr(block.get_submodule(owner_path), name, nn.Parameter(new, requires_grad=param.requires_grad))
            else:
                param.data = new
        return block

    def _release_unshared_expert_storage(self) -> None:
        """Empty the original block's routed-expert parameters that `self.experts` does not share."""
        block = self.original_block
        shared = {id(self.experts.gate_up_proj), id(self.experts.down_proj)}
        keys = self.adapter.expert_state_dict(block, *self.adapter.expert_weights(block)).keys()
        for key in keys:
            param = block.get_parameter(key)
            if id(param) not in shared:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, adapter={self.adapter.name!r}, dispatch={self.dispatch_mode!r}, "
            f"dispatcher={self.dispatcher.name!r}, "
            f"devices={self.ep.num_devices}, rank={self.ep.rank}, distributed={self.ep.is_distributed}, "
            f"pruned={self.pruner is not None}"
        )


class _OnBackward(torch.autograd.Function):
    """Identity; calls `callback()` when the gradient passes through in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback()
        return grad, None


def _local_parameter(weight_E: torch.Tensor, expert_ids: list[int], num_experts: int) -> nn.Parameter:
    """This rank's experts of a `[E, ...]` expert weight as a parameter; the weight itself when it is
    already a parameter holding exactly these experts in this order (one process, fused layout)."""
    if isinstance(weight_E, nn.Parameter) and expert_ids == list(range(num_experts)):
        return weight_E
    index = torch.tensor(expert_ids, dtype=torch.int64, device=weight_E.device)
    return nn.Parameter(weight_E.detach().index_select(0, index).clone(), requires_grad=weight_E.requires_grad)


__all__ = ["OccultMoE"]
