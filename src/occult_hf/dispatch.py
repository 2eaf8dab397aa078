"""Expert-parallel dispatch and combine: the only place where occult_hf communicates (DESIGN.md §3).

Shape legend: T tokens on this rank, H hidden, k experts per token, E routed experts, D devices of
the expert-parallel (EP) group, S rows this rank sends, R rows it receives, W routing slots carried
per row (k in "dedup", 1 in "per_expert"), N (received row, local expert) pairs, L experts this rank
computes.

`dispatch()`:
1. **Plan** (the paper's BRIM), on the tokens' device: the destination device of every (token, slot);
   the rows to send, one per (token, destination device) in "dedup" mode or one per (token, slot) in
   "per_expert" mode, sorted by destination device then token; each row carries W (local expert
   index, routing weight) entries, index -1 and weight 0 where the slot is served elsewhere.
2. **Counts**: one small all-to-all of the per-destination row and pair counts, read once on the
   host (the split sizes: the only host synchronisation).
3. **Exchange**: rows and their metadata in one autograd all-to-all whose backward is the reverse
   exchange, so routing weights and inputs receive gradients from every rank that used them.
4. **Layout**: on the receiver, the (row, local expert) pairs grouped by local expert
   (`ExpertSegments`), which the PyTorch and Triton expert kernels consume.

`combine()` sends each received row's pre-summed output back and sums a token's partial outputs
(CT of them in "dedup" mode, k in "per_expert" mode) in fp32.

In one process (no group, or a group of size 1) nothing is exchanged: the process computes every
expert (`L = E`, local index = global id) and `num_devices` is logical, so the plan and its counts
(rows per logical device, i.e. the CT statistics) are the same as on `num_devices` real ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .config import DISPATCH_MODES
from .kernels.layout import ExpertSegments

#: bytes of one routing-slot index on the wire (int32)
_SLOT_BYTES = 4


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The devices that hold a layer's experts.

    Attributes:
        num_devices: `D`. With `group` set, the EP ranks (group rank d is device d); without, logical
            devices of a single process.
        group: the `torch.distributed` process group of the EP ranks, or None in one process.
        rank: this process's rank in `group` (0 in one process).
    """

    num_devices: int
    group: Any = None
    rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

    @classmethod
    def resolve(cls, group=None, num_devices: int | None = None) -> "ExpertParallelGroup":
        """The EP group for a model: `group`, else the default group when `torch.distributed` is initialised.

        A group of size > 1 must have exactly `num_devices` ranks (None: take its size). Without a
        group, or with a group of one rank, the devices are logical: `num_devices` (None: 1).
        """
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if group is None and launched > 1:
            raise RuntimeError(
                f"this process was launched as one of WORLD_SIZE={launched} ranks but torch.distributed is not "
                f"initialised yet; call torch.distributed.init_process_group() before loading the model (or pass "
                f"group=) so that its experts are spread over the ranks"
            )
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            if num_devices is not None and num_devices != size:
                raise ValueError(
                    f"OccultConfig.num_devices ({num_devices}) must equal the expert-parallel group size "
                    f"({size}): every rank of the group holds the experts of one device"
                )
            return cls(num_devices=size, group=group, rank=dist.get_rank(group))
        return cls(num_devices=1 if num_devices is None else int(num_devices))


@dataclass(frozen=True)
class DispatchPlan:
    """What `combine()` needs to undo a `dispatch()`, and what the dispatch sent.

    Attributes:
        mode: "dedup" or "per_expert".
        num_tokens: `T` on this rank.
        token_of_row_S: `[S]` int64, the source token of each sent row (rows sorted by destination).
        send_rows: `D` rows sent to each device; in "dedup" mode `sum(send_rows)` is the sum over this
            rank's tokens of CT, in "per_expert" mode `T * k`.
        recv_rows: rows received from each EP rank (one process: a 1-tuple, everything is local).
        send_pairs: `D` (token, expert) pairs routed to each device (its expert compute load).
        recv_pairs: pairs received from each EP rank (one process: a 1-tuple).
        row_bytes: bytes of one row on the wire: `H` activations plus W (slot, weight) entries.
        send_counts_D2: `[D, 2]` int64 on the tokens' device: rows and pairs sent to each device (the
            same numbers as `send_rows`/`send_pairs`, for statistics that must not synchronise).
        ep: the group the rows were exchanged in.
    """

    mode: str
    num_tokens: int
    token_of_row_S: torch.Tensor
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    send_pairs: tuple[int, ...]
    recv_pairs: tuple[int, ...]
    row_bytes: int
    send_counts_D2: torch.Tensor
    ep: ExpertParallelGroup


