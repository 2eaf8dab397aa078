"""The dispatch plan (the paper's BRIM, DESIGN.md §3 step 3): pure tensor functions, no communication.

Shape legend: T tokens on this rank, k experts per token, E routed experts, D devices of the EP group,
S rows this rank sends, R rows it receives, W routing slots carried per row (k in "dedup", 1 in
"per_expert"), N (received row, local expert) pairs, L local experts, C chunks of tokens.

Everything here runs on the tokens' device. Sizes that depend on the routing (S, N) are passed in by
the caller, who learnt them from the count exchange (the one host read of the torch.distributed
dispatcher); the functions themselves never read a tensor on the host, so the one-process path
(`local_pairs`, whose sizes are static: `T` rows and `T * k` pairs) has no host synchronisation.

- `destinations`: the device and local slot of every (token, slot).
- `device_counts`: rows and pairs per destination device, per chunk of tokens (`[C, D, 2]`).
- `send_order`: the rows to send, sorted by destination device then token (one per (token,
  destination) in "dedup", one per (token, slot) in "per_expert"), each with W (local slot, weight)
  entries, slot -1 and weight 0 where the slot is served on another device.
- `received_pairs`: on the receiver, the (row, local expert) pairs of the received rows grouped by
  local expert (`ExpertSegments`), plus where each pair's weight sits in the received `[R, W]` block.
- `local_pairs`: the same layout in one process, where every expert is local and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from occult_hf.kernels.layout import ExpertSegments

from ..placement.replicas import resolve_homes

#: the dispatch modes (`OccultConfig.dispatch`): one row per (token, device), or per (token, expert) pair
DISPATCH_MODES = ("dedup", "per_expert")


def check_mode(mode: str) -> None:
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {mode!r}")


def routing_width(mode: str, top_k: int) -> int:
    """`W`: routing slots a row carries (all k of its token in "dedup", its own one in "per_expert")."""
    check_mode(mode)
    return top_k if mode == "dedup" else 1


def destinations(
    topk_ids_Tk: torch.Tensor,
    device_of_E: torch.Tensor,
    local_index_E: torch.Tensor,
    home_table_EM: torch.Tensor | None = None,
    slot_ED: torch.Tensor | None = None,
    visited_TD: torch.Tensor | None = None,
):
    """`(dest_Tk, local_Tk)`: `[T, k]` int64 device serving each (token, expert) pair and the expert's slot there.

    Without replicas the expert's one device (`device_of_E`) and slot (`local_index_E`). With replicated
    experts (`home_table_EM` `[E, M]` homes, `slot_ED` `[E, D]` slot of expert e on device d) each pair
    goes to the home `placement.replicas.resolve_homes` picks (the one routing rule, shared with the
    metrics), with the token's position on this rank as its index; `visited_TD` `[T, D]` bool (pruning
    with replicas: each token's N_d devices) makes a pair take its expert's home among them.
    """
    ids_Tk = topk_ids_Tk.long()
    if home_table_EM is None:
        return device_of_E[ids_Tk], local_index_E[ids_Tk]
    dest_Tk = resolve_homes(ids_Tk, home_table_EM, slot_ED.shape[1], visited_TD=visited_TD)
    return dest_Tk, slot_ED[ids_Tk, dest_Tk]


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """`C` contiguous `[start, end)` token ranges of near-equal size (static: from T and C only)."""
    num_chunks = max(1, min(num_chunks, num_tokens)) if num_tokens else 1
    cuts = [c * num_tokens // num_chunks for c in range(num_chunks + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def device_counts(dest_Tk: torch.Tensor, num_devices: int, mode: str, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """`[C, D, 2]` int64 on the tokens' device: rows and (token, expert) pairs each chunk sends to each device.

    Rows are the distinct (token, device) pairs in "dedup" mode (summed over devices: the chunk's CT
    count) and the (token, expert) pairs in "per_expert" mode.
    """
    check_mode(mode)
    num_tokens = dest_Tk.shape[0]
    device = dest_Tk.device
    chunk_T = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    for index, (start, end) in enumerate(bounds[1:], start=1):
        chunk_T[start:end] = index
    key_Tk = chunk_T[:, None] * num_devices + dest_Tk  # (chunk, device) of every (token, slot)
    pairs_CD = count(key_Tk.reshape(-1), len(bounds) * num_devices)
    if mode == "dedup":
        hit_TD = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=device).scatter_(1, dest_Tk, True)
        rows_CD = torch.zeros(len(bounds), num_devices, dtype=torch.int64, device=device)
        rows_CD.index_add_(0, chunk_T, hit_TD.long())
        rows_CD = rows_CD.reshape(-1)
    else:
        rows_CD = pairs_CD
    return torch.stack([rows_CD, pairs_CD], dim=1).reshape(len(bounds), num_devices, 2)


@dataclass(frozen=True)
class SendOrder:
    """The rows one chunk of tokens sends, sorted by destination device, then token.

    Attributes:
        token_S: `[S]` int64 source token of each row (index into the chunk's tokens).
        slot_SW: `[S, W]` int32 local slot of the expert on the destination; -1 where that routing
            slot is served on another device.
        weight_SW: `[S, W]` routing weight (the router's dtype, differentiable); 0 where the slot is -1.
    """

    token_S: torch.Tensor
    slot_SW: torch.Tensor
    weight_SW: torch.Tensor


def send_order(
    dest_Tk: torch.Tensor,
    local_Tk: torch.Tensor,
    weights_Tk: torch.Tensor,
    num_devices: int,
    mode: str,
    num_rows: int,
) -> SendOrder:
    """The send order of `T` tokens; `num_rows` (S) is the sum of their rows over devices, known on the host."""
    check_mode(mode)
    num_tokens, top_k = dest_Tk.shape
    if mode == "dedup":
        token_Tk = torch.arange(num_tokens, device=dest_Tk.device)[:, None]
        hit_DT = torch.zeros(num_devices * num_tokens, dtype=torch.bool, device=dest_Tk.device)
        hit_DT.scatter_(0, (dest_Tk * num_tokens + token_Tk).reshape(-1), True)
        flat_S = compact(hit_DT, num_rows)
        device_S, token_S = flat_S // max(num_tokens, 1), flat_S % max(num_tokens, 1)
        serves_SW = dest_Tk[token_S] == device_S[:, None]
        slot_SW = torch.where(serves_SW, local_Tk[token_S], -1)
        weight_SW = torch.where(serves_SW, weights_Tk[token_S], 0.0)
    else:
        order_S = torch.argsort(dest_Tk.reshape(-1), stable=True)
        token_S = order_S // top_k
        slot_SW = local_Tk.reshape(-1)[order_S, None]
        weight_SW = weights_Tk.reshape(-1)[order_S, None]
    return SendOrder(token_S=token_S, slot_SW=slot_SW.to(torch.int32), weight_SW=weight_SW)


def received_pairs(slot_RW: torch.Tensor, num_pairs: int, num_local_experts: int):
    """`(segments, pick_N)` for received rows: pairs grouped by local expert, and `[N]` int64 positions
    in the flattened `[R * W]` routing block of each pair (so `weight_RW.reshape(-1)[pick_N]` are the
    pair weights in segment order). `num_pairs` (N) is known on the host from the count exchange."""
    num_rows, width = slot_RW.shape
    flat_N = compact((slot_RW >= 0).reshape(-1), num_pairs)
    pair_row_N = flat_N // max(width, 1)
    pair_expert_N = slot_RW.reshape(-1)[flat_N].long()
    segments, order_N = ExpertSegments.from_pairs(pair_row_N, pair_expert_N, num_rows, num_local_experts)
    return segments, flat_N[order_N]


def local_pairs(local_Tk: torch.Tensor, num_local_experts: int, mode: str):
    """`(segments, pick_N)` in one process, where every expert is local: static sizes, no host read.

    "dedup": the rows are the tokens themselves (`R = T`), each served by its k pairs, so a token's
    experts are summed (in fp32) by the expert kernel. "per_expert": one row per (token, slot) in
    token-major order (`R = T * k`, row `t * k + j`), as the per-expert baseline sends them. `pick_N`
    indexes the flattened `[T * k]` routing weights, in segment order.
    """
    check_mode(mode)
    num_tokens, top_k = local_Tk.shape
    flat_N = torch.arange(num_tokens * top_k, device=local_Tk.device)
    pair_row_N = flat_N // top_k if mode == "dedup" else flat_N
    num_rows = num_tokens if mode == "dedup" else num_tokens * top_k
    segments, order_N = ExpertSegments.from_pairs(pair_row_N, local_Tk.reshape(-1), num_rows, num_local_experts)
    return segments, order_N


def count(values_M: torch.Tensor, size: int) -> torch.Tensor:
    """`[size]` int64 histogram of values in `[0, size)`; unlike `bincount`, no host sync on CUDA."""
    counts = torch.zeros(size, dtype=torch.int64, device=values_M.device)
    return counts.scatter_add_(0, values_M.long(), torch.ones_like(values_M, dtype=torch.int64))


def compact(mask_M: torch.Tensor, count: int) -> torch.Tensor:
    """`[count]` int64 positions of the True entries of a flat mask, in increasing order.

    `count` (the number of True entries) is already known on the host, so unlike `nonzero` this
    needs no device-to-host synchronisation: True entries scatter their position to their rank,
    False entries to a discarded extra slot.
    """
    index_M = torch.arange(mask_M.shape[0], device=mask_M.device)
    target_M = torch.where(mask_M, torch.cumsum(mask_M, 0) - 1, count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask_M.device)
    return out.scatter_(0, target_M, index_M)[:count]


__all__ = [
    "SendOrder",
    "check_mode",
    "chunk_bounds",
    "compact",
    "count",
    "destinations",
    "device_counts",
    "local_pairs",
    "received_pairs",
    "routing_width",
    "send_order",
]
