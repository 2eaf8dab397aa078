"""The dispatch plan (the paper's BRIM, docs/design.md §3 step 3): pure tensor functions, no communication.

Shape legend (docs/conventions.md): T tokens on this rank, k experts per token, E routed experts, D
devices of the EP group, O rows this rank sends, R rows it receives, W routing slots carried per row
(k in "dedup", 1 in "per_expert"), N (received row, local expert) pairs, L local experts, M homes of
one expert, C chunks of tokens, J rows of one token; local to this file: Q (device, token) entries
(`D * T`) and F flat (row, routing slot) entries (`T * k` sent in "per_expert", `R * W` received).

Everything here runs on the tokens' device. Sizes that depend on the routing (O, N) are passed in by
the caller, who learnt them from the count exchange (the one host read of the torch.distributed
dispatcher); the functions themselves never read a tensor on the host, so the one-process path
(`local_pairs`, whose sizes are static: `T` rows and `T * k` pairs) has no host synchronisation.

- `destinations`: the device and local slot of every (token, slot).
- `padded_layout`: the "padded" exchange's rows, a fixed slot per device with row i for token i: no scan.
- `send_layout`: the rows to send, laid out by destination device then token (one per (token,
  destination) in "dedup", one per (token, slot) in "per_expert") in a block of static capacity, each
  with W (local slot, weight) entries (slot -1 and weight 0 where the slot is served on another
  device), each token's row positions (what the combine sums through) and the counts; static shapes,
  no host read, no atomics.
- `device_match` / `packed_rows`: the same rows when the row count `O` is already known on the host
  (the torch.distributed dispatcher learns it from the count exchange): a `[D, T, k]` match and the
  counts before the exchange, then the `O` rows by one `nonzero_static` of the per-(device, token) mask
  (its order is the packed order) and each token's rows by one scan: about a third of the operator
  calls of `send_layout`, which must also fill a static capacity.
- `received_pairs`: on the receiver, the (row, local expert) pairs of the received rows grouped by
  local expert (`ExpertSegments`), plus where each pair's weight sits in the received `[R, W]` block.
- `local_pairs`: the same layout in one process, where every expert is local and nothing moves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from occult_hf.kernels.layout import ExpertSegments

from ..layout import LayerLayout
from ..registry import DISPATCH_MODES
from ..replicas.routing import resolve_homes



def check_mode(mode: str) -> None:
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {mode!r}")


def routing_width(mode: str, top_k: int) -> int:
    """`W`: routing slots a row carries (all k of its token in "dedup", its own one in "per_expert")."""
    check_mode(mode)
    return top_k if mode == "dedup" else 1


def destinations(topk_ids_Tk: torch.Tensor, layout: LayerLayout, devices_TD: torch.Tensor | None = None):
    """`(dest_Tk, local_Tk)`: `[T, k]` int64 device serving each (token, expert) pair and the expert's slot there.

    `layout` is the layer's `LayerLayout` on the ids' device. Without replicas the expert's one device and its
    slot there. With replicated experts each pair goes to the home `replicas.routing.resolve_homes` picks (the
    one routing rule, shared with the metrics), with the token's position on this rank as its index;
    `devices_TD` `[T, D]` bool (pruning with replicas: each token's N_d devices) makes a pair take its expert's
    home among them.
    """
    ids_Tk = topk_ids_Tk.long()
    if not layout.replicated:
        return layout.device_of_E[ids_Tk], layout.local_index_E[ids_Tk]
    dest_Tk = resolve_homes(ids_Tk, layout.home_table_EM, layout.num_devices, devices_TD=devices_TD)
    return dest_Tk, layout.slot_ED[ids_Tk, dest_Tk]


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """`C` contiguous `[start, end)` token ranges of near-equal size (static: from T and C only)."""
    num_chunks = max(1, min(num_chunks, num_tokens)) if num_tokens else 1
    cuts = [c * num_tokens // num_chunks for c in range(num_chunks + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass(frozen=True)
class SendLayout:
    """The rows one group of tokens sends, laid out by destination device, then token, in a block of
    `C_O` (capacity) rows; built on the device with static shapes (no host read).

    Attributes:
        token_O: `[C_O]` int64 source token of each row (index into the tokens given); `T` (one past the
            last token) for a position no row fills.
        slot_OW: `[C_O, W]` int32 local slot of the expert on the destination; -1 where that routing slot
            is served on another device (and in unfilled positions).
        weight_OW: `[C_O, W]` routing weight (the router's dtype, differentiable); 0 where the slot is -1.
        row_TJ: `[T, J]` int64 position of each token's rows (J = min(D, k) in "dedup": the token's j-th
            destination device in device order; J = k in "per_expert": its slot j); `C_O` where the
            token has fewer than J rows (`padded_layout`: J = D in "dedup", column d for device d). The combine
            sums a token's rows through it (a gather, no atomics).
        counts_D2: `[D, 2]` int64 rows and (token, expert) pairs sent to each device: what the layout
            packed, equal to `device_match`'s of the same tokens (it is counted from the layout's own
            per-(device, token) mask instead of a second pass over the tokens).
    """

    token_O: torch.Tensor
    slot_OW: torch.Tensor
    weight_OW: torch.Tensor
    row_TJ: torch.Tensor
    counts_D2: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.token_O.shape[0]


def send_capacity(num_tokens: int, top_k: int, num_devices: int, mode: str) -> int:
    """`C_O` of the packed layout: at most min(D, k) rows per token in "dedup", exactly k in "per_expert"."""
    return num_tokens * (min(num_devices, top_k) if mode == "dedup" else top_k)


def send_layout(dest_Tk: torch.Tensor, local_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_devices: int, mode: str) -> SendLayout:
    """The packed send layout of `T` tokens (see `SendLayout`): one pass of cumulative sums and scatters.

    Rows to device d start at the exclusive prefix sum of the rows per device, so the `O` real rows are the
    block's first O of `C_O = send_capacity(...)`. Rows for one device keep token order, so the combine's per-token
    sum order is fixed (deterministic).
    """
    check_mode(mode)
    num_tokens, top_k = dest_Tk.shape
    device = dest_Tk.device
    capacity = send_capacity(num_tokens, top_k, num_devices, mode)
    token_Tk = torch.arange(num_tokens, device=device)[:, None]
    if mode == "dedup":
        # one flat device-major mask (entry q = d * T + t): its running count is each row's packed position
        # (one 1-D scan; a scan down the T axis of a [T, D] tensor runs one thread per column: slow at large T);
        # every per-row field is then one gather from a per-(device, token) table
        num_entries = num_devices * num_tokens
        hit_Q = torch.zeros(num_entries, dtype=torch.bool, device=device)
        hit_Q.scatter_(0, (dest_Tk * num_tokens + token_Tk).reshape(-1), True)
        hit_DT = hit_Q.view(num_devices, num_tokens)
        rows_D = hit_DT.sum(1)
        pos_Q = torch.cumsum(hit_Q, 0) - 1
        pos_Q = torch.where(hit_Q, pos_Q, capacity)
        entry_O = _place(pos_Q, torch.arange(num_entries, device=device), capacity, num_entries)  # value D * T: unfilled
        match_DTk = dest_Tk == torch.arange(num_devices, device=device)[:, None, None]  # [D, T, k]
        pairs_D = match_DTk.sum((1, 2))
        slot_QW = torch.where(match_DTk, local_Tk, -1).view(num_entries, top_k)
        weight_QW = torch.where(match_DTk, weights_Tk, 0.0).view(num_entries, top_k)
        slot_OW = torch.cat([slot_QW, slot_QW.new_full((1, top_k), -1)])[entry_O]
        weight_OW = torch.cat([weight_QW, weight_QW.new_zeros(1, top_k)])[entry_O]
        token_O = torch.where(entry_O < num_entries, entry_O % max(num_tokens, 1), num_tokens)
        width = min(num_devices, top_k)  # J: a token's j-th destination device, in device order
        j_DT = torch.where(hit_DT, torch.cumsum(hit_DT, 0) - 1, width)  # a scan over D for each of T columns
        row_TJ = torch.full((num_tokens, width + 1), capacity, dtype=torch.int64, device=device)
        row_TJ = row_TJ.scatter_(1, j_DT.t(), pos_Q.view(num_devices, num_tokens).t())[:, :width]
    else:
        num_entries = num_tokens * top_k  # F = T * k (token, slot) entries, one row each
        dest_F = dest_Tk.reshape(-1)
        key_F = dest_F * num_entries + torch.arange(num_entries, device=device)
        hit_DF = torch.zeros(num_devices * num_entries, dtype=torch.bool, device=device).scatter_(0, key_F, True)
        pairs_D = rows_D = hit_DF.view(num_devices, num_entries).sum(1)
        pos_F = torch.cumsum(hit_DF, 0)[key_F] - 1
        entry_O = _place(pos_F, torch.arange(num_entries, device=device), capacity, num_entries)
        token_O = entry_O // top_k
        valid_O = entry_O < num_entries
        safe_O = entry_O.clamp(max=max(num_entries - 1, 0))
        if num_entries:
            slot_OW = torch.where(valid_O, local_Tk.reshape(-1)[safe_O], -1)[:, None]
            weight_OW = torch.where(valid_O, weights_Tk.reshape(-1)[safe_O], 0.0)[:, None]
        else:
            slot_OW = torch.full((capacity, 1), -1, dtype=torch.int64, device=device)
            weight_OW = weights_Tk.new_zeros(capacity, 1)
        row_TJ = pos_F.reshape(num_tokens, top_k)
    counts_D2 = torch.stack([rows_D, pairs_D], dim=1)
    return SendLayout(token_O=token_O, slot_OW=slot_OW.to(torch.int32), weight_OW=weight_OW, row_TJ=row_TJ, counts_D2=counts_D2)


def padded_layout(
    dest_Tk: torch.Tensor, local_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_devices: int, mode: str, group_tokens: int
) -> SendLayout:
    """The send layout of the "padded" exchange: each device gets a slot of `G = group_tokens` rows ("per_expert":
    `G * k`), `G >= T` the most tokens any rank of the group passes, and row i of every slot belongs to token i
    ("per_expert": to entry i = t * k + j) whether or not that token sends a row there. Nothing is compacted, so the
    layout is a few elementwise kernels over `device_match`'s `[D, T, k]` match: no scan, no scatter (a compacted
    slot cost about twice the operator calls). A position its token does not fill is a phantom (every slot -1,
    weight 0: no pair on the receiver); positions past this rank's T take token `T` (the zero row). `row_TJ` has D
    columns in "dedup" (the token's row for device d in column d, `C_O` where it sends none) and k in "per_expert"
    (each slot's one row).
    """
    check_mode(mode)
    num_tokens, top_k = dest_Tk.shape
    device = dest_Tk.device
    match = device_match(dest_Tk, num_devices, mode)
    slot_DTk = torch.where(match.match_DTk, local_Tk, -1).to(torch.int32)
    weight_DTk = torch.where(match.match_DTk, weights_Tk, 0.0)
    if group_tokens > num_tokens:  # the slots' last rows: phantoms past this rank's tokens
        slot_DTk = torch.nn.functional.pad(slot_DTk, (0, 0, 0, group_tokens - num_tokens), value=-1)
        weight_DTk = torch.nn.functional.pad(weight_DTk, (0, 0, 0, group_tokens - num_tokens))
    token_G = _arange(group_tokens, device, torch.int64).clamp(max=num_tokens)
    token_T = _arange(num_tokens, device, torch.int64)
    if mode == "dedup":
        width = top_k
        token_O = token_G.repeat(num_devices)
        row_DT = _arange(num_devices, device, torch.int64)[:, None] * group_tokens + token_T
        row_TJ = torch.where(match.hit_DT, row_DT, num_devices * group_tokens).t()
    else:
        width = 1
        token_O = token_G[:, None].expand(group_tokens, top_k).reshape(-1).repeat(num_devices)
        row_TJ = (dest_Tk * group_tokens + token_T[:, None]) * top_k + _arange(top_k, device, torch.int64)
    return SendLayout(
        token_O=token_O, slot_OW=slot_DTk.reshape(-1, width), weight_OW=weight_DTk.reshape(-1, width), row_TJ=row_TJ,
        counts_D2=match.counts_D2,
    )


def _place(pos, values, capacity: int, fill: int) -> torch.Tensor:
    """`[capacity]` int64: `values` written at `pos` (entries at `pos == capacity` land in a dropped slot), `fill` elsewhere."""
    out = torch.full((capacity + 1,), fill, dtype=torch.int64, device=pos.device)
    return out.scatter_(0, pos.reshape(-1), values.reshape(-1).long())[:capacity]


def received_pairs(slot_RW: torch.Tensor, num_pairs: int, num_local_experts: int):
    """`(segments, pick_N)` for received rows: pairs grouped by local expert (rows ascending within one), and
    `[N]` int64 positions in the flattened `[R * W]` routing block of each pair (so
    `torch.take(weight_RW, pick_N)` are the pair weights in segment order). `num_pairs` (N) is known on
    the host from the count exchange. One stable sort of all `R * W` slots (`expert_keys`: an empty slot,
    -1, sorts past the last expert) and the segment offsets by a binary search of the sorted keys: no
    compaction, no atomics, five kernels."""
    width = slot_RW.shape[1]
    key_F = expert_keys(slot_RW, num_local_experts)  # F = R * W entries
    key_sorted_F, order_F = torch.sort(key_F, stable=True)
    pick_N = order_F[:num_pairs]
    offsets = torch.searchsorted(key_sorted_F[:num_pairs], _arange(num_local_experts + 1, key_F.device, key_F.dtype))
    return ExpertSegments(pick_N // max(width, 1), offsets, slot_RW.shape[0]), pick_N


def expert_keys(slot_RW: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """`[R * W]` sort keys of the (row, slot) entries: the local slot, `L` for an empty slot (-1, by a remainder),
    so that empty slots sort after every expert. One byte per key while `L < 256`: the stable sort is a radix
    sort, which makes one pass over 8-bit keys and four over the slots' int32 (the key is then cast once)."""
    key_F = torch.remainder(slot_RW, num_local_experts + 1).reshape(-1)  # a strided view: no copy first
    return key_F.to(torch.uint8) if num_local_experts < 256 else key_F


def _arange(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`torch.arange(n)`, made once per (n, device, dtype) in eager: read only (an operator call saved per use). A
    traced graph makes its own: dynamo would trace through the cache anyway, with a warning to the user."""
    if torch.compiler.is_compiling():
        return torch.arange(n, device=device, dtype=dtype)
    return _cached_arange(n, device, dtype)


@functools.lru_cache(maxsize=64)
def _cached_arange(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(n, device=device, dtype=dtype)


@dataclass(frozen=True)
class DeviceMatch:
    """Which device serves each (token, slot), before the count exchange.

    Attributes:
        match_DTk: `[D, T, k]` bool, `dest_Tk == d`.
        hit_DT: `[D, T]` bool, the token has a row for device d ("dedup": any of its slots; None in "per_expert").
        counts_D2: `[D, 2]` int64 rows and (token, expert) pairs sent to each device.
    """

    match_DTk: torch.Tensor
    hit_DT: torch.Tensor | None
    counts_D2: torch.Tensor


def device_match(dest_Tk: torch.Tensor, num_devices: int, mode: str, counts_D2: torch.Tensor | None = None) -> DeviceMatch:
    """The `DeviceMatch` of `dest_Tk`: three or four kernels. `counts_D2` (optional `[D, 2]` int64): where to write
    the counts (e.g. the count exchange's send buffer, saving a copy)."""
    check_mode(mode)
    match_DTk = dest_Tk[None] == _arange(num_devices, dest_Tk.device, dest_Tk.dtype)[:, None, None]
    pairs_D = match_DTk.sum((1, 2))
    hit_DT = match_DTk.any(2) if mode == "dedup" else None
    rows_D = hit_DT.sum(1) if mode == "dedup" else pairs_D
    counts_D2 = torch.stack([rows_D, pairs_D], dim=1, out=counts_D2)
    return DeviceMatch(match_DTk, hit_DT, counts_D2)


@dataclass(frozen=True)
class PackedRows:
    """The `O` rows one group of tokens sends (the real rows of a `SendLayout`, nothing to fill).

    Attributes:
        token_O: `[O]` int64 source token of each row.
        slot_OW: `[O, W]` int64 local slot of the expert on the destination; -1 where that routing slot is
            served on another device.
        weight_OW: `[O, W]` routing weight (differentiable); 0 where the slot is -1.
        row_TJ: `[T, J]` int64 position **plus one** of each token's rows (J = D in "dedup" when D <= k, a
            token's row for device d in column d, else min(D, k) as in `SendLayout`; J = k in "per_expert");
            0 where the token has no such row: the rows come back into a block whose row 0 is zero.
    """

    token_O: torch.Tensor
    slot_OW: torch.Tensor
    weight_OW: torch.Tensor
    row_TJ: torch.Tensor


def packed_rows(match: DeviceMatch, local_Tk: torch.Tensor, weights_Tk: torch.Tensor, num_rows: int) -> PackedRows:
    """The `num_rows` (O, known on the host) rows of `match`'s tokens in `send_layout`'s order (by destination
    device, then token; "per_expert": then slot), with their fields: about ten kernels, no host read.
    `nonzero_static` of the `[D, T]` (or `[D, T * k]`) mask lists the rows in exactly that order; the running
    count of the same mask is each row's position."""
    match_DTk = match.match_DTk
    num_devices, num_tokens, top_k = match_DTk.shape
    if match.hit_DT is not None:  # "dedup": one row per (token, device)
        hit_DT = match.hit_DT
        row_O2 = torch.nonzero_static(hit_DT, size=num_rows)  # (device, token) of each row
        device_O, token_O = row_O2.unbind(1)
        token_O = token_O.contiguous()
        match_Ok = match_DTk[device_O, token_O]  # [O, k]
        slot_OW = torch.where(match_Ok, local_Tk[token_O], -1)
        weight_OW = torch.where(match_Ok, weights_Tk[token_O], 0.0)
        row_DT = torch.cumsum(hit_DT.view(-1), 0).view(num_devices, num_tokens) * hit_DT  # position + 1; 0: no row
        if num_devices <= top_k:
            row_TJ = row_DT.t()
        else:  # J = k < D columns: a token's j-th destination device in device order
            j_DT = torch.where(hit_DT, torch.cumsum(hit_DT, 0) - 1, top_k)
            row_TJ = torch.zeros(num_tokens, top_k + 1, dtype=torch.int64, device=hit_DT.device)
            row_TJ = row_TJ.scatter_(1, j_DT.t(), row_DT.t())[:, :top_k]
    else:  # "per_expert": one row per (token, slot), F = T * k entries
        match_DF = match_DTk.view(num_devices, num_tokens * top_k)
        entry_O = torch.nonzero_static(match_DF, size=num_rows)[:, 1].contiguous()
        token_O = entry_O // top_k
        slot_OW = local_Tk.reshape(-1)[entry_O][:, None]
        weight_OW = weights_Tk.reshape(-1)[entry_O][:, None]
        row_F = (torch.cumsum(match_DF.view(-1), 0).view(num_devices, -1) * match_DF).sum(0)  # one device each
        row_TJ = row_F.view(num_tokens, top_k)
    return PackedRows(token_O=token_O, slot_OW=slot_OW, weight_OW=weight_OW, row_TJ=row_TJ)


def local_pairs(local_Tk: torch.Tensor, num_local_experts: int, mode: str):
    """`(segments, pick_N)` in one process, where every expert is local: static sizes, no host read.

    "dedup": the rows are the tokens themselves (`R = T`), each served by its k pairs, so a token's
    experts are summed (in fp32) by the expert kernel. "per_expert": one row per (token, slot) in
    token-major order (`R = T * k`, row `t * k + j`), as the per-expert baseline sends them. `pick_N`
    indexes the flattened `[T * k]` routing weights, in segment order. The same grouping as
    `received_pairs` (every entry valid).
    """
    check_mode(mode)
    num_tokens, top_k = local_Tk.shape
    slot_RW = local_Tk if mode == "dedup" else local_Tk.reshape(-1, 1)
    return received_pairs(slot_RW, num_tokens * top_k, num_local_experts)


__all__ = [
    "DeviceMatch",
    "PackedRows",
    "SendLayout",
    "check_mode",
    "chunk_bounds",
    "destinations",
    "device_match",
    "expert_keys",
    "local_pairs",
    "packed_rows",
    "padded_layout",
    "received_pairs",
    "routing_width",
    "send_capacity",
    "send_layout",
]
