"""Keep the ranks of an expert-parallel group stepping through the same number of model forwards.

Under EP every forward is a collective: each MoE layer exchanges tokens with every other rank, so
a rank that stops calling the model while another still runs it would hang the group. lm-eval
pads each rank's *request* lists to equal length, but the number of forwards still differs between
ranks: batches group requests by shared context, and generation stops when a batch's stop strings
appear, which depends on the data.

The protocol: before each forward every rank votes in one `all_reduce` (1 = "I run a real forward",
0 = "I am only waiting"). A rank that has run out of work and must reach a collective of its own
(lm-eval's `all_gather`, `barrier`, `gather_object`) first calls `drain()`: it votes 0 and, while
the sum is positive, runs an idle forward of one token so that the busy ranks' exchanges find a
partner. When every rank votes 0 all of them are in `drain()` together, and they leave it in the
same round. Because every rank makes the same sequence of those calls (lm-eval's evaluator calls
them in the same order on every rank), the k-th drain of one rank is paired with the k-th drain of
the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ForwardLockstep:
    """Installs the vote as a forward pre-hook on `model` (removable with `remove()`).

    Args:
        model: the top-level model whose every call runs the EP exchanges (e.g. `*ForCausalLM`).
        group: the EP process group.
        device: where the vote tensor lives (the model's device: NCCL needs a CUDA tensor).
        idle_token_id: the token of the one-token idle forward (`[1, 1]` input).
        autocast_dtype: the autocast dtype real forwards run under (None: none), so that idle forwards
            exchange activations of the same dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        device: torch.device,
        idle_token_id: int,
        autocast_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.group = group
        self.device = torch.device(device)
        self.idle_input_ids_11 = torch.tensor([[idle_token_id]], dtype=torch.long, device=self.device)
        self.autocast_dtype = autocast_dtype
        self.real_forwards = 0
        self.idle_forwards = 0
        self._draining = False
        self._handle = model.register_forward_pre_hook(self._before_forward)

    def _vote(self, runs_real_forward: bool) -> int:
        """Sum over the group of the ranks that run a real forward this round."""
        ballot = torch.tensor([int(runs_real_forward)], dtype=torch.int64, device=self.device)
        dist.all_reduce(ballot, group=self.group)
        return int(ballot.item())

    def _before_forward(self, module: nn.Module, args) -> None:
        if self._draining:
            return
        self._vote(True)
        self.real_forwards += 1

    def drain(self) -> None:
        """Run idle forwards until every rank of the group has called `drain()`; all return in the same round."""
        self._draining = True
        try:
            autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
            with torch.no_grad(), autocast:
                while self._vote(False) > 0:
                    self.model(input_ids=self.idle_input_ids_11, use_cache=False)
                    self.idle_forwards += 1
        finally:
            self._draining = False

    def remove(self) -> None:
        self._handle.remove()


__all__ = ["ForwardLockstep"]
