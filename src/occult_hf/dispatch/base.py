"""The dispatcher interface (docs/design.md §3), its frozen results, the wire row format and the registry.

Shape legend: see `occult_hf.dispatch.plan`.

A `TokenDispatcher` owns all communication of one MoE layer: `dispatch(x_TH, routing)` returns the
received rows in expert layout and a frozen `DispatchPlan`; `combine(out_RH, plan)` returns the
pre-summed rows to their tokens and sums a token's partial outputs in fp32. `run(x_TH, routing,
experts)` is the whole exchange around the local experts; implementations may override it to
overlap the exchange of one chunk of tokens with the experts of another.

Implementations register under a unique lowercase name (`register_dispatcher`); `OccultConfig.dispatcher`
picks one, or "auto" the available one of highest `priority` whose `supports(ep, device)` is true.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from occult_hf.kernels import row_sum
from occult_hf.kernels.layout import ExpertSegments
from occult_hf.kernels.replica_pairs import FUSED_PAIRS
from occult_hf.kernels.replica_routes import FusedRoutes

from ..registry import DISPATCHERS
from ..registry import REPLICA_CHOICES
from ..layout import LayerLayout
from ..replicas.routing import load_aware_homes
from ..utils.checks import check_timeout_s
from .auto import AutoHints
from .group import ExpertParallelGroup
from .plan import check_mode, destinations


class ExchangeError(RuntimeError):
    """A collective of the expert-parallel exchange failed or did not finish within the exchange timeout."""


#: environment variable that bounds every wait on a peer in the exchange (seconds)
EXCHANGE_TIMEOUT_ENV = "OCCULT_EXCHANGE_TIMEOUT_S"
#: the bound when neither OccultConfig.exchange_timeout_s nor the environment variable is set
DEFAULT_EXCHANGE_TIMEOUT_S = 120.0


def exchange_start_error(layer: str, what: str, error) -> ExchangeError:
    """The error of a collective of `layer`'s exchange (`what`) that the backend refused to start."""
    return ExchangeError(f"{layer}: the {what} could not start: {error}")


def exchange_timeout_error(layer: str, what: str, timeout_s: float, error) -> ExchangeError:
    """The error of a collective of `layer`'s exchange (`what`) that failed or outlived the exchange timeout."""
    return ExchangeError(
        f"{layer}: the {what} failed or did not finish within {timeout_s:g} s "
        f"(OccultConfig.exchange_timeout_s or $OCCULT_EXCHANGE_TIMEOUT_S): a peer rank is stalled, "
        f"dead or running a different model: {error}"
    )


@dataclass(frozen=True)
class TokenRouting:
    """What a layer dispatches: the router's choice, after collaboration pruning when that is on.

    Attributes:
        topk_ids_Tk: `[T, k]` int64 expert ids in `[0, E)`.
        topk_weights_Tk: `[T, k]` routing weights as the model applies them (differentiable).
        devices_TD: `[T, D]` bool devices each token is limited to (collaboration pruning with
            replicated experts: a pair goes to its expert's home among them), or None.
    """

    topk_ids_Tk: torch.Tensor
    topk_weights_Tk: torch.Tensor
    devices_TD: torch.Tensor | None = None


@dataclass(frozen=True)
class DispatchPlan:
    """What `combine()` needs to undo a `dispatch()`, and what the dispatch sent.

    Attributes:
        mode: "dedup" or "per_expert".
        num_tokens: `T` on this rank.
        counts_D2: `[D, 2]` int64 on the tokens' device: rows and (token, expert) pairs sent to each
            device (logical devices in one process); computed on the device, read only by statistics.
        row_bytes: bytes of one dispatched row on the wire: `H` activations plus W (slot, weight)
            entries, aligned as `RowFormat` packs them.
        ep: the group the rows were exchanged in.
        layer: the layer's name in error messages (e.g. "layer 3").
        send_splits: rows sent to each rank (host ints; distributed only, else None).
        recv_splits: rows received from each rank (host ints; distributed only, else None).
        num_pairs: `N`, (received row, local expert) pairs computed here (host int, or None in one
            process where it is `T * k`).
    """

    mode: str
    num_tokens: int
    counts_D2: torch.Tensor
    row_bytes: int
    ep: ExpertParallelGroup
    layer: str = "layer"
    send_splits: tuple[int, ...] | None = None
    recv_splits: tuple[int, ...] | None = None
    num_pairs: int | None = None

    @property
    def send_rows(self) -> tuple[int, ...]:
        """Rows sent to each device: `counts_D2[:, 0]` read on the host (waits for the device)."""
        return tuple(int(v) for v in self.counts_D2[:, 0].tolist())


