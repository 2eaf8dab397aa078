"""`OccultMoE`: the replacement MoE block: route, (prune), dispatch, local experts, combine.

Shape legend: B batch, S sequence, T = B*S tokens on this rank, H hidden, E routed experts, k experts
per token, D devices, L local experts.

The block is the one per-layer path of both front ends that replace a model's blocks (`hf.apply`) and
keeps only its forward. It is assembled from parts built elsewhere (`hf.blocks.build_occult_block`):

- the original block object (not registered as a child, so it adds no parameters), which the family
  adapter routes with and which `hf.blocks.restore_block` hands back, weights written back;
- the block's own children except its routed experts (the router module instance, shared experts,
  gates), its direct parameters and buffers, registered here under the same names, so that
  transformers' `router_logits` capture still finds the router and the state-dict keys of
  everything but the routed experts are the vanilla ones;
- `experts`, a `LocalExperts` with this rank's experts only (`[L, 2I, H]`, `[L, H, I]` in the slot order
  of `layout`);
- `layout` (the layer's `LayerLayout`), `dispatcher` (which owns all communication of the layer),
  `pruner` (collaboration pruning, or None), `stats` (an `ExchangeStats`), and under EP the replicated
  experts' gradient bookkeeping (`replica_grads`) and a one-element `ep_grad_norm_carrier` parameter
  (`distributed.collectives.GradNormCarrier`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .dispatch import DispatchSettings, ExpertParallelGroup, TokenDispatcher, TokenRouting, build_dispatcher, dispatcher_class
from .dispatch.base import stage
from .distributed.collectives import GradNormCarrier
from .experts import LocalExperts
from .layout import LayerLayout
from .replicas.gradients import ReplicaGradients
from .stats import ExchangeStats

if TYPE_CHECKING:  # the block only calls `pruner.route`: it does not depend on the pruning module
    from .pruning import CollaborationPruner


class OccultMoE(nn.Module):
    """An MoE block that dispatches one copy of a token per destination device (or per expert).

    After each forward: `last_topk_ids_Tk` (`[T, k]` int64, detached) is the routing actually dispatched
    (after pruning) and `last_devices_TD` (`[T, D]` bool or None) the devices pruning limited each token to
    when the layer has replicated experts; `stats` has added what the dispatch sent. In one process the
    destinations are the logical devices. Both only while `track` is true (the default; `track_routing(model,
    False)` clears it): a compiled forward then returns the stored routing as an extra output and adds to the
    counters' one buffer, a kernel and a guarded tensor a layer (docs/runtime.md, "Counters").
    """

    def __init__(
        self,
        block: nn.Module,
        adapter,
        layout: LayerLayout,
        experts: LocalExperts,
        settings: DispatchSettings,
        ep: ExpertParallelGroup,
        pruner: "CollaborationPruner | None" = None,
        grad_norm: GradNormCarrier | None = None,
    ) -> None:
        super().__init__()
        self._original = (block,)  # a tuple hides the block from nn.Module registration
        self.adapter = adapter
        self.layout = layout
        self.settings = settings
        self.ep = ep
        self.pruner = pruner
        self.last_topk_ids_Tk: torch.Tensor | None = None
        self.last_devices_TD: torch.Tensor | None = None
        self.track = True
        experts_module = adapter.experts_module(block)
        self._block_children = frozenset(name for name, child in block.named_children() if child is not experts_module)
        # in the block's order, the experts at theirs: parameter order is what DDP, optimizers and their states go by,
        # so an optimizer state of the stock model loads into this one and back
        for name, child in block.named_children():
            if child is experts_module:
                self.experts = experts
            else:
                self.add_module(name, child)
        for name, param in block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in block.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in block._non_persistent_buffers_set)
        device = experts.gate_up_proj.device
        self.dispatcher: TokenDispatcher = build_dispatcher(settings, ep, layout, device)
        self._hints = settings.hints(layout)  # read on the host now: `.to("meta")` leaves nothing to read them from
        self.stats = ExchangeStats(ep.num_devices, device)
        self.replica_grads = None
        self._grad_norm = grad_norm if ep.is_distributed else None
        if ep.is_distributed:
            # trainable from the start, also while the experts are frozen (no gradient reaches it then): an optimizer
            # built before the experts are unfrozen must hold it, or GradScaler neither unscales nor checks it
            self.ep_grad_norm_carrier = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))
            if self._grad_norm is None:  # a model's layers share one: one all-reduce per backward for all
                self._grad_norm = GradNormCarrier(ep.group)
            self._grad_norm.register(self)
            if layout.num_replicated:
                self.replica_grads = ReplicaGradients(
                    layout, (experts.gate_up_proj, experts.down_proj), self._grad_norm.queue
                )

    def __setattr__(self, name: str, value) -> None:
        """A child of the block replaced here (peft's `modules_to_save` copy of the router or shared expert, a LoRA layer
        on a linear of the block itself) is replaced in the block too: the family adapter runs the block's own children.
        """
        super().__setattr__(name, value)
        if isinstance(value, nn.Module) and name in self.__dict__.get("_block_children", ()):
            self._original[0]._modules[name] = value

    @property
    def layer_idx(self) -> int:
        return self.layout.layer

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
        if torch.jit.is_tracing():  # a trace records this batch's sizes and orders: other batches would be wrong
            raise RuntimeError(
                "torch.jit.trace cannot record an occult MoE block: its dispatch depends on the routing of the traced "
                "batch; use torch.export.export(..., strict=False) or torch.compile"
            )
        block = self._original[0]  # not the property: a compiled forward guards on a property's class chain
        hidden_states = self.adapter.block_input(block, hidden_states)
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        with stage("route"):
            routing = self.adapter.route(block, hidden_states)
        if self.pruner is None:
            dispatched = TokenRouting(routing.topk_ids_Tk, routing.topk_weights_Tk)
        else:  # may also limit each token's devices (with replicas: which home serves a pair)
            dispatched = self.pruner.route(block, routing)
        if self.track:
            self.last_topk_ids_Tk = dispatched.topk_ids_Tk.detach()
            self.last_devices_TD = dispatched.devices_TD

        shared = []  # the shared experts need no exchange: the dispatcher issues them while its rows are on the wire
        routed_TH, plan = self.dispatcher.run(
            x_TH, dispatched, self.experts, concurrent=lambda: shared.append(self.adapter.shared_output(block, x_TH))
        )
        if self.track:
            self.stats.record(plan.counts_D2, plan.row_bytes)

        routed_TH = self.adapter.attach_aux_loss(block, routed_TH, routing.aux_loss)
        shared_TH = shared[0]
        out_TH = routed_TH if shared_TH is None else routed_TH + shared_TH
        if self._grad_norm is not None and torch.is_grad_enabled():
            if self._experts_train():
                out_TH = self._grad_norm.tap(out_TH, self.ep_grad_norm_carrier)
            if out_TH.requires_grad and self._adapters_on_replicas_trainable():
                out_TH.register_hook(self._refuse_adapters_on_replicas)
        return out_TH.reshape(shape)

    def _experts_train(self) -> bool:
        """Whether this forward's expert gradients count in the global norm: the experts (or adapters on them) train
        now. A carrier frozen since (`model.requires_grad_(False)`, plain `peft.get_peft_model`) is made trainable
        again, once with a warning: an optimizer built while it was frozen does not hold it (`GradNormCarrier`)."""
        trains = any(param.requires_grad for param in self.experts.parameters())
        carrier = self.ep_grad_norm_carrier
        if trains and not carrier.requires_grad and not torch.compiler.is_compiling():
            carrier.requires_grad_(True)
            self._grad_norm.warn_of_a_frozen_carrier(self.layer_idx)
        return trains and carrier.requires_grad

    def _adapters_on_replicas_trainable(self) -> bool:
        """Whether adapters (PEFT) that require grad sit on this layer's routed experts, some of them replicated."""
        return (
            bool(self.layout.num_replicated)
            and not isinstance(self.experts, LocalExperts)
            and any(param.requires_grad for param in self.experts.parameters())
        )

    def _refuse_adapters_on_replicas(self, grad_TH: torch.Tensor) -> None:
        """Backward hook on the output of a layer whose replicated experts carry trainable adapters: nothing sums
        the adapters' gradients over an expert's copies, so a backward that would reach them stops here, at the
        layer's first backward step and before any `.grad` of it is written. On the backward, not the forward: an
        evaluation (eval mode, a metric, `generate` without `torch.no_grad`) uses the adapters exactly."""
        raise NotImplementedError(
            f"layer {self.layer_idx}: adapters (PEFT) on the routed experts cannot train with replicated experts "
            f"({self.layout.num_replicated} in this layer's placement): each copy's adapter would get only the "
            f"gradient of the pairs it served and the copies would drift apart; train them on a placement "
            f"without replicas and load the adapter into this one (loading is exact), or target other modules"
        )

    def _apply(self, fn, recurse=True):
        """`.to()`/`.cuda()`: with `dispatcher="auto"`, choose again for the new device (a model is often
        built on the CPU and moved to its GPU afterwards, where a device-specific implementation may serve)."""
        module = super()._apply(fn, recurse)
        device = self.local_experts.gate_up_proj.device
        self.layout = self.layout.to(device)
        if self.settings.dispatcher == "auto":
            chosen = dispatcher_class("auto", self.ep, device, self._hints)
            if not isinstance(self.dispatcher, chosen):
                self.dispatcher = chosen(self.ep, self.layout, self.settings)
        return module

    def train(self, mode: bool = True) -> "OccultMoE":
        """Also the replaced block: the adapter routes with it and the family reads its mode (DeepSeek-MoE
        computes its balance loss only in training). Unregistered, it would keep the mode it had when it was
        replaced: `from_pretrained` returns eval mode, so a model converted then and trained dropped the loss."""
        super().train(mode)
        self.original_block.train(mode)
        return self

    def runtime_state_names(self) -> list[str]:
        """Names (relative to this module) of the runtime's own per-rank buffers and parameters, which
        are not part of a checkpoint and which DDP must not synchronise."""
        names = [f"stats.{name}" for name in self.stats.buffer_names()]
        return names + (["ep_grad_norm_carrier"] if self.ep.is_distributed else [])

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, adapter={self.adapter.name!r}, dispatch={self.settings.mode!r}, "
            f"dispatcher={self.dispatcher.name!r}, "
            f"devices={self.ep.num_devices}, rank={self.ep.rank}, distributed={self.ep.is_distributed}, "
            f"pruned={self.pruner is not None}"
        )


__all__ = ["OccultMoE"]
