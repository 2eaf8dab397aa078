"""`AllToAllDispatcher` ("all_to_all"): all-to-all-v over `torch.distributed` (NCCL on GPUs, gloo on CPU).

Shape legend: see `occult_hf.dispatch.plan`.

Per layer and forward:
1. **Plan** on the tokens' device (`plan.py`), for C chunks of the rank's tokens.
2. **Counts**: one small all-to-all of the `[D, C, 2]` row/pair counts (and each rank's chunk
   count, so ranks with different T agree on C), read once on the host: the layer's only host
   synchronisation (the split sizes).
3. **Exchange**, per chunk: the rows and their routing metadata (int32 local slots, routing
   weights in the router's dtype, exact) packed into one uint8 block (`RowFormat`) and sent in ONE
   `all_to_all_single`; the experts' pre-summed outputs come back in one more. All chunks' dispatch
   exchanges are issued asynchronously first; then chunk c's experts run while later chunks'
   dispatch and earlier chunks' combine are on the wire.
4. **Backward** (one autograd node for the whole pipeline): per chunk, one exchange of the output
   gradients to the expert ranks, the experts' backward, and one reverse exchange of the packed
   gradients of the rows and of their routing weights; again issued so that chunk c's expert
   backward overlaps the other chunks' exchanges. The experts' parameter gradients accumulate
   through a nested (reentrant) autograd call, as in reentrant activation checkpointing.
`combine()` sums a token's partial outputs in fp32. Activation checkpointing (non-reentrant, and
reentrant) recomputes the layer, exchanges included, on every rank alike; a second backward through
one forward (`retain_graph=True`) is refused with an error.

**Bounded waits.** Every wait on a peer finishes or fails within the exchange timeout
(`OccultConfig.exchange_timeout_s`, else the environment variable `OCCULT_EXCHANGE_TIMEOUT_S`, else
300 s) with an `ExchangeError` naming the layer and the operation. The count exchange, which every
rank reaches at every layer before any row moves, always waits with that bound on the host (its
result is read there anyway), so a stalled, dead or desynchronised peer is reported there. Row
exchanges of CPU tensors (gloo) also wait with the bound; on CUDA they only make the compute
stream wait for the communication stream (a host wait would cost the overlap), and a peer that
dies in the middle of one is caught by the process group's own timeout (NCCL watchdog).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .base import (
    DispatchPlan,
    Dispatched,
    ExpertsFn,
    RowFormat,
    TokenDispatcher,
    DEFAULT_CHUNKS,
    dispatch_format,
    register_dispatcher,
)
from .plan import SendOrder, chunk_bounds, device_counts, received_pairs, routing_width, send_order


class ExchangeError(RuntimeError):
    """A collective of the expert-parallel exchange failed or did not finish within the exchange timeout."""


@dataclass(frozen=True)
class _Chunk:
    """One chunk's plan on this rank: tokens `[start, end)`, its send order and split sizes."""

    start: int
    end: int
    order: SendOrder
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_pairs: int


