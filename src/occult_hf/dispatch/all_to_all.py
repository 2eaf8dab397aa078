"""`AllToAllDispatcher` ("all_to_all"): all-to-all-v over `torch.distributed` (NCCL on GPUs, gloo on CPU).

Shape legend: see `occult_hf.dispatch.plan`; in addition X the entries of one rank's count message
(rows and pairs of each chunk, then the chunk count: `2 * max_chunks + 1`; then the row format's stamp, S entries).

Per layer and forward:
1. **Counts** on the tokens' device (`plan.device_match`: which device serves each (token, slot), and
   the rows and pairs per device, written straight into the count message): four kernels.
2. **Count exchange**: one small all-to-all of the `[D, 2]` row/pair counts (with C > 1 chunks, every
   chunk's, and each rank's chunk count, so ranks with different T agree on C) and of the sender's row format
   (`RowFormat.stamp`: dtypes and widths; ranks whose rows differ fail here, naming the formats), copied to pinned host
   memory behind it and read once (the layer's only host synchronisation: the split sizes; the host
   spins on that copy's event rather than `Work.wait(timeout)`, which sleeps in 1 ms steps).
   Then the send layout with the row count known (`plan.packed_rows`: rows by destination device, then
   token; each row's local slots and routing weights; each token's row positions): about ten kernels,
   no atomics, nothing padded to a capacity.
3. **Exchange**: the rows gathered straight into a packed uint8 block (`RowFormat`: activations, slots,
   weights; one `index_select` into the block, no intermediate copy) and sent in ONE
   `all_to_all_single`. Work that needs no exchange (the shared experts, `run(concurrent=...)`) is
   queued right behind the count exchange's copy to the host (step 2): the GPU runs it while the host waits
   for the counts and then issues the layout, the pack and the exchange, instead of idling there. The receiver groups the (row, local expert) pairs by expert (one
   sort of N keys); the experts take the received rows as a view of the block. The pre-summed outputs return in
   one more `all_to_all_single`, into a buffer whose row 0 is zero, and each token's rows are
   summed by a gather through its row positions (fp32 accumulation, fixed order, no atomics).
   With C > 1 chunks all chunks' dispatch exchanges are issued first, then chunk c's experts run while
   later chunks' dispatch and earlier chunks' combine are on the wire.
4. **Backward**: the output gradient gathered per row and sent in one exchange, the experts' backward,
   the row and routing-weight gradients packed in one reverse exchange and summed per token by the same
   gather. With one chunk these are three autograd nodes (dispatch, experts, combine); with several, one
   node for the pipeline, whose experts' parameter gradients accumulate through a nested (reentrant)
   autograd call, as in reentrant activation checkpointing.
Activation checkpointing (non-reentrant, and reentrant) recomputes the layer, exchanges included, on
every rank alike; a second backward through one chunked forward (`retain_graph=True`) is refused with
an error.

**Bounded waits.** Every wait on a peer finishes or fails within the exchange timeout (`base.resolve_timeout`)
with an `ExchangeError` naming the layer and the operation. The count exchange, which every rank reaches at every
layer before any row moves, always waits with that bound on the host (on CUDA by spinning on the copy's event), so a
stalled, dead or desynchronised peer is reported there. Row exchanges of CPU tensors (gloo) also wait with the
bound; on CUDA they only make the compute stream wait for the communication stream (a host wait would cost the
overlap), and a peer that dies in the middle of one is caught by the process group's own timeout (NCCL watchdog).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .base import (
    DEFAULT_CHUNKS,
    DispatchPlan,
    Dispatched,
    ExchangeError,
    ExpertsFn,
    RowFormat,
    TokenDispatcher,
    check_stamps,
    dispatch_format,
    gradient_format,
    pack_gradients,
    register_dispatcher,
    stage,
    sum_token_rows,
)
from .plan import chunk_bounds, device_match, packed_rows, received_pairs, routing_width
from .static import PaddedDispatcher


@dataclass(frozen=True)
class _Chunk:
    """One chunk's plan on this rank: tokens `[start, end)`, its `O` rows (sliced from the send layout) and
    split sizes.

    Attributes:
        token_O: `[O]` int64 source token of each row, relative to `start`.
        slot_OW: `[O, W]` int64 local slots on the destination (-1: served elsewhere).
        weight_OW: `[O, W]` routing weights (differentiable).
        row_TJ: `[end - start, J]` int64 position plus one of each token's rows, 0 where it has fewer: the
            rows come back into a block whose row 0 is zero (`plan.PackedRows`).
        dest_Tk: `[T, k]` int64 device serving each pair, for a chunk of every token (None otherwise): where
            the routing weights' gradient is gathered from (`_pair_weight_grads`).
        num_pairs: (row, local expert) pairs the received rows carry here; None where the received rows are
            forwarded, not computed (the hierarchical exchange's inter-node hop).
        group: the process group the rows travel in (None: the EP group; the hierarchical exchange's hops: its rail
            and node subgroups), `send_splits` and `recv_splits` indexed by its ranks.
        hop: names the hop in error messages ("" in the flat exchange, e.g. "inter-node " in the hierarchical one).
    """

    start: int
    end: int
    token_O: torch.Tensor
    slot_OW: torch.Tensor
    weight_OW: torch.Tensor
    row_TJ: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_pairs: int | None
    dest_Tk: torch.Tensor | None = None
    group: Any = None
    hop: str = ""

    @property
    def num_rows(self) -> int:
        return sum(self.send_splits)


@dataclass(frozen=True)
class AllToAllPlan(DispatchPlan):
    """`DispatchPlan` of "all_to_all" with the one chunk `dispatch()` made (what `combine()` needs)."""

    chunk: _Chunk | None = None


@register_dispatcher
class AllToAllDispatcher(TokenDispatcher):
    name = "all_to_all"
    priority = 10
    overlaps_chunks = True

    def __init__(self, ep, layout, settings, label=None) -> None:
        super().__init__(ep, layout, settings, label)
        # under torch.compile the exchange takes static capacities: the split sizes this one reads on the host
        # would end the traced graph at every layer (the outputs are the same; more rows travel)
        self._traced = PaddedDispatcher(ep, layout, settings, label)

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return ep.is_distributed

    # ----- the interface ---------------------------------------------------------------------
    def dispatch(self, x_TH: torch.Tensor, routing, concurrent=None) -> Dispatched:
        row_format = self._row_format(x_TH, routing)
        (chunk,), counts_D2 = self._plan(routing, row_format, num_chunks=1, max_chunks=1, concurrent=concurrent)
        weights, direct = weights_to_send(chunk, routing.topk_weights_Tk, self.mode, self.ep.num_devices)
        x_RH, slot_RW, weight_RW = self._send_rows(x_TH, chunk, row_format, weights, direct)
        with stage("received layout"):
            segments, pick_N = received_pairs(slot_RW, chunk.num_pairs, self.num_local_experts)
            pair_weight_N = torch.take(weight_RW, pick_N)
        plan = self._result_plan(routing, [chunk], counts_D2, row_format, chunk=chunk)
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=pair_weight_N, plan=plan)

    def combine(self, out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return _CombineExchange.apply(out_RH, self, plan.chunk)

    def run(self, x_TH: torch.Tensor, routing, experts: ExpertsFn, concurrent=None) -> tuple[torch.Tensor, DispatchPlan]:
        """Dispatch, experts and combine; with C > 1 chunks, the exchange of one overlapping the experts of another.
        `concurrent` (see `TokenDispatcher.run`) is issued behind the count exchange (`_plan`). Compiled, the
        static-capacity exchange of "padded" runs instead (see `__init__`)."""
        if torch.compiler.is_compiling():
            return self._traced.run(x_TH, routing, experts, concurrent)
        num_chunks = self.chunks or DEFAULT_CHUNKS
        if num_chunks == 1:  # three autograd nodes: the exchanges' backward runs in the reverse order by itself
            sent = self.dispatch(x_TH, routing, concurrent)
            with stage("experts"):
                out_RH = experts(sent.x_RH, sent.segments, sent.pair_weight_N)
            return self.combine(out_RH, sent.plan), sent.plan
        row_format = self._row_format(x_TH, routing)
        chunks, counts_D2 = self._plan(routing, row_format, num_chunks, num_chunks, concurrent=concurrent)
        weights = [chunk.weight_OW for chunk in chunks]
        grad = torch.is_grad_enabled()
        params = [p for p in _parameters_of(experts) if p.requires_grad] if grad else []
        track = grad and (bool(params) or x_TH.requires_grad or any(w.requires_grad for w in weights))
        pipeline = _Pipeline(self, chunks, row_format, experts, track=track)
        out_TH = _PipelineFunction.apply(pipeline, x_TH, len(weights), *weights, *params)
        return out_TH, self._result_plan(routing, chunks, counts_D2, row_format)

    def _send_rows(self, x_TH: torch.Tensor, chunk: "_Chunk", row_format: RowFormat, weights: torch.Tensor, direct: bool):
        """`(x_RH, slot_RW, weight_RW)`: `chunk`'s rows of `x_TH` packed, exchanged over its group and received as views
        of the received block, through `_DispatchExchange` (whose backward returns their gradients; `weights` and
        `direct` from `weights_to_send`)."""
        with stage("pack"):
            block = _pack_rows(row_format, x_TH, chunk)
        pending = self.exchange(block, chunk.send_splits, chunk.recv_splits, f"{chunk.hop}dispatch", group=chunk.group)
        return _DispatchExchange.apply(x_TH, weights, self, chunk, row_format, pending, direct)

    def _row_format(self, x_TH: torch.Tensor, routing) -> RowFormat:
        width = routing_width(self.mode, routing.topk_ids_Tk.shape[1])
        return dispatch_format(x_TH.shape[1], x_TH.dtype, width, routing.topk_weights_Tk.dtype)

    # ----- planning ------------------------------------------------------------------------------
    def _plan(self, routing, row_format: RowFormat, num_chunks: int, max_chunks: int, concurrent=None) -> tuple[list[_Chunk], torch.Tensor]:
        """Split the tokens into (at most) `num_chunks` chunks, count each chunk's rows per device on the device,
        agree with the group on the chunk count (at most `max_chunks`, the same on every rank) and on the row format,
        learn the split sizes (the one host read) and lay out each chunk's rows. Returns the chunks and the `[D, 2]`
        counts.

        `concurrent` (work that needs no exchange) is issued after the count exchange and its copy to the host are
        queued, before the host waits for them: the GPU computes it while the host waits instead of idling. Its
        kernels queue behind the copy, so they do not delay the counts."""
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        num_tokens = ids_Tk.shape[0]
        num_devices = self.ep.num_devices
        with stage("plan"):
            dest_Tk, local_Tk = self.destinations_of(routing)
            bounds = chunk_bounds(num_tokens, min(num_chunks, max_chunks))
            message = _CountMessage(num_devices, len(bounds), max_chunks, self._stamp(row_format, ids_Tk.device))
            matches = [
                device_match(dest_Tk[a:b], num_devices, self.mode, counts_D2=message.counts_D2(c)) for c, (a, b) in enumerate(bounds)
            ]
        splits, group_chunks = self._read_counts(message, concurrent)
        with stage("plan"):
            chunks = []
            for index, (send_splits, recv_splits, num_pairs) in enumerate(splits):
                if index < len(bounds):
                    (start, end), match = bounds[index], matches[index]
                else:  # a chunk the group runs beyond this rank's: empty, but it joins the group's exchanges
                    (start, end) = (num_tokens, num_tokens)
                    match = device_match(dest_Tk[:0], num_devices, self.mode)
                whole = (start, end) == (0, num_tokens)  # no slice: its backward would be one more kernel
                rows = packed_rows(
                    match, local_Tk if whole else local_Tk[start:end], weights_Tk if whole else weights_Tk[start:end], sum(send_splits)
                )
                chunks.append(
                    _Chunk(start, end, rows.token_O, rows.slot_OW, rows.weight_OW, rows.row_TJ, tuple(send_splits), tuple(recv_splits),
                           num_pairs, dest_Tk if whole else None)
                )  # fmt: skip
        counts_D2 = matches[0].counts_D2 if len(matches) == 1 else torch.stack([m.counts_D2 for m in matches]).sum(0)
        return chunks, counts_D2

    def _read_counts(self, message, concurrent=None):
        """`message.splits(...)` of the count exchange of `message` (a `_CountMessage`, or the hierarchical exchange's),
        read on the host: the layer's one host synchronisation. `concurrent` (work that needs no exchange) is issued
        once the exchange and its copy to the host are queued, before the host waits for them (see `_plan`)."""
        with stage("count exchange"):
            counts = self._exchange_counts(message)
        if concurrent is not None:
            with stage("concurrent"):
                concurrent()
        with stage("count exchange"):
            return counts.result()

    def _exchange_counts(self, message: "_CountMessage") -> "_PendingCounts":
        """Start one all-to-all of the count message (every chunk's row/pair counts per destination, plus this
        rank's chunk count when the group may run several); `.result()` reads it on the host (the layer's one
        host synchronisation) and returns per chunk `(send_splits, recv_splits, recv_pairs)` and the group's
        chunk count."""
        send_DX, recv_DX = message.both_2DX.unbind(0)
        work = self._collective("count exchange", dist.all_to_all_single, recv_DX, send_DX, group=self.ep.group, async_op=True)
        return _PendingCounts(self, work, message)

    def _stamp(self, row_format: RowFormat, device) -> tuple[tuple[int, ...], torch.Tensor]:
        """`row_format`'s stamp, on the host and as an `[S]` int64 tensor on `device` (kept per dispatcher: a count
        message copies it in, one small kernel, not one per entry)."""
        stamp = row_format.stamp()
        tensors = self.__dict__.setdefault("_stamps", {})
        key = (stamp, torch.device(device))
        if key not in tensors:
            tensors[key] = torch.tensor(stamp, dtype=torch.int64, device=device)
        return stamp, tensors[key]

    def _pinned(self, shape) -> torch.Tensor:
        """A pinned host buffer of `shape` (int64) for the count message, kept per dispatcher and shape."""
        buffers = self.__dict__.setdefault("_pinned_buffers", {})
        buffer = buffers.get(tuple(shape))
        if buffer is None:
            buffer = buffers[tuple(shape)] = torch.empty(tuple(shape), dtype=torch.int64, pin_memory=True)
        return buffer

    def _result_plan(self, routing, chunks, counts_D2, row_format: RowFormat, chunk: _Chunk | None = None) -> "AllToAllPlan":
        return AllToAllPlan(
            mode=self.mode,
            num_tokens=routing.topk_ids_Tk.shape[0],
            counts_D2=counts_D2,
            row_bytes=row_format.row_bytes,
            ep=self.ep,
            layer=self.layer,
            send_splits=tuple(map(sum, zip(*(c.send_splits for c in chunks)))),
            recv_splits=tuple(map(sum, zip(*(c.recv_splits for c in chunks)))),
            num_pairs=sum(c.num_pairs for c in chunks),
            chunk=chunk,
        )

    # ----- communication -----------------------------------------------------------------------
    def exchange(
        self, block: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str, zero_row: bool = False,
        group=None,
    ) -> "_Pending":
        """Start one `all_to_all_single` of `block`'s rows (split along dim 0) over `group` (None: the EP group);
        `.wait()` gives the received block, with one extra zero row **first** when `zero_row` (what a combine's gather
        points absent rows at: `_Chunk.row_TJ` counts from one)."""
        rows = sum(recv_splits)
        out = block.new_empty((rows + int(zero_row), *block.shape[1:]))
        if zero_row:
            out[0].zero_()
        block = block.contiguous()
        work = self._collective(
            what,
            dist.all_to_all_single,
            out[int(zero_row) :],
            block,
            output_split_sizes=list(recv_splits),
            input_split_sizes=list(send_splits),
            group=self.ep.group if group is None else group,
            async_op=True,
        )
        return _Pending(self, work, out, block, what, tuple(send_splits), tuple(recv_splits))


class _CountMessage:
    """The count exchange's buffer, `[2, D, X]` int64 (what this rank sends, then what it receives): with one
    chunk `X = 2 + S` (rows, pairs per destination); with up to `max_chunks` chunks, every chunk's two counts
    and then this rank's chunk count (`X = 2 * max_chunks + 1 + S`); last the S entries of the row format's stamp
    (`stamped`: its host tuple and device tensor, from `AllToAllDispatcher._stamp`), checked by `_PendingCounts`."""

    def __init__(self, num_devices: int, num_chunks: int, max_chunks: int, stamped: tuple[tuple[int, ...], torch.Tensor]) -> None:
        self.max_chunks = max_chunks
        self.stamp, stamp_S = stamped
        width, device = len(self.stamp), stamp_S.device
        if max_chunks == 1:
            self.both_2DX = torch.empty(2, num_devices, 2 + width, dtype=torch.int64, device=device)
        else:
            self.both_2DX = torch.zeros(2, num_devices, 2 * max_chunks + 1 + width, dtype=torch.int64, device=device)
            self.both_2DX[0, :, 2 * max_chunks] = num_chunks
        self.both_2DX[0, :, -width:] = stamp_S

    def counts_D2(self, chunk: int) -> torch.Tensor:
        """The `[D, 2]` slot of chunk `chunk`'s counts in the send half (written by `plan.device_match`)."""
        return self.both_2DX[0, :, 2 * chunk : 2 * chunk + 2]

    def splits(self, both: list) -> tuple[list, int]:
        """Per chunk `(send_splits, recv_splits, recv_pairs)` and the group's chunk count, from the host copy."""
        send, recv = both
        num_devices = len(send)
        group_chunks = 1 if self.max_chunks == 1 else max(row[2 * self.max_chunks] for row in recv)
        splits = [
            (
                tuple(send[p][2 * c] for p in range(num_devices)),
                tuple(recv[p][2 * c] for p in range(num_devices)),
                sum(recv[p][2 * c + 1] for p in range(num_devices)),
            )
            for c in range(group_chunks)
        ]
        return splits, group_chunks


class _PendingCounts:
    """The count exchange in flight. On CUDA its result is copied to pinned host memory behind the
    collective and the host spins on that copy's event (bounded by the timeout): `Work.wait(timeout)`
    would instead sleep in 1 ms steps, and a blocking `.tolist()` would also wait for every kernel
    queued after it. The pinned buffer is the dispatcher's own, reused: its result is read before the
    layer goes on."""

    def __init__(self, dispatcher: AllToAllDispatcher, work, message: _CountMessage) -> None:
        self.dispatcher, self.work, self.message = dispatcher, work, message
        self._result = None
        both = message.both_2DX
        if both.is_cuda:
            dispatcher._wait(work, "count exchange", on_host=False)  # the stream waits for the collective
            self.host = dispatcher._pinned(both.shape)
            self.host.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = None, None

    def result(self):
        if self._result is None:
            d = self.dispatcher
            if self.event is not None:
                deadline = time.monotonic() + d.timeout_s
                while not self.event.query():
                    if time.monotonic() > deadline:
                        raise d._timeout_error("count exchange", "timed out")
                both = self.host.tolist()
            else:
                d._wait(self.work, "count exchange", on_host=True)
                both = self.message.both_2DX.tolist()
            width = len(self.message.stamp)
            check_stamps(d.layer, [row[-width:] for row in both[1]], self.message.stamp)
            self._result = self.message.splits(both)
        return self._result


class _Pending:
    """A started exchange: `.wait()` returns the received block (keeps the send block alive until then)."""

    def __init__(self, dispatcher: AllToAllDispatcher, work, out: torch.Tensor, block: torch.Tensor, what: str, send_splits, recv_splits):
        self.dispatcher, self.work, self.out, self.block, self.what = dispatcher, work, out, block, what
        self.send_splits, self.recv_splits = send_splits, recv_splits

    def wait(self) -> torch.Tensor:
        self.dispatcher._wait(self.work, self.what, on_host=not self.out.is_cuda)
        self.block = None
        return self.out


def weights_to_send(chunk: _Chunk, weights_Tk: torch.Tensor, mode: str, num_destinations: int) -> tuple[torch.Tensor, bool]:
    """`(weights, direct)` for `_DispatchExchange`: the routing weights `[T, k]` themselves where each pair's row is
    known (`direct`: a chunk of every token, and one row per pair or at most k destinations), their gradient then
    gathered per pair from the returned rows (`_pair_weight_grads`); else the rows' `weight_OW`, whose backward
    through their `where` and index is a zero fill and an accumulating `index_put`."""
    top_k = weights_Tk.shape[1]
    direct = chunk.dest_Tk is not None and (mode == "per_expert" or num_destinations <= top_k)
    return (weights_Tk if direct else chunk.weight_OW), direct


def _pack_rows(row_format: RowFormat, x_TH: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """`[O, U]` uint8: each row's activations gathered straight into its field (one `index_select`, no
    intermediate copy), its local slots and routing weights beside them."""
    block = torch.empty(chunk.num_rows, row_format.row_bytes, dtype=torch.uint8, device=x_TH.device)
    view_x, view_slot, view_weight = row_format.unpack(block)
    torch.index_select(x_TH.detach()[chunk.start : chunk.end], 0, chunk.token_O, out=view_x)  # the gradient: `_DispatchExchange`
    view_slot.copy_(chunk.slot_OW)
    view_weight.copy_(chunk.weight_OW.detach())
    return block


class _DispatchExchange(torch.autograd.Function):
    """Rows and routing metadata in one exchange; backward: their gradients packed in one reverse exchange,
    each token's row gradients summed by a gather."""

    @staticmethod
    def forward(ctx, x_TH, weights, dispatcher: AllToAllDispatcher, chunk: _Chunk, row_format: RowFormat, pending: "_Pending", direct: bool):
        """`pending`: the exchange of the packed rows, already started (see `AllToAllDispatcher.dispatch`); `weights`:
        the routing weights `[T, k]` when `direct` (their gradient by `_pair_weight_grads`), else the rows'
        `weight_OW` (their gradient the returned rows'). Their values are in the packed rows already."""
        ctx.dispatcher, ctx.chunk, ctx.row_format, ctx.num_tokens, ctx.direct = dispatcher, chunk, row_format, x_TH.shape[0], direct
        ctx.set_materialize_grads(False)  # no zeros for the slots' gradient (nor an unused output's): packed as zeros
        with stage("dispatch exchange"):
            received = pending.wait()
        x_RH, slot_RW, weight_RW = row_format.unpack(received)
        ctx.mark_non_differentiable(slot_RW)
        return x_RH, slot_RW, weight_RW

    @staticmethod
    def backward(ctx, grad_x_RH, _grad_slot, grad_weight_RW):
        chunk = ctx.chunk
        grads = gradient_format(ctx.row_format)
        with stage("dispatch backward exchange"):
            device = (grad_x_RH if grad_x_RH is not None else grad_weight_RW).device
            block = pack_gradients(grads, sum(chunk.recv_splits), grad_x_RH, grad_weight_RW, device)
            back = ctx.dispatcher.exchange(
                block, chunk.recv_splits, chunk.send_splits, f"{chunk.hop}dispatch backward", zero_row=True, group=chunk.group
            ).wait()
        grad_x_pad_OH, grad_weight_pad_OW = grads.unpack(back)
        with stage("dispatch backward sum"):
            grad_x_TH = sum_token_rows(grad_x_pad_OH, chunk.row_TJ) if ctx.needs_input_grad[0] else None
            if not ctx.needs_input_grad[1]:
                grad_weights = None
            elif ctx.direct:
                grad_weights = _pair_weight_grads(grad_weight_pad_OW, chunk)
            else:
                grad_weights = grad_weight_pad_OW[1:]
        return grad_x_TH, grad_weights, None, None, None, None, None


def _pair_weight_grads(grad_weight_pad_OW: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """`[T, k]`: each (token, slot) pair's routing-weight gradient, read from the one returned row that carried
    the pair (row 0 of the block is zero, `row_TJ` counts from one): "per_expert" (W = 1) its row is `row_TJ`
    itself; "dedup" with D <= k (`row_TJ`'s column d is the token's row for device d) its row is
    `row_TJ[t, dest_Tk[t, j]]`, in column j. One or two gathers: no zero fill, no accumulation."""
    if grad_weight_pad_OW.shape[1] == 1:
        return grad_weight_pad_OW[:, 0][chunk.row_TJ]
    return grad_weight_pad_OW.gather(0, chunk.row_TJ.gather(1, chunk.dest_Tk))


class _CombineExchange(torch.autograd.Function):
    """The pre-summed rows back to their source ranks and each token's rows summed (fp32, by a gather); backward
    sends each row its token's output gradient (a gather) the other way."""

    @staticmethod
    def forward(ctx, out_RH, dispatcher: AllToAllDispatcher, chunk: _Chunk):
        ctx.dispatcher, ctx.chunk = dispatcher, chunk
        with stage("combine exchange"):
            back = dispatcher.exchange(out_RH, chunk.recv_splits, chunk.send_splits, f"{chunk.hop}combine", zero_row=True, group=chunk.group).wait()
        with stage("combine sum"):
            return sum_token_rows(back, chunk.row_TJ)

    @staticmethod
    def backward(ctx, grad_TH):
        chunk = ctx.chunk
        with stage("combine backward exchange"):
            grad_OH = grad_TH.index_select(0, chunk.token_O)
            back = ctx.dispatcher.exchange(grad_OH, chunk.send_splits, chunk.recv_splits, f"{chunk.hop}combine backward", group=chunk.group)
            return back.wait(), None, None


class _Pipeline:
    """State of one chunked dispatch -> experts -> combine, shared by `_PipelineFunction`'s forward and backward."""

    def __init__(self, dispatcher: AllToAllDispatcher, chunks: list[_Chunk], row_format: RowFormat, experts: ExpertsFn, track: bool):
        self.dispatcher, self.chunks, self.row_format, self.experts, self.track = dispatcher, chunks, row_format, experts, track
        self.saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.device = None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        d = self.dispatcher
        self.device = x_TH.device
        dispatches = [
            d.exchange(_pack_rows(self.row_format, x_TH, c), c.send_splits, c.recv_splits, f"dispatch of chunk {i}")
            for i, c in enumerate(self.chunks)
        ]
        combines = []
        for i, (chunk, pending) in enumerate(zip(self.chunks, dispatches)):
            x_RH, slot_RW, weight_RW = self.row_format.unpack(pending.wait())
            segments, pick_N = received_pairs(slot_RW, chunk.num_pairs, d.num_local_experts)
            if self.track:
                x_RH, weight_RW = x_RH.detach().requires_grad_(), weight_RW.detach().requires_grad_()
                with torch.enable_grad():
                    out_RH = self.experts(x_RH, segments, torch.take(weight_RW, pick_N))
                self.saved.append((x_RH, weight_RW, out_RH))
            else:
                out_RH = self.experts(x_RH, segments, torch.take(weight_RW, pick_N))
            combines.append(d.exchange(out_RH.detach(), chunk.recv_splits, chunk.send_splits, f"combine of chunk {i}", zero_row=True))
        out_TH = x_TH.new_empty(x_TH.shape)
        for chunk, pending in zip(self.chunks, combines):
            sum_token_rows(pending.wait(), chunk.row_TJ, out_TH[chunk.start : chunk.end])
        return out_TH

    def backward(self, grad_TH: torch.Tensor, x_needs_grad: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        d = self.dispatcher
        if len(self.saved) != len(self.chunks):
            raise RuntimeError(
                f"{d.layer}: a second backward through the same expert-parallel forward (retain_graph=True) is not "
                f"supported: the experts' graph of each chunk is released by the first backward"
            )
        grads = gradient_format(self.row_format)
        outgoing = [
            d.exchange(grad_TH[c.start : c.end].index_select(0, c.token_O), c.send_splits, c.recv_splits, f"combine backward of chunk {i}")
            for i, c in enumerate(self.chunks)
        ]
        returning = []
        for i, (chunk, pending, (x_RH, weight_RW, out_RH)) in enumerate(zip(self.chunks, outgoing, self.saved)):
            grad_out_RH = pending.wait()
            if out_RH.requires_grad:
                torch.autograd.backward(out_RH, grad_out_RH)  # experts' backward: parameter grads accumulate
            block = pack_gradients(grads, sum(chunk.recv_splits), x_RH.grad, weight_RW.grad, self.device)
            returning.append(d.exchange(block, chunk.recv_splits, chunk.send_splits, f"dispatch backward of chunk {i}", zero_row=True))
        self.saved = []
        grad_x_TH = torch.empty_like(grad_TH) if x_needs_grad else None
        grad_weights = []
        for chunk, pending in zip(self.chunks, returning):
            grad_x_pad_OH, grad_weight_pad_OW = grads.unpack(pending.wait())
            if grad_x_TH is not None:
                sum_token_rows(grad_x_pad_OH, chunk.row_TJ, grad_x_TH[chunk.start : chunk.end])
            grad_weights.append(grad_weight_pad_OW[1:])
        return grad_x_TH, grad_weights


class _PipelineFunction(torch.autograd.Function):
    """`x_TH, weight_OW per chunk, *expert params -> out_TH`; see `_Pipeline`."""

    @staticmethod
    def forward(ctx, pipeline: _Pipeline, x_TH, num_weights: int, *inputs):
        ctx.pipeline, ctx.num_weights, ctx.num_params = pipeline, num_weights, len(inputs) - num_weights
        return pipeline.forward(x_TH)

    @staticmethod
    def backward(ctx, grad_TH):
        grad_x_TH, grad_weights = ctx.pipeline.backward(grad_TH.contiguous(), ctx.needs_input_grad[1])
        return (None, grad_x_TH, None, *grad_weights, *([None] * ctx.num_params))


def _parameters_of(experts) -> list[torch.nn.Parameter]:
    return list(experts.parameters()) if isinstance(experts, torch.nn.Module) else []


__all__ = ["AllToAllDispatcher", "AllToAllPlan", "ExchangeError"]