@dataclass(frozen=True)
class Dispatched:
    """The result of `dispatch()`: what the local experts consume, and the plan to undo it.

    Attributes:
        x_RH: `[R, H]` received rows (x dtype); row r is served by the pairs with `pair_row == r`.
        segments: (row, local expert) pairs grouped by local expert (`ExpertSegments`).
        pair_weight_N: `[N]` routing weight of each pair, in segment order (router dtype; differentiable).
        plan: `DispatchPlan` for `combine()`.
    """

    x_RH: torch.Tensor
    segments: ExpertSegments
    pair_weight_N: torch.Tensor
    plan: DispatchPlan


def dispatch(
    x_TH: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    device_of_E: torch.Tensor,
    local_index_E: torch.Tensor,
    num_local_experts: int,
    ep: ExpertParallelGroup,
    mode: str = "dedup",
) -> Dispatched:
    """Send each token to the devices of its experts; return the received rows in expert layout.

    Args:
        x_TH: `[T, H]` this rank's tokens.
        topk_ids_Tk: `[T, k]` int64 expert ids in `[0, E)`.
        topk_weights_Tk: `[T, k]` routing weights as the model applies them.
        device_of_E: `[E]` int64 device of each expert (the placement of this layer).
        local_index_E: `[E]` int64 index of each expert in the weights of the rank that computes it
            (its local slot under EP; the expert id itself in one process).
        num_local_experts: `L`, experts computed here (E in one process).
        ep: the expert-parallel group.
        mode: "dedup" (one row per (token, destination device)) or "per_expert" (one per (token, expert)).
    """
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {mode!r}")
    num_tokens, top_k = topk_ids_Tk.shape
    num_devices = ep.num_devices
    ids_Tk = topk_ids_Tk.long()
    dest_Tk = device_of_E[ids_Tk]
    local_Tk = local_index_E[ids_Tk]
    pairs_D = _count(dest_Tk.reshape(-1), num_devices)

    if mode == "dedup":
        token_Tk = torch.arange(num_tokens, device=ids_Tk.device)[:, None].expand(num_tokens, top_k)
        hit_DT = torch.zeros(num_devices, num_tokens, dtype=torch.bool, device=ids_Tk.device)
        hit_DT[dest_Tk, token_Tk] = True
        rows_D = hit_DT.sum(1)
    else:
        rows_D = pairs_D
    send_counts_D2 = torch.stack([rows_D, pairs_D], dim=1)
    send_rows, send_pairs, recv_rows, recv_pairs = _exchange_counts(send_counts_D2, ep)

    num_send = sum(send_rows)
    if mode == "dedup":
        flat_S = _compact(hit_DT.reshape(-1), num_send)
        device_S, token_S = flat_S // num_tokens, flat_S % num_tokens
        serves_SW = dest_Tk[token_S] == device_S[:, None]
        slot_SW = torch.where(serves_SW, local_Tk[token_S], -1)
        weight_SW = torch.where(serves_SW, topk_weights_Tk[token_S], 0.0)
    else:
        order_S = torch.argsort(dest_Tk.reshape(-1), stable=True)
        token_S = order_S // top_k
        slot_SW = local_Tk.reshape(-1)[order_S, None]
        weight_SW = topk_weights_Tk.reshape(-1)[order_S, None]
    x_SH = x_TH[token_S]
    slot_SW = slot_SW.to(torch.int32)

    if ep.is_distributed:
        x_RH, slot_RW, weight_RW = _AllToAll.apply(ep.group, send_rows, recv_rows, x_SH, slot_SW, weight_SW)
    else:
        x_RH, slot_RW, weight_RW = x_SH, slot_SW, weight_SW

    num_rows, width = slot_RW.shape
    flat_N = _compact((slot_RW >= 0).reshape(-1), sum(recv_pairs))
    pair_row_N = flat_N // width
    pair_expert_N = slot_RW.reshape(-1)[flat_N].long()
    segments, order_N = ExpertSegments.from_pairs(pair_row_N, pair_expert_N, num_rows, num_local_experts)
    pair_weight_N = weight_RW.reshape(-1)[flat_N][order_N]

    row_bytes = x_TH.shape[1] * x_TH.element_size() + slot_SW.shape[1] * (_SLOT_BYTES + weight_SW.element_size())
    plan = DispatchPlan(
        mode=mode,
        num_tokens=num_tokens,
        token_of_row_S=token_S,
        send_rows=send_rows,
        recv_rows=recv_rows,
        send_pairs=send_pairs,
        recv_pairs=recv_pairs,
        row_bytes=row_bytes,
        send_counts_D2=send_counts_D2,
        ep=ep,
    )
    return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=pair_weight_N, plan=plan)