@register_dispatcher
class AllToAllDispatcher(TokenDispatcher):
    name = "all_to_all"
    priority = 10

    @classmethod
    def supports(cls, ep, device=None) -> bool:
        return ep.is_distributed

    # ----- the interface ---------------------------------------------------------------------
    def dispatch(self, x_TH: torch.Tensor, routing) -> Dispatched:
        (chunk,), counts_D2 = self._plan(routing, num_chunks=1, max_chunks=1)
        weights_Tk = routing.topk_weights_Tk
        row_format = dispatch_format(x_TH.shape[1], x_TH.dtype, chunk.order.slot_SW.shape[1], weights_Tk.dtype)
        x_SH = x_TH[chunk.order.token_S]
        x_RH, slot_RW, weight_RW = _DispatchExchange.apply(
            x_SH, chunk.order.weight_SW, chunk.order.slot_SW, self, row_format, chunk.send_splits, chunk.recv_splits
        )
        segments, pick_N = received_pairs(slot_RW, chunk.num_pairs, self.num_local_experts)
        plan = self._result_plan(routing, [chunk], counts_D2, row_format, token_of_row_S=chunk.order.token_S)
        return Dispatched(x_RH=x_RH, segments=segments, pair_weight_N=weight_RW.reshape(-1)[pick_N], plan=plan)

    def combine(self, out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        out_SH = _CombineExchange.apply(out_RH, self, plan.recv_splits, plan.send_splits)
        out_TH = torch.zeros(plan.num_tokens, out_RH.shape[1], dtype=torch.float32, device=out_RH.device)
        return out_TH.index_add(0, plan.token_of_row_S, out_SH.float()).to(out_RH.dtype)

    def run(self, x_TH: torch.Tensor, routing, experts: ExpertsFn) -> tuple[torch.Tensor, DispatchPlan]:
        """Dispatch, experts and combine for C chunks, the exchange of one overlapping the experts of another."""
        num_chunks = self.chunks or DEFAULT_CHUNKS
        chunks, counts_D2 = self._plan(routing, num_chunks, num_chunks)
        weights_Tk = routing.topk_weights_Tk
        width = routing_width(self.mode, routing.topk_ids_Tk.shape[1])
        row_format = dispatch_format(x_TH.shape[1], x_TH.dtype, width, weights_Tk.dtype)
        inputs = []
        for chunk in chunks:  # the gathers stay in autograd: their backward is the scatter-add of the row gradients
            inputs += [x_TH[chunk.start + chunk.order.token_S], chunk.order.weight_SW]
        grad = torch.is_grad_enabled()
        params = [p for p in _parameters_of(experts) if p.requires_grad] if grad else []
        track = grad and (bool(params) or any(t.requires_grad for t in inputs))
        pipeline = _Pipeline(self, chunks, row_format, experts, track=track)
        outs_SH = _PipelineFunction.apply(pipeline, len(inputs), *inputs, *params)
        parts = []  # chunks hold disjoint token ranges: sum each chunk's partial outputs (fp32), then concatenate
        for chunk, out_SH in zip(chunks, outs_SH):
            out_cH = torch.zeros(chunk.end - chunk.start, x_TH.shape[1], dtype=torch.float32, device=x_TH.device)
            parts.append(out_cH.index_add(0, chunk.order.token_S, out_SH.float()))
        out_TH = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out_TH.to(x_TH.dtype), self._result_plan(routing, chunks, counts_D2, row_format)

    # ----- planning ------------------------------------------------------------------------------
    def _plan(self, routing, num_chunks: int, max_chunks: int) -> tuple[list[_Chunk], torch.Tensor]:
        """Split the tokens into (at most) `num_chunks` chunks, agree with the group on the chunk count (at most
        `max_chunks`, the same on every rank), plan each chunk's rows. Returns the chunks and `[D, 2]` counts."""
        ids_Tk, weights_Tk = routing.topk_ids_Tk, routing.topk_weights_Tk
        num_tokens = ids_Tk.shape[0]
        dest_Tk, local_Tk = self.destinations_of(routing)
        bounds = chunk_bounds(num_tokens, min(num_chunks, max_chunks))
        counts_CD2 = device_counts(dest_Tk, self.ep.num_devices, self.mode, bounds)
        splits, num_chunks = self._exchange_counts(counts_CD2, len(bounds), max_chunks)
        bounds += [(num_tokens, num_tokens)] * (num_chunks - len(bounds))  # empty chunks: join the group's exchanges
        chunks = []
        for (start, end), (send_splits, recv_splits, num_pairs) in zip(bounds, splits):
            order = send_order(
                dest_Tk[start:end], local_Tk[start:end], weights_Tk[start:end], self.ep.num_devices, self.mode, sum(send_splits)
            )
            chunks.append(_Chunk(start, end, order, send_splits, recv_splits, num_pairs))
        return chunks, counts_CD2.sum(0)

    def _exchange_counts(self, counts_CD2: torch.Tensor, num_chunks: int, max_chunks: int):
        """One all-to-all of every chunk's row/pair counts per destination, plus this rank's chunk count;
        one host read. Returns per chunk `(send_splits, recv_splits, recv_pairs)` and the group's chunk count."""
        num_devices = self.ep.num_devices
        send_DX = torch.zeros(num_devices, 2 * max_chunks + 1, dtype=torch.int64, device=counts_CD2.device)
        send_DX[:, : 2 * num_chunks] = counts_CD2.transpose(0, 1).reshape(num_devices, -1)
        send_DX[:, -1] = num_chunks
        recv_DX = torch.empty_like(send_DX)
        work = self._collective("count exchange", dist.all_to_all_single, recv_DX, send_DX, group=self.ep.group, async_op=True)
        self._wait(work, "count exchange", on_host=True)
        both = torch.cat([send_DX, recv_DX]).tolist()  # the one host read of the layer
        send, recv = both[:num_devices], both[num_devices:]
        group_chunks = max(row[-1] for row in recv)
        splits = [
            (
                tuple(send[d][2 * c] for d in range(num_devices)),
                tuple(recv[d][2 * c] for d in range(num_devices)),
                sum(recv[d][2 * c + 1] for d in range(num_devices)),
            )
            for c in range(group_chunks)
        ]
        return splits, group_chunks

    def _result_plan(self, routing, chunks, counts_D2, row_format: RowFormat, token_of_row_S=None) -> DispatchPlan:
        return DispatchPlan(
            mode=self.mode,
            num_tokens=routing.topk_ids_Tk.shape[0],
            counts_D2=counts_D2,
            row_bytes=row_format.row_bytes,
            ep=self.ep,
            layer=self.layer,
            token_of_row_S=token_of_row_S,
            send_splits=tuple(map(sum, zip(*(c.send_splits for c in chunks)))),
            recv_splits=tuple(map(sum, zip(*(c.recv_splits for c in chunks)))),
            num_pairs=sum(c.num_pairs for c in chunks),
        )

    # ----- communication -----------------------------------------------------------------------
    def exchange(self, block: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], what: str) -> "_Pending":
        """Start one `all_to_all_single` of `block`'s rows (split along dim 0); `.wait()` gives the received block."""
        out = block.new_empty((sum(recv_splits), *block.shape[1:]))
        block = block.contiguous()
        work = self._collective(
            what,
            dist.all_to_all_single,
            out,
            block,
            output_split_sizes=list(recv_splits),
            input_split_sizes=list(send_splits),
            group=self.ep.group,
            async_op=True,
        )
        return _Pending(self, work, out, block, what)

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:
            raise ExchangeError(f"{self.layer}: the {what} could not start: {error}") from error

    def _wait(self, work, what: str, on_host: bool) -> None:
        """Wait for a collective: with the exchange timeout on the host for CPU tensors and for reads on the
        host; on CUDA otherwise a stream-ordered wait (see the module docstring)."""
        try:
            if on_host:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        except RuntimeError as error:
            raise ExchangeError(
                f"{self.layer}: the {what} failed or did not finish within {self.timeout_s:g} s "
                f"(OccultConfig.exchange_timeout_s or $OCCULT_EXCHANGE_TIMEOUT_S): a peer rank is stalled, "
                f"dead or running a different model: {error}"
            ) from error


