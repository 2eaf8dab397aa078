"""The collectives of expert parallelism outside the token exchange (which lives in `occult_hf.dispatch`).

- `gather_rows`: THE gather of per-rank blocks of unequal length (the experts of a layer for a save
  or `unapply_occult`, the experts' PEFT adapter factors): padded to the largest block, one
  `all_gather` (every rank gets every block) or one `gather` to group rank 0, trimmed again.
- `GradNormCarrier`: the global gradient norm under EP with one all-reduce per backward for all
  layers (not one per layer). Each distributed `OccultMoE` owns a one-element `ep_grad_norm_carrier` parameter;
  at the end of every backward its gradient is set to the 2-norm of the OTHER ranks' expert
  gradients of that layer, so that `clip_grad_norm_` over one rank's parameters (replicated
  gradients, which DDP made identical, this rank's experts, and the carriers) sees the global norm,
  the same on every rank.
- `sum_replica_grads` (run by `GradNormCarrier` at the end of every backward, before the norms): with
  replicated experts each copy's gradient covers only the pairs it served; one batched all-reduce of
  every layer's per-backward contributions gives each holder the expert's full gradient, so the
  copies stay identical (`replicas.gradients.ReplicaGradients` keeps the contributions). The copies count once
  in the global norm (`LayerLayout.copy_weight_L`).
- `copies_from_primaries`: new copies of replicated experts, each broadcast from its primary holder.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..utils.logging import get_logger
from .agreement import bounded, save_timeout_s

logger = get_logger(__name__)


def gather_rows(
    local: torch.Tensor, dim: int, lengths: Sequence[int], group, to_all: bool, what: str = "a gather",
    timeout_s: float | None = None,
) -> list[torch.Tensor] | None:
    """Every rank's block of `local`, whose length along `dim` is `lengths[rank]` on group rank `rank`.

    Returns the blocks in group-rank order (each trimmed to its length), on every rank with
    `to_all=True`, else on group rank 0 only (None elsewhere). Collective: every rank of `group` must
    call it with the same `lengths`, `dim` and `to_all`. The wait is bounded by `timeout_s` (None:
    `$OCCULT_SAVE_TIMEOUT_S`, else 300 s); errors name `what` and the rule that callers must follow.
    """
    capacity = max(lengths)
    shape = list(local.shape)
    shape[dim] = capacity
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    parts = [torch.empty_like(padded) for _ in range(size)] if to_all or rank == 0 else None
    if to_all:
        start = functools.partial(dist.all_gather, parts, padded, group=group, async_op=True)
    else:
        start = functools.partial(dist.gather, padded, parts, dst=dist.get_global_rank(group, 0), group=group, async_op=True)
    bounded(what, None, save_timeout_s() if timeout_s is None else timeout_s, start, group)  # EPPeerError on a stall
    if parts is None:
        return None
    return [part.narrow(dim, 0, length) for part, length in zip(parts, lengths)]


class GradNormCarrier:
    """Sets the `ep_grad_norm_carrier` gradients of a model's EP layers with one all-reduce per backward.

    Layers `register()` at construction. Each layer's forward passes its output through `tap(out_TH,
    carrier)`, an identity that gives the carrier a zero gradient in backward; the carrier's
    post-accumulate-grad hook then queues `update()` on the autograd engine (the first layer of a backward
    does), which runs once the backward has finished: the squared norms of every registered layer's local
    expert gradients go into one vector, one `all_reduce` sums it over the group, and each carrier gets
    `sqrt(total - local)` of its layer. The tap is plain tensor code, so a compiled forward and backward
    trace it; the hook runs in the autograd engine, outside any compiled graph.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.layers: list[nn.Module] = []
        self._queued = False
        self._norms_due = False
        self._warned_frozen = False

    def warn_of_a_frozen_carrier(self, layer: int) -> None:
        """Once per model: a layer's carrier was frozen while its experts train, and is trainable again only now."""
        if not self._warned_frozen:
            self._warned_frozen = True
            logger.warning(
                "occult_hf: the ep_grad_norm_carrier of layer %d was frozen while its experts train (model.requires_grad_"
                "(False), or plain peft.get_peft_model, freezes it) and is trainable again from this forward on: an "
                "optimizer built before does not hold it, so a GradScaler neither unscales nor checks it and "
                "clip_grad_norm_ sees a scaled norm; build the optimizer after the first forward, or call "
                "occult_hf.hf.ddp.enable_grad_norm_carriers(model) first (the Trainer does)", layer,
            )

    def register(self, layer: nn.Module) -> None:
        """Add `layer` (its `ep_grad_norm_carrier` set) to the layers whose norms one backward reduces."""
        self.layers.append(layer)
        layer.ep_grad_norm_carrier.register_post_accumulate_grad_hook(lambda carrier: self.queue(norms=True))

    def queue(self, norms: bool = False) -> None:
        """Run `update` once this backward has finished: called by a carrier's hook (`norms`: the carriers get their
        gradients) and by a replicated expert's gradient hook (its copies' sum is due even in a backward that gives
        the carriers none: `backward(inputs=...)`, or a compiled forward that left a frozen carrier out)."""
        self._norms_due |= norms
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.update)

    @staticmethod
    def tap(out_TH: torch.Tensor, carrier: torch.Tensor) -> torch.Tensor:
        """`out_TH` itself, through an identity whose backward gives `carrier` a zero gradient (which fires its
        hook): called on a layer's output."""
        return _Tap.apply(out_TH, carrier)

    @torch.no_grad()
    def update(self) -> None:
        norms_due, self._queued, self._norms_due = self._norms_due, False, False
        sum_replica_grads([layer for layer in self.layers if layer.replica_grads is not None], self.group)
        if norms_due:
            self._set_carrier_grads()

    def _set_carrier_grads(self) -> None:
        device = self.layers[0].ep_grad_norm_carrier.device
        local_sq = torch.zeros(len(self.layers), dtype=torch.float32, device=device)
        counted_sq = torch.zeros(len(self.layers), dtype=torch.float32, device=device)
        for index, layer in enumerate(self.layers):
            weight_L = layer.layout.copy_weight_L
            weights = {id(layer.local_experts.gate_up_proj), id(layer.local_experts.down_proj)}
            for param in layer.experts.parameters():  # the expert weights and any PEFT adapters on them
                if param.grad is not None:
                    square = param.grad.float().square()
                    local_sq[index] += square.sum().to(device)
                    if id(param) in weights:  # a copy counts 1 / its homes
                        square = square.reshape(len(weight_L), -1).sum(1) * layer.layout.to(square.device).copy_weight_L
                    counted_sq[index] += square.sum().to(device)
        dist.all_reduce(counted_sq, group=self.group)  # one per backward, all layers: the global sums
        other = (counted_sq - local_sq).clamp_min(0).sqrt()
        for index, layer in enumerate(self.layers):
            carrier = layer.ep_grad_norm_carrier
            if carrier.requires_grad:
                carrier.grad = other[index].reshape(1).to(carrier.dtype)


@torch.no_grad()
def sum_replica_grads(layers: list[nn.Module], group) -> None:
    """Give every holder of a replicated expert the gradient of all its copies; one all-reduce for all layers.

    Each layer (an `OccultMoE` with `replica_grads`) recorded there its copies' gradient contributions of
    this backward (`[replicated experts, ...]` per expert weight, rows in the layer's replicated-expert order,
    zero where this rank holds no copy), held back from `.grad`. The all-reduce sums them over the group; each
    holder adds the sum to its `.grad` rows, which hold the same earlier gradient on every holder, so the
    copies' gradients are the same bits, also over several backwards. Collective: every rank calls it once
    per backward with the same layers.
    """
    if not layers:
        return
    blocks = []
    for layer in layers:
        experts = layer.local_experts
        for index, param in enumerate((experts.gate_up_proj, experts.down_proj)):
            blocks.append((layer, param, *layer.replica_grads.take(index, param)))
    flat = torch.cat([pending.reshape(-1) for _, _, pending, _ in blocks])
    dist.all_reduce(flat, group=group)
    offset = 0
    for layer, param, pending, accumulated in blocks:
        total = flat[offset : offset + pending.numel()].view_as(pending)
        offset += pending.numel()
        layout = layer.layout.to(param.device)
        if len(layout.replica_slots) == 0 or not param.requires_grad or not accumulated:  # not: `autograd.grad`
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.index_add_(0, layout.replica_slots, total[layout.replica_rows].to(param.grad.dtype))


@torch.no_grad()
def copies_from_primaries(
    weights: tuple[torch.Tensor, ...], old_ids: list[int], new_ids: list[int], replicated: list[int], device_of_E, group,
    rank: int, layer: int,
) -> dict[int, list[torch.Tensor]]:
    """`{expert: [its row of each of `weights`]}` for the replicated experts among this rank's new slots `new_ids`, each
    broadcast from its primary holder (`device_of_E[e]`; `weights` are `[len(old_ids), ...]`, slots `old_ids`), so
    that every copy equals its primary bit for bit. Only these rows: the caller builds the new weights from them and
    its own rows one layer at a time, never holding a second copy of all its experts. Collective over `group`, every
    replicated expert in expert order; each wait bounded like a save's (`EPPeerError` naming `layer`)."""
    copies: dict[int, list[torch.Tensor]] = {}
    for expert in replicated:
        primary = int(device_of_E[expert])
        source = dist.get_global_rank(group, primary)
        for weight in weights:
            part = weight[old_ids.index(expert)].contiguous() if rank == primary else weight.new_empty(weight.shape[1:])
            start = functools.partial(dist.broadcast, part, src=source, group=group, async_op=True)
            what = "copying the replicated experts from their primary holders (apply_replicas)"
            bounded(what, layer, save_timeout_s(), start, group)
            if expert in new_ids:
                copies.setdefault(expert, []).append(part)
    return copies


class _Tap(torch.autograd.Function):
    """Identity on `x`; in backward, `x`'s gradient passes through and `carrier` gets zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, carrier: torch.Tensor) -> torch.Tensor:
        ctx.carrier_dtype = carrier.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(1, dtype=ctx.carrier_dtype)


__all__ = ["GradNormCarrier", "copies_from_primaries", "gather_rows", "sum_replica_grads"]