def combine(out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Return each received row's output to its source and sum a token's partial outputs.

    `out_RH` is `[R, H]`, row r the (already weighted and pre-summed) output of the local experts for
    received row r. Returns `[T, H]` in `out_RH.dtype`; the per-token sum runs in fp32.
    """
    if plan.ep.is_distributed:
        (out_SH,) = _AllToAll.apply(plan.ep.group, plan.recv_rows, plan.send_rows, out_RH)
    else:
        out_SH = out_RH
    out_TH = torch.zeros(plan.num_tokens, out_RH.shape[1], dtype=torch.float32, device=out_RH.device)
    out_TH = out_TH.index_add(0, plan.token_of_row_S, out_SH.float())
    return out_TH.to(out_RH.dtype)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of several tensors with the same split sizes; backward is the reverse exchange.

    Exchanging a row and its metadata in one Function fixes the order of the collectives in forward
    and backward, which must be the same on every rank. Integer tensors get no gradient; a floating
    tensor whose gradient is absent exchanges zeros, so every rank runs the same collectives.
    """

    @staticmethod
    def forward(ctx, group, send_splits: Sequence[int], recv_splits: Sequence[int], *tensors: torch.Tensor):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, tuple(send_splits), tuple(recv_splits)
        ctx.specs = [(t.is_floating_point(), t.shape[1:], t.dtype, t.device) for t in tensors]
        outputs = tuple(_all_to_all(t, send_splits, recv_splits, group) for t in tensors)
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        grad_inputs = []
        for grad, (is_float, shape, dtype, device) in zip(grads, ctx.specs):
            if not is_float:
                grad_inputs.append(None)
                continue
            if grad is None:
                grad = torch.zeros((sum(ctx.recv_splits), *shape), dtype=dtype, device=device)
            grad_inputs.append(_all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group))
        return (None, None, None, *grad_inputs)


def _all_to_all(t: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group) -> torch.Tensor:
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    dist.all_to_all_single(
        out, t.contiguous(), output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=group
    )
    return out


def _exchange_counts(send_D2: torch.Tensor, ep: ExpertParallelGroup):
    """`(send_rows, send_pairs, recv_rows, recv_pairs)` as host tuples, with one device-to-host copy."""
    if ep.is_distributed:
        recv_D2 = torch.empty_like(send_D2)
        dist.all_to_all_single(recv_D2, send_D2, group=ep.group)
        both = torch.cat([send_D2, recv_D2]).tolist()
        send, recv = both[: ep.num_devices], both[ep.num_devices :]
    else:
        send = send_D2.tolist()
        recv = [[sum(r for r, _ in send), sum(p for _, p in send)]]
    return (
        tuple(r for r, _ in send),
        tuple(p for _, p in send),
        tuple(r for r, _ in recv),
        tuple(p for _, p in recv),
    )


def _count(values_M: torch.Tensor, size: int) -> torch.Tensor:
    """`[size]` int64 histogram of values in `[0, size)`; unlike `bincount`, no host sync on CUDA."""
    counts = torch.zeros(size, dtype=torch.int64, device=values_M.device)
    return counts.scatter_add_(0, values_M.long(), torch.ones_like(values_M, dtype=torch.int64))


def _compact(mask_M: torch.Tensor, count: int) -> torch.Tensor:
    """`[count]` int64 positions of the True entries of a flat mask, in increasing order.

    `count` (the number of True entries) is already known on the host, so unlike `nonzero` this
    needs no device-to-host synchronisation: True entries scatter their position to their rank,
    False entries to a discarded extra slot.
    """
    index_M = torch.arange(mask_M.shape[0], device=mask_M.device)
    target_M = torch.where(mask_M, torch.cumsum(mask_M, 0) - 1, count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask_M.device)
    return out.scatter_(0, target_M, index_M)[:count]


__all__ = ["ExpertParallelGroup", "DispatchPlan", "Dispatched", "dispatch", "combine"]
