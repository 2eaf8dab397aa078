"""The gradients of a layer's replicated experts under expert parallelism.

Each copy of a replicated expert computes only the (token, expert) pairs routed to it, so after a backward
each holder has a partial gradient. `ReplicaGradients` keeps, per backward, this rank's contributions to
every replicated expert of the layer (`[replicated experts, ...]` fp32, zero where this rank holds no copy)
and holds them back from `.grad` (its parameter hook returns the gradient with the replicated slots zeroed);
`occult_hf.distributed.collectives.sum_replica_grads`, which the hook queues for the end of the backward, sums
them over the group in one all-reduce for all layers and adds the sum to each holder's `.grad`. Every holder
then computes the same `earlier + sum` from the same bits, also over several backwards (gradient accumulation)
and with more than two copies, where adding the other copies' part to each rank's own would round differently
on each rank and the copies would drift apart.

`torch.autograd.grad` does not fill `.grad`: the gradients it returns lack the replicated slots, and their
sum over the ranks goes nowhere (a `.grad` only gets it from a backward that accumulated into it).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from ..layout import LayerLayout


class ReplicaGradients:
    """This rank's per-backward contributions to a layer's replicated experts' gradients.

    Built for a layer whose `layout` (EP, `num_replicated > 0`) and local expert parameters (`[L, ...]`,
    slot order) are given; registers a gradient hook on each parameter that needs one, which also calls
    `queue_sum` (the model's `GradNormCarrier.queue`: the sum over ranks once the backward has finished).
    `pending[i]` is the contribution to weight `i` (0: gate_up, 1: down) since the last `take(i)`, `accumulated[i]`
    whether a backward accumulated into its `.grad` since then.
    """

    def __init__(
        self, layout: LayerLayout, weights: tuple[nn.Parameter, nn.Parameter], queue_sum: Callable[[], None]
    ) -> None:
        self.layout = layout
        self.queue_sum = queue_sum
        self.pending: list[torch.Tensor | None] = [None, None]
        self.accumulated = [False, False]
        for index, weight in enumerate(weights):
            if weight.requires_grad:
                weight.register_hook(partial(self.record, index))
                weight.register_post_accumulate_grad_hook(partial(self._mark_accumulated, index))

    def _mark_accumulated(self, index: int, weight: nn.Parameter) -> None:
        self.accumulated[index] = True

    @property
    def num_replicated(self) -> int:
        return self.layout.num_replicated

    @torch.no_grad()
    def record(self, index: int, grad_L: torch.Tensor | None) -> torch.Tensor | None:
        """Parameter hook: keep this backward's part of the replicated copies' gradients, and return the gradient
        without it (zero in the replicated slots) for `.grad`. (The pipelined dispatcher's outer Function hands the
        parameters None: their gradients come from its inner backward, which runs this hook on them.)"""
        if grad_L is None:
            return None
        layout = self.layout.to(grad_L.device)
        part = torch.zeros((self.num_replicated, *grad_L.shape[1:]), dtype=torch.float32, device=grad_L.device)
        part.index_add_(0, layout.replica_rows, grad_L.detach()[layout.replica_slots].float())
        pending = self.pending[index]
        self.pending[index] = part if pending is None else pending + part
        self.queue_sum()
        return grad_L.index_fill(0, layout.replica_slots, 0)

    def take(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`(contribution to weight index since the last take, whether a backward accumulated into its .grad since)`
        (zeros shaped for `like` when none), then reset."""
        pending, self.pending[index] = self.pending[index], None
        accumulated, self.accumulated[index] = self.accumulated[index], False
        if pending is None:
            pending = torch.zeros((self.num_replicated, *like.shape[1:]), dtype=torch.float32, device=like.device)
        return pending, accumulated


__all__ = ["ReplicaGradients"]