@dataclass(frozen=True)
class Dispatched:
    """The result of `dispatch()`: what the local experts consume, and the plan to undo it.

    Attributes:
        x_RH: `[R, H]` received rows (x dtype).
        segments: (row, local expert) pairs grouped by local expert (`ExpertSegments`).
        pair_weight_N: `[N]` routing weight of each pair, in segment order (router dtype; differentiable).
        plan: `DispatchPlan` for `combine()`.
    """

    x_RH: torch.Tensor
    segments: ExpertSegments
    pair_weight_N: torch.Tensor
    plan: DispatchPlan


#: the local expert computation: `experts(x_RH, segments, pair_weight_N) -> out_RH`. Its class may also define
#: `computes_topk(x_TH, topk_ids_Tk, topk_weights_Tk) -> bool` and `forward_topk(x_TH, topk_ids_Tk, topk_weights_Tk)
#: -> out_TH` (`LocalExperts` does): the same sum straight from the top-k, which a dispatcher whose rows are the tokens
#: themselves and whose ids are the local slots (`LocalDispatcher` with one device) calls where `computes_topk` says.
ExpertsFn = Callable[[torch.Tensor, ExpertSegments, torch.Tensor], torch.Tensor]


class RowFormat:
    """Several per-row fields packed into one `[rows, row_bytes]` uint8 block, so they travel in one collective.

    Each field is `(dtype, width)`; it sits at an offset aligned to its element size and the row
    size is a multiple of the largest element size, so every field is a strided view of the block
    (no copy to unpack). The dispatch packs `[x (H, x dtype) | slots (W, int32) | weights (W)]`, its
    backward `[grad x | grad weights]`.
    """

    def __init__(self, fields: Sequence[tuple[torch.dtype, int]]) -> None:
        self.fields = tuple(fields)
        offset, offsets, align = 0, [], 1
        self.sizes = tuple(dtype.itemsize for dtype, _ in self.fields)
        for (dtype, width), size in zip(self.fields, self.sizes):
            offset = -(-offset // size) * size
            offsets.append(offset)
            offset += size * width
            align = max(align, size)
        self.offsets = tuple(offsets)
        self.row_bytes = -(-offset // align) * align

    def pack(self, *tensors: torch.Tensor) -> torch.Tensor:
        """`[rows, row_bytes]` uint8 holding each `[rows, width]` tensor in its field."""
        rows = tensors[0].shape[0]
        block = torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=tensors[0].device)
        for view, tensor, (_, width) in zip(self.unpack(block), tensors, self.fields):
            view.copy_(tensor.reshape(rows, width))
        return block

    def unpack(self, block: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fields of a packed block as `[rows, width]` views in their dtypes."""
        return tuple(
            block[:, offset : offset + size * width].view(dtype)
            for (dtype, width), offset, size in zip(self.fields, self.offsets, self.sizes)
        )


    def stamp(self) -> tuple[int, ...]:
        """The format as ints, two per field (its dtype's code, its width): what the count exchange carries beside the
        counts, so that ranks about to send rows of different formats fail before any row moves (`check_stamps`)."""
        return tuple(value for dtype, width in self.fields for value in (_dtype_code(dtype), width))


#: dtypes by their code in a `RowFormat.stamp` (the same on every rank; -1: another dtype)
_STAMP_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.float8_e4m3fn,
    torch.float8_e5m2,
)  # fmt: skip


def _dtype_code(dtype: torch.dtype) -> int:
    return _STAMP_DTYPES.index(dtype) if dtype in _STAMP_DTYPES else -1


def _describe_stamp(stamp: Sequence[int]) -> str:
    """`[bfloat16 x 64, int32 x 2, bfloat16 x 2]`: the fields of a `RowFormat.stamp`."""
    names = [str(_STAMP_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_STAMP_DTYPES) else "other" for code in stamp[::2]]
    return "[" + ", ".join(f"{name} x {width}" for name, width in zip(names, stamp[1::2])) + "]"


def check_stamps(layer: str, received: Sequence[Sequence[int]], own: Sequence[int]) -> None:
    """Raise an `ExchangeError` naming the first EP rank whose received `RowFormat.stamp` (`received[p]`, from rank p)
    differs from this rank's (`own`): its rows would be read in this rank's format, silently wrong where only the
    dtype differs (bfloat16 against float16), and a collective of mismatched sizes where the row size differs. Every
    rank of such a group raises (each sees another's stamp differ)."""
    own = tuple(own)
    for rank, stamp in enumerate(received):
        if tuple(stamp) != own:
            raise ExchangeError(
                f"{layer}: EP rank {rank} sends rows of format {_describe_stamp(stamp)} (activations, slots, routing "
                f"weights) and this rank {_describe_stamp(own)}: the ranks run the MoE layer in different dtypes or "
                f"shapes (the model cast differently on some ranks after loading, or autocast on some ranks only); "
                f"every rank must run the same model in the same dtype"
            )


def dispatch_format(hidden: int, x_dtype: torch.dtype, width: int, weight_dtype: torch.dtype) -> RowFormat:
    """The forward row: activations, W int32 local slots, W routing weights."""
    return RowFormat([(x_dtype, hidden), (torch.int32, width), (weight_dtype, width)])


def gradient_format(row_format: RowFormat) -> RowFormat:
    """The backward row of a `dispatch_format` row: the gradients of the activations and of the routing weights."""
    (x_dtype, hidden), _, (weight_dtype, width) = row_format.fields
    return RowFormat([(x_dtype, hidden), (weight_dtype, width)])


def pack_gradients(grads: RowFormat, rows: int, grad_x, grad_weight, device) -> torch.Tensor:
    """The gradients of rows and weights packed in `grads`' rows; an absent gradient (None: the dispatch
    Functions do not materialise them) is zeros, since every rank runs the same exchanges. Each field is
    written once: no memset of the whole block first."""
    block = torch.empty(rows, grads.row_bytes, dtype=torch.uint8, device=device)
    for view, grad in zip(grads.unpack(block), (grad_x, grad_weight)):
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
    return block


@dataclass(frozen=True)
class DispatchSettings:
    """How one layer's rows move: the `OccultConfig` fields a dispatcher reads, plus what "auto" weighs.

    Attributes:
        dispatcher: "auto" or a registered name (`OccultConfig.dispatcher`).
        mode: "dedup" (one row per (token, destination device)) or "per_expert" (one per (token, expert)).
        chunks: token chunks per forward (None: `DEFAULT_CHUNKS`); used by implementations that overlap the
            exchange with the experts.
        timeout_s: bound on every wait on a peer, seconds (None: `$OCCULT_EXCHANGE_TIMEOUT_S`, else the default).
        replica_choice: "static" (the routing rule's fixed choice among an expert's homes) or "load_aware"
            (`replicas.routing.load_aware_homes`: one all-gather of per-expert counts per layer).
        top_k: experts per token (what "auto" estimates the padded exchange's padding from).
        pruned: collaboration pruning limits the tokens' devices ("auto" then keeps the exact exchange).
        expert_backend: `OccultConfig.expert_backend` ("auto" weighs whether it skips empty pairs).
    """

    dispatcher: str = "auto"
    mode: str = "dedup"
    chunks: int | None = None
    timeout_s: float | None = None
    replica_choice: str = "static"
    top_k: int = 1
    pruned: bool = False
    expert_backend: str = "auto"

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.replica_choice not in REPLICA_CHOICES:
            raise ValueError(f"replica_choice must be one of {REPLICA_CHOICES}, got {self.replica_choice!r}")

    @classmethod
    def of(cls, occult_config, top_k: int) -> "DispatchSettings":
        """The settings of every layer of a model run with `occult_config` (an `OccultConfig`)."""
        return cls(
            dispatcher=occult_config.dispatcher, mode=occult_config.dispatch, chunks=occult_config.dispatch_chunks,
            timeout_s=occult_config.exchange_timeout_s, replica_choice=occult_config.replica_choice, top_k=top_k,
            pruned=occult_config.prune is not None, expert_backend=occult_config.expert_backend,
        )  # fmt: skip

    def hints(self, layout: LayerLayout) -> AutoHints:
        """What "auto" weighs the padded exchange by, for a layer of `layout`."""
        return AutoHints(
            tuple(layout.primary_devices()), self.top_k, self.mode, self.chunks, pruned=self.pruned,
            expert_backend=self.expert_backend,
        )  # fmt: skip


class TokenDispatcher:
    """Moves a layer's tokens to the devices of their experts and back (one implementation per registry name).

    Attributes:
        name: registry key (class attribute).
        priority: "auto" picks the supported implementation of highest priority (class attribute).
        graph_capturable: a forward reads nothing on the host and keeps every size static, so it can be
            captured in a CUDA graph (class attribute; `occult bench ep` times such layers replayed too).
        requires: what `supports` asks of the group beyond the ranks, in words, for the error when a config names
            an implementation that cannot serve (class attribute; "" when there is nothing to add).
        overlaps_chunks: splits a forward's tokens into `settings.chunks` chunks whose exchanges overlap the experts
            (class attribute); the others run one chunk, so a config that names one with `dispatch_chunks > 1` is
            refused, and "auto" choosing one warns.
        ep: the expert-parallel group.
        layout: the layer's `LayerLayout` for this rank: each expert's device and slot there, and with replicated
            experts the home and slot tables, which make `plan.destinations` apply the replica routing rule.
        settings: the `DispatchSettings`; `mode` and `chunks` are its fields, copied.
        num_local_experts: `L`, experts computed on this rank (E in one process).
        timeout_s: bound on every wait on a peer, seconds (resolved from the settings and the environment).
        layer: the layer's name in error messages (`label`, else "layer <index>").
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    graph_capturable: ClassVar[bool] = False
    requires: ClassVar[str] = ""
    overlaps_chunks: ClassVar[bool] = False

    def __init__(
        self, ep: ExpertParallelGroup, layout: LayerLayout, settings: DispatchSettings, label: str | None = None
    ) -> None:
        if layout.num_devices != ep.num_devices:
            raise ValueError(
                f"layer {layout.layer}: the placement is for num_devices={layout.num_devices} but the expert-parallel "
                f"group has {ep.num_devices} devices"
            )
        self.ep = ep
        self.layout = layout
        self.settings = settings
        self.timeout_s = resolve_timeout(settings.timeout_s)
        self.layer = label or f"layer {layout.layer}"
        # plain copies of what every forward reads: a compiled model guards on each as one value (a property
        # costs dynamo a guard chain on the class), and its guards are re-checked before every call
        self.mode, self.chunks, self.num_local_experts = settings.mode, settings.chunks, layout.num_local_experts
        self._routes = FusedRoutes()  # the load-aware rule's per-expert half: one Triton launch on a GPU
        #: `[T, k]` the device that served each pair of the last dispatch planned through `destinations_of`
        #: (None before one): readers such as the callback's CT meter take it instead of re-deriving it, which
        #: under `replica_choice="load_aware"` would need the count all-gather again
        self.last_destinations_Tk: torch.Tensor | None = None

    @classmethod
    def supports(cls, ep: ExpertParallelGroup, device: torch.device | None = None) -> bool:
        """Whether this implementation can serve `ep` on `device` (used by "auto")."""
        raise NotImplementedError

    def destinations_of(self, routing: TokenRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """`(dest_Tk, local_Tk)` of `plan.destinations` for `routing`, its `devices_TD` (pruning with replicas)
        keeping each pair on the token's devices."""
        ids_Tk = routing.topk_ids_Tk
        layout = self.layout.to(ids_Tk.device)
        if self.settings.replica_choice == "static" or not layout.replicated:
            dest_Tk, local_Tk = destinations(ids_Tk, layout, devices_TD=routing.devices_TD)
        else:
            gather = self._gather_counts if self.ep.is_distributed else None
            dest_Tk = load_aware_homes(
                ids_Tk, layout.home_table_EM, layout.num_devices, gather, self.ep.rank, routing.devices_TD,
                layout.pin_slack, routes=self._routes, pairs=FUSED_PAIRS,
            )  # fmt: skip
            local_Tk = layout.slot_ED[ids_Tk.long(), dest_Tk]
        self.last_destinations_Tk = dest_Tk.detach()
        return dest_Tk, local_Tk

    def _gather_counts(self, local_EM1: torch.Tensor) -> torch.Tensor:
        """`[D, E, M + 1]`: every rank's `replicas.routing.preference_counts` (the load-aware rule's one
        collective), waited for like the exchange: bounded on the host for CPU tensors, stream-ordered on CUDA."""
        parts = [torch.empty_like(local_EM1) for _ in range(self.ep.num_devices)]
        what = "all-gather of the replicated experts' counts (replica_choice='load_aware')"
        work = self._collective(what, dist.all_gather, parts, local_EM1.contiguous(), group=self.ep.group, async_op=True)
        self._wait(work, what, on_host=local_EM1.device.type == "cpu")
        return torch.stack(parts)

    # ----- collectives: every wait on a peer bounded, every failure an ExchangeError naming the layer -----
    def _collective(self, what: str, fn, *args, **kwargs):
        """Start collective `fn(*args, **kwargs)`; a failure to start is an `ExchangeError` naming `what`."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:
            raise exchange_start_error(self.layer, what, error) from error

    def _timeout_error(self, what: str, error) -> ExchangeError:
        return exchange_timeout_error(self.layer, what, self.timeout_s, error)

    def _wait(self, work, what: str, on_host: bool) -> None:
        """Wait for a collective: with the exchange timeout on the host for CPU tensors; on CUDA a
        stream-ordered wait (the host learns of a stalled peer at its next bounded wait)."""
        try:
            if on_host:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        except RuntimeError as error:
            raise self._timeout_error(what, error) from error

    def dispatch(self, x_TH: torch.Tensor, routing) -> Dispatched:
        """Send each token to the devices of its experts; return the received rows in expert layout."""
        raise NotImplementedError

    def combine(self, out_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """`[T, H]` in `out_RH.dtype`: each received row's (weighted, pre-summed) output returned to its
        token and a token's partial outputs summed in fp32."""
        raise NotImplementedError

    def run(
        self, x_TH: torch.Tensor, routing, experts: ExpertsFn, concurrent: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor, DispatchPlan]:
        """`(out_TH, plan)`: dispatch, the local experts, combine. Overlapping implementations override this.

        `concurrent`: work that does not depend on the exchange (the shared experts), called once; an
        implementation that can issues it while its exchange is in flight ("all_to_all": right behind the count
        exchange, so the GPU computes it while the host waits for the counts), the others after the dispatch.
        """
        with stage("dispatch"):
            sent = self.dispatch(x_TH, routing)
        if concurrent is not None:
            with stage("concurrent"):
                concurrent()
        with stage("experts"):
            out_RH = experts(sent.x_RH, sent.segments, sent.pair_weight_N)
        with stage("combine"):
            return self.combine(out_RH, sent.plan), sent.plan

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.layer}, mode={self.mode!r}, chunks={self.chunks}, timeout_s={self.timeout_s:g}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


#: token chunks per forward when `OccultConfig.dispatch_chunks` is None. One: the per-chunk packing and the smaller
#: grouped GEMMs cost more than the overlap of exchange and experts hides (docs/bench_ep_h200_2gpu.md).
DEFAULT_CHUNKS = 1


def sum_token_rows(rows_pad_OH: torch.Tensor, row_TJ: torch.Tensor, out_TH: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, H]` in the rows' dtype: each token's rows summed, `out[t] = sum_j rows_pad_OH[row_TJ[t, j]]`,
    accumulated in fp32 and rounded once (torch reduces bf16/fp16 in fp32). `rows_pad_OH` has a zero row
    that a token's absent rows point at (the first in "all_to_all", whose `row_TJ` counts from one; the
    last in the static dispatchers). A gather and a reduction in a fixed order: no atomics (an
    fp32 `index_add_` of the rows is far slower, docs/baselines.md).
    The dtype is explicit because CUDA autocast runs `sum` in fp32 otherwise: a bf16 model under
    `torch.autocast` would get an fp32 block output (the stock block returns its input's dtype), an fp32
    residual stream, and fp32 rows reaching bf16 expert weights in the next layer.
    Rows that need no gradient (what an exchange returned, inside its autograd Function) on a GPU are summed by
    one Triton kernel (`row_sum`: fp32 sums rounded once, without the `[T, J, H]` gathered temporary)."""
    if not (rows_pad_OH.requires_grad and torch.is_grad_enabled()) and row_sum.available(rows_pad_OH):
        return row_sum.sum_rows(rows_pad_OH, row_TJ, out_TH)
    return torch.sum(rows_pad_OH[row_TJ], dim=1, dtype=rows_pad_OH.dtype, out=out_TH)


def stage(name: str):
    """A named range (`occult::<name>`) around one step of the exchange, for `torch.profiler` traces
    (`occult bench ep --profile` sums the device time of each). Only while a profiler runs: a
    `record_function` costs an operator call even without one. Never while dynamo traces: it drops
    `record_function` from the graph anyway, and reading the profiler's state there would make it guard on that
    state, so that profiling a compiled model compiled it again (a different graph from the one being measured)."""
    if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"occult::{name}")


def resolve_timeout(timeout_s: float | None) -> float:
    """The exchange timeout: the explicit value, else `$OCCULT_EXCHANGE_TIMEOUT_S`, else 120 s (docs/failure.md says why; finite, at most a day)."""
    if timeout_s is not None:
        return check_timeout_s(timeout_s, "exchange timeout_s")
    raw = os.environ.get(EXCHANGE_TIMEOUT_ENV)
    return DEFAULT_EXCHANGE_TIMEOUT_S if raw in (None, "") else check_timeout_s(raw, EXCHANGE_TIMEOUT_ENV)


# ----- registry ---------------------------------------------------------------------------------
def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    """Class decorator: register `cls` under `cls.name` in `occult_hf.registry.DISPATCHERS` (with its
    `overlaps_chunks`, which `OccultConfig` checks `dispatch_chunks` against)."""
    return DISPATCHERS.register(cls.name, cls, overlaps_chunks=cls.overlaps_chunks)


def dispatcher_names() -> tuple[str, ...]:
    """The registered names, sorted (what `OccultConfig.dispatcher` accepts besides "auto")."""
    return DISPATCHERS.names()


def dispatcher_class(
    name: str, ep: ExpertParallelGroup, device: torch.device | None = None, hints: AutoHints | None = None
) -> type[TokenDispatcher]:
    """The class registered as `name`; "auto": on one node "padded" where `hints` (the layer) make its padding cheap
    (`auto.AutoHints.prefers_padded`: no host read per layer) and the ranks can agree on their token count host to
    host (`ep.host_group`), else the supported one of highest priority for `ep` on `device` ("hierarchical" where the
    group spans nodes)."""
    if name == "auto":
        registered = dict(DISPATCHERS.items())
        padded = registered.get("padded")
        one_node = not ep.spans_nodes
        if hints is not None and one_node and ep.host_group is not None and padded is not None and padded.supports(ep, device):
            device_type = None if device is None else torch.device(device).type
            if hints.prefers_padded(ep.num_devices, device_type):
                return padded
        for cls in sorted(registered.values(), key=lambda cls: -cls.priority):
            if cls.supports(ep, device):
                return cls
        raise RuntimeError(f"no registered dispatcher supports {ep} on {device}; registered: {dispatcher_names()}")
    cls = DISPATCHERS.get(name)
    if not cls.supports(ep, device):
        where = "torch.distributed ranks" if ep.is_distributed else "one process"
        servable = [n for n, c in DISPATCHERS.items() if c.supports(ep, device)]
        needs = f" (it needs {cls.requires})" if cls.requires else ""
        raise ValueError(
            f"OccultConfig.dispatcher={name!r} cannot serve {ep.num_devices} devices in {where} on {device}{needs}; "
            f"use 'auto' or one of {servable}"
        )
    return cls


__all__ = [
    "DEFAULT_CHUNKS",
    "DEFAULT_EXCHANGE_TIMEOUT_S",
    "EXCHANGE_TIMEOUT_ENV",
    "DispatchPlan",
    "DispatchSettings",
    "Dispatched",
    "ExpertsFn",
    "RowFormat",
    "TokenDispatcher",
    "TokenRouting",
    "check_stamps",
    "dispatch_format",
    "dispatcher_class",
    "dispatcher_names",
    "exchange_timeout_error",
    "gradient_format",
    "pack_gradients",
    "register_dispatcher",
    "resolve_timeout",
    "stage",
    "sum_token_rows",
]