class _Pending:
    """A started exchange: `.wait()` returns the received block (keeps the send block alive until then)."""

    def __init__(self, dispatcher: AllToAllDispatcher, work, out: torch.Tensor, block: torch.Tensor, what: str):
        self.dispatcher, self.work, self.out, self.block, self.what = dispatcher, work, out, block, what

    def wait(self) -> torch.Tensor:
        self.dispatcher._wait(self.work, self.what, on_host=not self.out.is_cuda)
        self.block = None
        return self.out


def _gradient_format(row_format: RowFormat) -> RowFormat:
    """The backward row: the gradients of the activations and of the routing weights."""
    (x_dtype, hidden), _, (weight_dtype, width) = row_format.fields
    return RowFormat([(x_dtype, hidden), (weight_dtype, width)])


class _DispatchExchange(torch.autograd.Function):
    """Rows and routing metadata in one exchange; backward: their gradients packed in one reverse exchange."""

    @staticmethod
    def forward(ctx, x_SH, weight_SW, slot_SW, dispatcher, row_format, send_splits, recv_splits):
        ctx.dispatcher, ctx.row_format, ctx.splits, ctx.device = dispatcher, row_format, (send_splits, recv_splits), x_SH.device
        block = dispatcher.exchange(row_format.pack(x_SH, slot_SW, weight_SW), send_splits, recv_splits, "dispatch").wait()
        x_RH, slot_RW, weight_RW = row_format.unpack(block)
        ctx.mark_non_differentiable(slot_RW)
        return x_RH, slot_RW, weight_RW

    @staticmethod
    def backward(ctx, grad_x_RH, _grad_slot, grad_weight_RW):
        send_splits, recv_splits = ctx.splits
        grads = _gradient_format(ctx.row_format)
        block = _pack_grads(grads, sum(recv_splits), grad_x_RH, grad_weight_RW, ctx.device)
        grad_x_SH, grad_weight_SW = grads.unpack(ctx.dispatcher.exchange(block, recv_splits, send_splits, "dispatch backward").wait())
        return grad_x_SH, grad_weight_SW, None, None, None, None, None


class _CombineExchange(torch.autograd.Function):
    """The pre-summed rows back to their source ranks; backward sends the output gradients the other way."""

    @staticmethod
    def forward(ctx, out_RH, dispatcher, recv_splits, send_splits):
        ctx.dispatcher, ctx.splits = dispatcher, (recv_splits, send_splits)
        return dispatcher.exchange(out_RH, recv_splits, send_splits, "combine").wait()

    @staticmethod
    def backward(ctx, grad_SH):
        recv_splits, send_splits = ctx.splits
        return ctx.dispatcher.exchange(grad_SH, send_splits, recv_splits, "combine backward").wait(), None, None, None


