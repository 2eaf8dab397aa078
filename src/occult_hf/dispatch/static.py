"""Static-capacity dispatchers: no host synchronisation, CUDA-graph capturable ("symm_mem", "padded").

Shape legend: see `occult_hf.dispatch.plan`; in addition `C_O` rows of the send block and `C_R` rows
of the receive block (static capacities), `U` bytes of one packed row.

`AllToAllDispatcher` learns its split sizes on the host (one read per layer), so it can neither run
without a host synchronisation nor be captured in a CUDA graph. The dispatchers here size every
buffer from `T`, `k`, `D` and the mode alone, as DeepEP's low-latency mode does, and keep the
counts on the device:

- dedup: a device receives at most one row per (token, device) from each rank, so `C_R = D * T`;
  per_expert: at most `k` rows per token, `C_R = D * T * k`.
- Rows to send are laid out by destination device on the device (`_send_layout`); a position
  nobody fills is a *phantom* row: every routing slot -1, weight 0, and as activations the zero row
  appended to `x` (token index `T`), or in "padded", whose slot for device d holds row i for token i
  (`plan.padded_layout`), the token's own row where it sends none to d (the bytes travel either way).
- The received rows carry their routing slots; a row that is phantom, or beyond what its peer sent,
  has no valid slot. The (row, local expert) pairs are all `C_R * W` (row, slot) entries, the invalid
  ones sorted past the last local expert's segment (`expert_offsets[L]` is the valid count, known
  only on the device): the Triton expert kernels bound their grids by `N` and skip tiles past
  `expert_offsets[L]`, and rows served by no pair come out zero.
- The combine is the reverse exchange with the reverse counts; each token's rows are summed (fp32
  accumulation) through a gather of its rows (`SendLayout.row_TJ`), no atomics.

Two transports move the `[C_O, U]` send block:

- **"symm_mem"**: torch's symmetric memory over NVSHMEM, `torch.ops.symm_mem.all_to_all_vdev`: the
  split sizes stay in device memory and the kernels that move the rows are launched by the device
  (the receiver pulls exactly what each peer sent). Rows are packed by destination (`C_O = T *
  min(D, k)` dedup, `T * k` per_expert). Two sets of symmetric buffers per row width alternate, so
  that a rank never overwrites a send buffer that a peer may still read (the op's own barrier
  separates uses of one set).
- **"padded"**: one `all_to_all_single` with equal splits over any `torch.distributed` backend
  (NCCL, gloo): each destination gets a fixed slot of `C_R / D` rows whether full or not. It sends
  more bytes than needed at large T, and nothing extra at decode sizes; it needs no NVSHMEM.

Both produce the same function as the other dispatchers (same pairs, same fp32 combine), with
gradients through a reverse exchange of the same static sizes.

Set-up for "symm_mem" (what a first probe got wrong, "Detected use of TeamManager on multiple
devices"): each rank binds its GPU with `torch.cuda.set_device(local_rank)` before anything touches
CUDA or allocates symmetric memory, and the NVSHMEM backend is chosen before the first symmetric
allocation of the process (`symm_mem.set_backend("NVSHMEM")`, done here on first use). Every rank
must pass the same number of tokens per forward (the symmetric buffers are sized from it, like
DeepEP's `num_max_dispatch_tokens_per_rank`); a larger T allocates larger buffers on all ranks.

The capacities' T is the most tokens any rank passes (`StaticDispatcher.group_tokens`: agreed host to host over
the EP ranks' gloo group where `apply_occult` made one, else each rank's own, which must then be equal).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from occult_hf.kernels.layout import ExpertSegments

from .base import DispatchPlan, Dispatched, RowFormat, TokenDispatcher, dispatch_format, register_dispatcher, sum_token_rows
from .base import ExchangeError, check_stamps, exchange_start_error, exchange_timeout_error, gradient_format, pack_gradients
from .plan import SendLayout, _arange, expert_keys, padded_layout, routing_width, send_layout

#: symmetric row widths are padded to a multiple of this many bytes, and buffers hold at least
#: `MIN_BUFFER_BYTES`: the all-to-all-v kernel launches min(ceil(buffer bytes / 64 KiB), 64) blocks,
#: splits each peer's bytes evenly over its `blocks / D` blocks and asserts that the division is exact
#: (torch 2.11), so with 64 blocks every peer's bytes must divide by 64 / D
_ROW_ALIGN = 64
MIN_BUFFER_BYTES = 64 * 64 * 1024


def row_align(num_devices: int) -> int:
    return math.lcm(_ROW_ALIGN, max(64 // num_devices, 1))


@dataclass(frozen=True)
class StaticPlan(DispatchPlan):
    """`DispatchPlan` of a static dispatcher: the layout lives on the device.

    Attributes (beyond `DispatchPlan`):
        token_O: `[C_O]` int64 source token of each send-block row (`T`, the zero row, for a phantom past the tokens).
        send_counts_D: `[D]` int64 rows sent to each device (device memory).
        recv_counts_D: `[D]` int64 rows received from each device ("symm_mem"), None ("padded").
        row_TJ: `[T, J]` int64 send-block rows of each token (`C_O` where absent), see `plan.SendLayout`.
    """

    token_O: torch.Tensor | None = None
    send_counts_D: torch.Tensor | None = None
    recv_counts_D: torch.Tensor | None = None
    row_TJ: torch.Tensor | None = None


class StaticDispatcher(TokenDispatcher):
    """Common plan and autograd of the static dispatchers; subclasses provide the transport."""

    #: "packed": rows to device d start at the exclusive prefix sum of the counts; "padded": at d * C_R / D
    row_layout: ClassVar[str] = "packed"
    graph_capturable = True

    # ----- capacities ----------------------------------------------------------------------------
    def per_peer_capacity(self, group_tokens: int, top_k: int) -> int:
        """Most rows one rank can send to one device, when no rank has more than `group_tokens` tokens."""
        return group_tokens if self.mode == "dedup" else group_tokens * top_k

    def recv_capacity(self, group_tokens: int, top_k: int) -> int:
        """`C_R`."""
        return self.ep.num_devices * self.per_peer_capacity(group_tokens, top_k)

    def group_tokens(self, num_tokens: int, row_format: RowFormat) -> int:
        """The most tokens any rank of the group passes to this layer now: the static capacities' T.

        Agreed over `ep.host_group` (a gloo group of the same ranks, made by `apply_occult`): a host-to-host
        all-gather of each rank's T and row format (`RowFormat.stamp`: ranks whose rows differ, a model cast apart,
        fail here naming both formats, `check_stamps`), bounded by the exchange timeout, which waits for the peers'
        hosts to reach this layer but for no device work (nothing drains from the GPU's queue). So ranks may pass
        different T (the last batch, per-rank dynamic padding). Without a host group, and inside a CUDA graph capture
        (whose replays could not repeat it: a captured step's sizes are fixed on every rank alike), each rank's own T,
        which must then be the same on every rank, and no format check.
        """
        host_group = self.ep.host_group
        if host_group is None or torch.compiler.is_compiling():  # a traced graph's sizes are its own
            return num_tokens
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return num_tokens
        stamp = row_format.stamp()
        what = "agreement on the most tokens per rank (the static capacities)"
        rows = _gather_on_host([num_tokens, *stamp], host_group, self.timeout_s, self.layer, what)
        check_stamps(self.layer, [row[1:] for row in rows], stamp)
        return max(row[0] for row in rows)

    # ----- the interface -------------------------------------------------------------------------
    def dispatch(self, x_TH: torch.Tensor, routing) -> Dispatched:
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        num_tokens, top_k = ids_Tk.shape
        hidden = x_TH.shape[1]
        row_format = dispatch_format(hidden, x_TH.dtype, routing_width(self.mode, top_k), weights_Tk.dtype)
        group_tokens = self.group_tokens(num_tokens, row_format)
        dest_Tk, local_Tk = self.destinations_of(routing)
        layout = self._send_layout(dest_Tk, local_Tk, weights_Tk, group_tokens)
        counts_D2 = layout.counts_D2
        send_counts_D = counts_D2[:, 0].contiguous()
        token_O, slot_OW, weight_OW = layout.token_O, layout.slot_OW, layout.weight_OW
        x_pad_TH = torch.cat([x_TH, x_TH.new_zeros(1, hidden)])  # row T: the phantom rows' source
        x_OH = x_pad_TH[token_O]
        capacity_R = self.recv_capacity(group_tokens, top_k)
        x_RH, slot_RW, weight_RW, recv_counts_D = _StaticDispatchExchange.apply(
            x_OH, weight_OW, slot_OW, self, row_format, send_counts_D, capacity_R
        )
        if recv_counts_D is not None:  # rows past what each peer sent are stale buffer contents
            slot_RW = torch.where(_received_mask(recv_counts_D, capacity_R)[:, None], slot_RW, -1)
        segments, pick_N = _static_pairs(slot_RW, self.num_local_experts)
        plan = StaticPlan(
            mode=self.mode,
            num_tokens=num_tokens,
            counts_D2=counts_D2,
            row_bytes=row_format.row_bytes,
            ep=self.ep,
            layer=self.layer,
            token_O=token_O,
            send_counts_D=send_counts_D,
            recv_counts_D=recv_counts_D,
            row_TJ=layout.row_TJ,
        )
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=torch.take(weight_RW, pick_N), plan=plan)

    def combine(self, out_RH: torch.Tensor, plan: StaticPlan) -> torch.Tensor:
        out_OH = _StaticCombineExchange.apply(out_RH, self, plan.send_counts_D, plan.recv_counts_D, plan.token_O.shape[0])
        out_pad_OH = torch.cat([out_OH, out_OH.new_zeros(1, out_OH.shape[1])])  # row C_O: where absent rows point
        return sum_token_rows(out_pad_OH, plan.row_TJ)

    # ----- the plan on the device ----------------------------------------------------------------
    def _send_layout(self, dest_Tk, local_Tk, weights_Tk, group_tokens: int) -> SendLayout:
        """The `C_O`-row send layout: `plan.padded_layout` (a slot of `per_peer_capacity` rows per device) or
        `plan.send_layout` (packed)."""
        if self.row_layout == "padded":
            return padded_layout(dest_Tk, local_Tk, weights_Tk, self.ep.num_devices, self.mode, group_tokens)
        return send_layout(dest_Tk, local_Tk, weights_Tk, self.ep.num_devices, self.mode)

    # ----- the transport -------------------------------------------------------------------------
    def exchange(self, block: torch.Tensor, counts_D: torch.Tensor, out_rows: int, agree: list[int] | None = None):
        """Move the rows of `[rows, U]` uint8 `block` (`counts_D[d]` rows for device d, laid out as
        `row_layout` says); returns `([out_rows, U] received block, [D] received counts or None)`. `agree`: the
        row format's stamp, in the forward dispatch of a step whose capacities no agreement sized (`group_tokens`
        under compile): first check that every rank has the same `out_rows` and format, where the transport can."""
        raise NotImplementedError


def _received_mask(recv_counts_D: torch.Tensor, capacity: int) -> torch.Tensor:
    """`[C_R]` bool: the rows of a packed receive block that peers filled in this exchange."""
    return torch.arange(capacity, device=recv_counts_D.device) < recv_counts_D.sum()


def _static_pairs(slot_RW: torch.Tensor, num_local_experts: int) -> tuple[ExpertSegments, torch.Tensor]:
    """`(segments, pick_N)` over all `N = R * W` (row, slot) entries: valid pairs grouped by local expert
    (rows ascending), invalid ones after `expert_offsets[L]` with row `R` (outside every row's range).
    The same sort as `plan.received_pairs` (`plan.expert_keys`: an empty slot, -1, keyed `L`), over all entries
    since the valid count is known only on the device."""
    num_rows, width = slot_RW.shape
    key_N = expert_keys(slot_RW, num_local_experts)
    key_sorted_N, order_N = torch.sort(key_N, stable=True)
    offsets = torch.searchsorted(key_sorted_N, _arange(num_local_experts + 1, key_N.device, key_N.dtype))
    pair_row_N = torch.where(key_sorted_N < num_local_experts, order_N // max(width, 1), num_rows)
    return ExpertSegments(pair_row_N, offsets, num_rows), order_N


class _StaticDispatchExchange(torch.autograd.Function):
    """Rows and their routing metadata in one exchange; backward: the packed gradients back the same way."""

    @staticmethod
    def forward(ctx, x_OH, weight_OW, slot_OW, dispatcher: StaticDispatcher, row_format: RowFormat, send_counts_D, capacity_R):
        # traced: each rank's own T sized the capacities (`group_tokens`), which the exchange checks with the format
        agree = list(row_format.stamp()) if torch.compiler.is_compiling() else None
        block_RU, recv_counts_D = dispatcher.exchange(
            row_format.pack(x_OH, slot_OW, weight_OW), send_counts_D, capacity_R, agree=agree
        )
        x_RH, slot_RW, weight_RW = row_format.unpack(block_RU)
        ctx.dispatcher, ctx.row_format, ctx.rows_O = dispatcher, row_format, x_OH.shape[0]
        ctx.recv_counts_D = recv_counts_D
        ctx.set_materialize_grads(False)  # no zeros for the slots' and counts' gradients
        ctx.mark_non_differentiable(slot_RW)
        if recv_counts_D is not None:
            ctx.mark_non_differentiable(recv_counts_D)
        return x_RH, slot_RW, weight_RW, recv_counts_D

    @staticmethod
    def backward(ctx, grad_x_RH, _grad_slot, grad_weight_RW, _grad_counts):
        grads = gradient_format(ctx.row_format)
        some = grad_x_RH if grad_x_RH is not None else grad_weight_RW
        block = pack_gradients(grads, some.shape[0], grad_x_RH, grad_weight_RW, some.device)
        back, _ = ctx.dispatcher.exchange(block, ctx.recv_counts_D, ctx.rows_O)
        grad_x_OH, grad_weight_OW = grads.unpack(back)
        return grad_x_OH, grad_weight_OW, None, None, None, None, None


class _StaticCombineExchange(torch.autograd.Function):
    """The pre-summed rows back to their senders; backward sends the output gradients the other way."""

    @staticmethod
    def forward(ctx, out_RH, dispatcher: StaticDispatcher, send_counts_D, recv_counts_D, rows_O: int):
        ctx.dispatcher, ctx.send_counts_D, ctx.rows_R = dispatcher, send_counts_D, out_RH.shape[0]
        back, _ = dispatcher.exchange(_as_bytes(out_RH), recv_counts_D, rows_O)
        return back.view(out_RH.dtype)

    @staticmethod
    def backward(ctx, grad_OH):
        there, _ = ctx.dispatcher.exchange(_as_bytes(grad_OH.contiguous()), ctx.send_counts_D, ctx.rows_R)
        return there.view(grad_OH.dtype), None, None, None, None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ----- "padded": one equal-split all_to_all_single ---------------------------------------------
@register_dispatcher
class PaddedDispatcher(StaticDispatcher):
    """Static capacity over any `torch.distributed` backend: each destination gets `C_R / D` rows."""

    name = "padded"
    priority = 1
    row_layout = "padded"

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return ep.is_distributed

    def exchange(self, block, counts_D, out_rows, agree=None):
        check = agree is not None and self.ep.host_group is not None
        exchanged = torch.ops.occult.exchange_equal_splits(
            block.contiguous(), out_rows, self.ep.group.group_name, self.ep.host_group.group_name if check else "",
            agree if check else [], self.timeout_s, self.layer,
        )  # fmt: skip
        return exchanged, None


@torch.library.custom_op("occult::exchange_equal_splits", mutates_args=())
def _exchange_equal_splits(
    block_OU: torch.Tensor, out_rows: int, group_name: str, host_group_name: str, stamp: list[int], timeout_s: float,
    layer: str,
) -> torch.Tensor:
    """`[out_rows, U]`: rank r's `block_OU` rows `[d * O/D, (d + 1) * O/D)` go to rank d (one `all_to_all_single`
    over the process group named `group_name`). An operator, so that a compiled graph holds the exchange whole
    (its fake gives the static shape) instead of breaking at the collective. CPU rows (gloo) wait at most
    `timeout_s` on the host, else an `ExchangeError` naming `layer`; CUDA rows wait on the stream (the flat exchange's
    rule, `TokenDispatcher._wait`). With `host_group_name` (a gloo group of the same ranks), the ranks first compare
    their `out_rows` and row format (`stamp`) there (`_check_equal_capacity`)."""
    if host_group_name and not (block_OU.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_equal_capacity(out_rows, stamp, _resolve_process_group(host_group_name), timeout_s, layer)
    out_RU = block_OU.new_empty((out_rows, block_OU.shape[1]))
    work = dist.all_to_all_single(out_RU, block_OU, group=_resolve_process_group(group_name), async_op=True)
    try:
        work.wait(**({} if block_OU.is_cuda else {"timeout": timedelta(seconds=timeout_s)}))
    except RuntimeError as error:
        raise exchange_timeout_error(layer, "padded exchange", timeout_s, error) from error
    return out_RU


@_exchange_equal_splits.register_fake
def _(
    block_OU: torch.Tensor, out_rows: int, group_name: str, host_group_name: str, stamp: list[int], timeout_s: float,
    layer: str,
) -> torch.Tensor:
    return block_OU.new_empty((out_rows, block_OU.shape[1]))


def _gather_on_host(values: list[int], host_group, timeout_s: float, layer: str, what: str) -> list[list[int]]:
    """Every rank's `values` (ints), all-gathered over the ranks' gloo group `host_group`: host to host, no device
    synchronisation; `ExchangeError` naming `layer` and `what` when it cannot start or outlives `timeout_s`."""
    mine = torch.tensor(values, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(host_group))]
    try:
        work = dist.all_gather(every, mine, group=host_group, async_op=True)
    except RuntimeError as error:
        raise exchange_start_error(layer, what, error) from error
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise exchange_timeout_error(layer, what, timeout_s, error) from error
    return torch.stack(every).tolist()


def _check_equal_capacity(out_rows: int, stamp: list[int], host_group, timeout_s: float, layer: str) -> None:
    """Raise on every rank unless all pass the same receive capacity and row format, before the equal-split exchange:
    a compiled step sizes it from the rank's own token count, and ranks whose counts differ would post exchanges of
    different sizes, which gloo answers by aborting the process and NCCL by reading past the rows sent. The
    capture of a CUDA graph skips it (its replays could not repeat it)."""
    gathered = _gather_on_host([out_rows, *stamp], host_group, timeout_s, layer, "check of the compiled step's capacities")
    check_stamps(layer, [row[1:] for row in gathered], stamp)
    rows = [row[0] for row in gathered]
    if len(set(rows)) > 1:
        raise ExchangeError(
            f"{layer}: a compiled forward under expert parallelism needs the same number of tokens on every EP rank "
            f"(its exchange is sized from the rank's own count when traced), but the ranks' capacities differ: "
            f"{rows} rows; pad every rank's batch to one shape (equal batch sizes, a fixed max_length or "
            f"pad_to_multiple_of, drop_last), or run the model eagerly, where ranks may pass different counts"
        )


# ----- "symm_mem": NVSHMEM all-to-all-v with the splits in device memory -------------------------
@functools.lru_cache(maxsize=1)
def nvshmem_usable() -> bool:
    """Whether this torch build has NVSHMEM symmetric memory and a CUDA device to use it on."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        return bool(symm_mem.is_nvshmem_available()) and hasattr(torch.ops.symm_mem, "all_to_all_vdev")
    except (ImportError, AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def vdev_takes_in_out_splits() -> bool:
    """Older torch: `all_to_all_vdev(input, out, in_out_splits[3, D], group)`; newer: separate `in_splits[D]`
    and `out_splits_offsets[2, D]`."""
    return len(torch.ops.symm_mem.all_to_all_vdev.default._schema.arguments) == 4


def all_to_all_vdev(send, recv, in_splits_D, out_splits, group_name: str) -> torch.Tensor:
    """`torch.ops.symm_mem.all_to_all_vdev` on symmetric tensors, either signature: rows `in_splits_D[d]` of
    `send` go to rank d; returns the `[D]` rows received from each rank (a view of `out_splits`)."""
    if vdev_takes_in_out_splits():  # out_splits is [3, D]: input splits, output splits, output offsets
        out_splits[0].copy_(in_splits_D)
        torch.ops.symm_mem.all_to_all_vdev(send, recv, out_splits, group_name)
        return out_splits[1]
    torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits_D, out_splits, group_name)
    return out_splits[0]


class _SymmetricBuffers:
    """Two alternating sets of symmetric buffers for one (rows, row width): `[rows, U]` uint8 in/out, `[D]`
    int64 input splits and the op's `[2, D]` output splits and offsets (`[3, D]` in/out splits, older torch)."""

    def __init__(self, rows: int, width: int, num_devices: int, group_name: str, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.sets = []
        for _ in range(2):
            tensors = (
                symm_mem.empty(rows, width, dtype=torch.uint8, device=device),
                symm_mem.empty(rows, width, dtype=torch.uint8, device=device),
                symm_mem.empty(num_devices, dtype=torch.int64, device=device),  # input splits
                symm_mem.empty(3 if vdev_takes_in_out_splits() else 2, num_devices, dtype=torch.int64, device=device),
            )
            for tensor in tensors:
                symm_mem.rendezvous(tensor, group_name)
            self.sets.append(tensors)
        self.uses = 0

    def next(self):
        self.uses += 1
        return self.sets[self.uses % 2]


#: symmetric buffers of the process, by (group name, device, rows, padded row width): shared by every
#: layer, since each exchange finishes (on the stream) before the next layer's begins
_BUFFERS: dict[tuple, _SymmetricBuffers] = {}


def release_symmetric_buffers() -> None:
    """Drop the cached symmetric buffers (every rank must call it at the same point: frees are collective)."""
    _BUFFERS.clear()


def ensure_nvshmem_backend(device: torch.device) -> None:
    """Choose NVSHMEM for this process's symmetric memory (torch's default is its own "CUDA" backend, which
    has no all-to-all-v); possible only before the process's first symmetric allocation."""
    from torch.distributed import _symmetric_memory as symm_mem

    if symm_mem.get_backend(device) == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as error:
        raise RuntimeError(
            f"OccultConfig.dispatcher='symm_mem' needs the NVSHMEM symmetric-memory backend, but this process "
            f"already uses backend {symm_mem.get_backend(device)!r} (chosen at its first symmetric allocation): {error}"
        ) from error


@register_dispatcher
class SymmMemDispatcher(StaticDispatcher):
    """Device-initiated all-to-all-v over NVSHMEM symmetric memory (`torch.ops.symm_mem.all_to_all_vdev`)."""

    name = "symm_mem"
    priority = 5  # below "all_to_all" until measurements say otherwise (docs/bench_ep_h200_2gpu.md)
    row_layout = "packed"

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return (
            ep.is_distributed
            and (device is None or torch.device(device).type == "cuda")
            and "nccl" in str(dist.get_backend(ep.group))
            and nvshmem_usable()
        )

    def exchange(self, block, counts_D, out_rows, agree=None):  # `agree` unchecked: see docs/runtime.md
        device = block.device
        if torch.cuda.current_device() != device.index:
            raise RuntimeError(
                f"{self.layer}: dispatcher 'symm_mem' got tensors on {device} but the current CUDA device is "
                f"{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) before anything else "
                f"(NVSHMEM binds one device per process)"
            )
        rows_in, width = block.shape
        align = row_align(self.ep.num_devices)
        padded = -(-width // align) * align
        rows = max(rows_in, out_rows, -(-MIN_BUFFER_BYTES // padded))
        group_name = self.ep.group.group_name
        key = (group_name, device, rows, padded)
        buffers = _BUFFERS.get(key)
        if buffers is None:
            ensure_nvshmem_backend(device)
            enable_group(group_name)
            buffers = _BUFFERS[key] = _SymmetricBuffers(rows, padded, self.ep.num_devices, group_name, device)
        send, recv, in_splits, out_splits = buffers.next()
        send[:rows_in, :width].copy_(block)
        in_splits.copy_(counts_D)
        received_D = all_to_all_vdev(send, recv, in_splits, out_splits, group_name)
        return recv[:out_rows, :width].clone(), received_D.clone()


def enable_group(group_name: str) -> None:
    """Older torch needs symmetric memory enabled per group (newer ones deprecate the call as a no-op)."""
    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)


__all__ = [
    "PaddedDispatcher",
    "StaticDispatcher",
    "StaticPlan",
    "SymmMemDispatcher",
    "all_to_all_vdev",
    "nvshmem_usable",
    "release_symmetric_buffers",
]