def _pack_grads(grads: RowFormat, rows: int, grad_x, grad_weight, device) -> torch.Tensor:
    """Pack the gradients of rows and weights; an absent gradient is zeros (every rank runs the same exchanges)."""
    (x_dtype, hidden), (weight_dtype, width) = grads.fields
    block = torch.zeros(rows, grads.row_bytes, dtype=torch.uint8, device=device)
    view_x, view_w = grads.unpack(block)
    if grad_x is not None:
        view_x.copy_(grad_x)
    if grad_weight is not None:
        view_w.copy_(grad_weight)
    return block


class _Pipeline:
    """State of one chunked dispatch -> experts -> combine, shared by `_PipelineFunction`'s forward and backward."""

    def __init__(self, dispatcher: AllToAllDispatcher, chunks: list[_Chunk], row_format: RowFormat, experts: ExpertsFn, track: bool):
        self.dispatcher, self.chunks, self.row_format, self.experts, self.track = dispatcher, chunks, row_format, experts, track
        self.saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        self.device = None

    def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        d = self.dispatcher
        self.device = rows[0].device
        dispatches = [
            d.exchange(self.row_format.pack(x_SH, c.order.slot_SW, weight_SW), c.send_splits, c.recv_splits, f"dispatch of chunk {i}")
            for i, (c, x_SH, weight_SW) in enumerate(zip(self.chunks, rows[0::2], rows[1::2]))
        ]
        combines = []
        for i, (chunk, pending) in enumerate(zip(self.chunks, dispatches)):
            x_RH, slot_RW, weight_RW = self.row_format.unpack(pending.wait())
            segments, pick_N = received_pairs(slot_RW, chunk.num_pairs, d.num_local_experts)
            if self.track:
                x_RH, weight_RW = x_RH.detach().requires_grad_(), weight_RW.detach().requires_grad_()
                with torch.enable_grad():
                    out_RH = self.experts(x_RH, segments, weight_RW.reshape(-1)[pick_N])
                self.saved.append((x_RH, weight_RW, out_RH))
            else:
                out_RH = self.experts(x_RH, segments, weight_RW.reshape(-1)[pick_N])
            combines.append(d.exchange(out_RH.detach(), chunk.recv_splits, chunk.send_splits, f"combine of chunk {i}"))
        return [pending.wait() for pending in combines]

    def backward(self, grads_SH: list[torch.Tensor | None]) -> list[torch.Tensor]:
        d = self.dispatcher
        if len(self.saved) != len(self.chunks):
            raise RuntimeError(
                f"{d.layer}: a second backward through the same expert-parallel forward (retain_graph=True) is not "
                f"supported: the experts' graph of each chunk is released by the first backward"
            )
        grads = _gradient_format(self.row_format)
        hidden = self.row_format.fields[0][1]
        outgoing = []
        for i, (chunk, grad_SH) in enumerate(zip(self.chunks, grads_SH)):
            if grad_SH is None:
                grad_SH = torch.zeros(sum(chunk.send_splits), hidden, dtype=self.row_format.fields[0][0], device=self.device)
            outgoing.append(d.exchange(grad_SH, chunk.send_splits, chunk.recv_splits, f"combine backward of chunk {i}"))
        returning = []
        for i, (chunk, pending, (x_RH, weight_RW, out_RH)) in enumerate(zip(self.chunks, outgoing, self.saved)):
            grad_out_RH = pending.wait()
            if out_RH.requires_grad:
                torch.autograd.backward(out_RH, grad_out_RH)  # experts' backward: parameter grads accumulate
            block = _pack_grads(grads, sum(chunk.recv_splits), x_RH.grad, weight_RW.grad, self.device)
            returning.append(d.exchange(block, chunk.recv_splits, chunk.send_splits, f"dispatch backward of chunk {i}"))
        self.saved = []
        result = []
        for pending in returning:
            result += list(grads.unpack(pending.wait()))
        return result


class _PipelineFunction(torch.autograd.Function):
    """`(x_SH, weight_SW) per chunk, *expert params -> out_SH per chunk`; see `_Pipeline`."""

    @staticmethod
    def forward(ctx, pipeline: _Pipeline, num_rows_inputs: int, *inputs):
        ctx.pipeline, ctx.num_rows_inputs, ctx.num_params = pipeline, num_rows_inputs, len(inputs) - num_rows_inputs
        return tuple(pipeline.forward(list(inputs[:num_rows_inputs])))

    @staticmethod
    def backward(ctx, *grads_SH):
        grads = ctx.pipeline.backward(list(grads_SH))
        return (None, None, *grads, *([None] * ctx.num_params))


def _parameters_of(experts) -> list[torch.nn.Parameter]:
    return list(experts.parameters()) if isinstance(experts, torch.nn.Module) else []


__all__ = ["AllToAllDispatcher", "ExchangeError"]
