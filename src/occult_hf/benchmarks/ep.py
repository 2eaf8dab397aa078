"""`occult bench ep`: one expert-parallel MoE layer under torchrun, every dispatcher and dispatch mode.

Shape legend: T tokens per rank, H hidden, E routed experts, k experts per token, D ranks.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench ep ...` (NCCL on GPUs, gloo on CPUs).
Each rank builds the same one-layer transformers causal LM of the shape (OLMoE, Qwen2-MoE with its
sigmoid-gated shared expert, DeepSeek-V2 greedy with two shared experts for DeepSeek-MoE-16B), bf16
on GPU, and every case converts a copy of it with `apply_occult` (the builder the models use, so the
timed layer is the model's own `OccultMoE`), then feeds its own T tokens to that layer. Routing is
replayed from the real Qwen1.5-MoE trace (`--trace`, tiled to D*T tokens, rank r reading the window
that starts at r*T) for the shape with its E and k, and comes from the layer's own (random) router for
the other shapes: a random router has no co-activation structure, so placement can only balance
load there, and the table says which routing each row used. Replayed ids enter through router
logits built from the trace (trace ids highest), so the model's own selection rule and pruning
operate on them.

Cases (`--dispatchers` x `--modes`, plus `transformers_ep`): each registered torch.distributed
dispatcher ("all_to_all": host-read splits, packed rows, chunked overlap; "symm_mem": NVSHMEM
all-to-all-v, splits on the device; "padded": static equal-split all-to-all) with `per_expert` +
contiguous placement (one row per (token, expert), the baseline of transformers' all-to-all EP,
Tutel and Megatron), `dedup` + contiguous, `dedup` + refined placement (planned on the first half of
the replayed routing) and `dedup` + refined pruned to N_d devices (on "all_to_all" when asked for, else the first
dispatcher other than the static ones: pruning changes the routing, not the transport); on request (`--modes`) `dedup` +
replicated (refined with one redundant expert slot per rank: hot experts get a second home; `+load_aware`: a
replicated expert's pairs split over its homes by the batch's loads, `OccultConfig.replica_choice`) and
`dedup` + file (`--placement occult_placement.json`, replicas allowed). `transformers_ep`: transformers'
own expert parallelism as shipped (a one-layer checkpoint of the shape loaded with
`DistributedConfig(ep_size=D, fsdp_size=D, ep_implementation="all_to_all")` on transformers >= 5.21,
each rank its own batch; `DistributedConfig(tp_plan="auto", enable_expert_parallel=True)` before, all
ranks one batch), timed on its MoE block with the decoder layer's parameters gathered.

Per case: forward and forward+backward of the layer (median over iterations, ranks aligned by a
barrier before each; the slowest rank's time); the same layer with the exchange skipped (every
collective of the dispatcher replaced by the result it returned in a recorded run: the same
compute, no communication; so `fwd / skipped fwd` is what the exchange still costs after overlap);
the exchange alone (dispatch + combine, experts skipped); bytes each rank sends to other ranks
(dispatch rows with their metadata and combine rows; mean and max over ranks); the exchange's GB/s
against a uniform `all_to_all_single` of the same per-rank volume in the same run; the wire alone (the
forward's recorded row exchanges re-issued back to back with the same split sizes); group tokens per
second and the ratio to `per_expert` + contiguous on the same dispatcher. `--profile` adds, per case,
a `torch.profiler` summary of one forward and one forward+backward: host and device time of each
dispatcher stage (`occult::*` ranges) and the costliest kernels.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.benchmarks.experts import HF_EXPERTS, machine_line
from occult_hf.config import OccultConfig
from occult_hf.dispatch import TokenRouting, dispatcher_class
from occult_hf.expert_shapes import SHAPES, ExpertShape
from occult_hf.placement import Placement, plan_placement
from occult_hf.profile import RoutingProfile
from occult_hf.profile import LayerAccumulator
from occult_hf.registry import DISPATCHERS as REGISTERED_DISPATCHERS
from occult_hf.benchmarks import QWEN15_TRACE, measures_a_gpu

HELP = "expert-parallel MoE layer under torchrun: every dispatcher and dispatch mode vs transformers' EP"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

BASELINE_MODE = "per_expert+contiguous"
TRANSFORMERS_EP = "transformers_ep"
DISPATCHERS = ("all_to_all", "symm_mem", "padded")


@dataclass(frozen=True)
class Mode:
    """One way of running the layer."""

    dispatch: str
    placement: str
    max_devices_per_token: int | None = None
    replica_choice: str = "static"  # OccultConfig.replica_choice: matters only with replicas

    @property
    def name(self) -> str:
        pruned = f"+Nd={self.max_devices_per_token}" if self.max_devices_per_token else ""
        rule = f"+{self.replica_choice}" if self.replica_choice != "static" else ""
        return f"{self.dispatch}+{self.placement}{pruned}{rule}"


MODES = (
    Mode("per_expert", "contiguous"),
    Mode("dedup", "contiguous"),
    Mode("dedup", "refined"),
    Mode("dedup", "refined", 2),
    Mode("dedup", "refined", 1),
)
#: on request (`--modes`): refined with one redundant expert slot per rank (replicated hot experts), its
#: pairs split over the homes by the static rule or by the batch's loads ("load_aware"), and the placement file
#: given by `--placement` (replicas allowed)
EXTRA_MODES = (Mode("dedup", "replicated"), Mode("dedup", "replicated", replica_choice="load_aware"), Mode("dedup", "file"))

#: the MoE block of each family, and what the real checkpoints add to the routed experts
BLOCKS = {
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", {}),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", {"shared_expert_intermediate_size": 5632}),
    "deepseek_v2": (
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        "DeepseekV2Moe",
        {"n_shared_experts": 2, "topk_method": "greedy", "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1},
    ),
}  # fmt: skip


@dataclass
class Row:
    shape: str
    tokens_per_rank: int
    routing: str
    dispatcher: str
    mode: str
    fwd_ms: float
    fwd_bwd_ms: float
    skipped_fwd_ms: float
    skipped_fwd_bwd_ms: float
    exchange_ms: float
    ct: float
    sent_mb_mean: float
    sent_mb_max: float
    bandwidth_gbs: float
    peak_gbs: float
    group_tokens: int
    note: str = ""
    wire_ms: float = float("nan")
    graph_fwd_ms: float = float("nan")  # the forward replayed as one CUDA graph (static dispatchers on CUDA only)

    @property
    def case(self) -> str:
        return f"{TRANSFORMERS_EP} ({self.mode})" if self.dispatcher == TRANSFORMERS_EP else f"{self.dispatcher}: {self.mode}"

    def speedup_over(self, base: "Row", backward: bool) -> float:
        """Group tokens per second relative to `base`, forward or forward+backward."""
        mine, theirs = (self.fwd_bwd_ms, base.fwd_bwd_ms) if backward else (self.fwd_ms, base.fwd_ms)
        return (self.group_tokens / mine) / (base.group_tokens / theirs)


# ----- the layer -------------------------------------------------------------------------------
def build_config(shape: ExpertShape):
    import transformers

    spec = HF_EXPERTS[shape.family]
    extra = BLOCKS[shape.family][2]
    return getattr(transformers, spec.config_class)(
        hidden_act="silu", num_hidden_layers=1, vocab_size=256, num_attention_heads=16, num_key_value_heads=16,
        **spec.config_kwargs(shape), **extra,
    )  # fmt: skip


def build_model(config, device, dtype, seed: int) -> torch.nn.Module:
    """The one-layer causal LM of `config`, weights drawn from `seed` (the same on every rank and for every case)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    return model.to(dtype)


def occult_layer(model, occult_config: OccultConfig, logits_TE):
    """A copy of `model` converted by `apply_occult`; returns its one `OccultMoE` (replaying `logits_TE` if given)."""
    from occult_hf.hf.apply import apply_occult, occult_modules

    converted = apply_occult(copy.deepcopy(model), occult_config)
    (layer,) = occult_modules(converted).values()
    if logits_TE is not None:
        layer.adapter = ReplayAdapter(layer.adapter, logits_TE)
    return converted, layer


class ReplayAdapter:
    """The family adapter, but the router's logits are replaced by ones built from a routing trace.

    Everything else (selection rule, experts, shared experts) is the family adapter's, so pruning and
    weights follow the model's own rules on the replayed choice.
    """

    def __init__(self, adapter, logits_TE: torch.Tensor) -> None:
        self._adapter = adapter
        self.logits_TE = logits_TE

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def route(self, block, x):
        from occult_hf.patches import RouterOutput

        allowed_TE = torch.ones_like(self.logits_TE, dtype=torch.bool)
        weights_Tk, ids_Tk = self._adapter.select(block, self.logits_TE, allowed_TE)
        return RouterOutput(self.logits_TE, weights_Tk, ids_Tk)


def trace_logits(trace_ids_Nk: np.ndarray, num_experts: int, tokens: int, rank: int, device, seed: int) -> torch.Tensor:
    """`[T, E]` logits whose top-k are the trace's expert sets, rank r reading tokens r*T.. (tiled)."""
    index = (rank * tokens + np.arange(tokens)) % trace_ids_Nk.shape[0]
    ids_Tk = torch.as_tensor(trace_ids_Nk[index], dtype=torch.int64, device=device)
    generator = torch.Generator(device=device).manual_seed(seed + rank)
    logits_TE = torch.randn(tokens, num_experts, generator=generator, device=device)
    ranks_k = torch.arange(ids_Tk.shape[1], 0, -1, device=device, dtype=torch.float32)
    return logits_TE.scatter(1, ids_Tk, 8.0 + ranks_k.expand_as(ids_Tk))


def load_trace(path: str) -> np.ndarray:
    """`[N, k]` int64 expert ids of a routing trace, warm-up dummy rows dropped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"routing trace {path!r} is not a file")
    with np.load(path) as data:
        if "topk_ids" not in data:
            raise ValueError(f"routing trace {path!r} has no 'topk_ids' array (keys: {sorted(data.files)})")
        ids = data["topk_ids"].astype(np.int64)
        if "is_warmup_dummy" in data:
            ids = ids[~data["is_warmup_dummy"].astype(bool)]
    return ids


def trace_fits(trace_ids_Nk: np.ndarray | None, shape: ExpertShape) -> bool:
    """Whether a trace was recorded on a model with this shape's E and k (its ids span exactly E)."""
    return (
        trace_ids_Nk is not None
        and trace_ids_Nk.shape[1] == shape.top_k
        and int(trace_ids_Nk.max()) + 1 == shape.num_experts
    )


def refined_placement(routing_ids_Tk: torch.Tensor, shape: ExpertShape, world: int, redundant: int = 0) -> Placement:
    """A refined placement planned on the first half of the routing that rank 0 sees (broadcast); `redundant`
    extra expert slots (`num_redundant_experts`) for replicas."""
    accumulator = LayerAccumulator(shape.num_experts, shape.top_k, sample_size=None)
    accumulator.update(routing_ids_Tk[: routing_ids_Tk.shape[0] // 2].cpu())
    profile = RoutingProfile(shape.num_experts, shape.top_k, {0: accumulator.to_layer_routing()}, model_type=shape.family)
    placement = plan_placement(profile, world, "refined", progress=False, num_redundant_experts=redundant)
    holder = [placement.to_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Placement.from_dict(holder[0])


# ----- timing ----------------------------------------------------------------------------------
def timed(fn, iterations: int, device, warmup: int = 1) -> float:
    """Median ms of `fn` over `iterations` after `warmup` calls, the ranks aligned by a barrier before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        if dist.is_initialized():
            dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graphed_ms(fn, iterations: int, device) -> float:
    """Median ms of `fn` captured once in a CUDA graph (`occult_hf.utils.cuda_graph.capture`) and replayed, as `timed`
    times it."""
    from occult_hf.utils.cuda_graph import capture

    replay = capture(fn, device, warmup=2)[0].replay
    try:
        return timed(replay, iterations, device)
    finally:
        _synchronize(device)
        del replay


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def uniform_all_to_all_gbs(bytes_per_rank: int, iterations: int, device, world: int) -> float:
    """Bandwidth (GB/s of bytes sent to other ranks) of `all_to_all_single` with equal splits."""
    if world == 1:
        return float("nan")
    chunk = max(bytes_per_rank // (world - 1) // 2, 1)  # bf16 elements to each peer
    send = torch.ones(chunk * world, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    ms = timed(lambda: dist.all_to_all_single(recv, send), iterations, device)
    return chunk * 2 * (world - 1) / (ms / 1e3) / 1e9


def max_and_mean(value: float, device) -> tuple[float, float]:
    """The largest and the mean of `value` over the ranks (the slowest rank sets a step's time)."""
    if not dist.is_initialized():
        return value, value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    values = [g.item() for g in gathered]
    return max(values), sum(values) / len(values)


# ----- skipping the exchange --------------------------------------------------------------------
class _Received:
    """A finished exchange replayed: `.wait()` returns what the recorded one received."""

    def __init__(self, out) -> None:
        self.out = out

    def wait(self):
        return self.out


class ExchangeRecorder:
    """Records every collective a dispatcher makes (`exchange`, and the count exchange where it has one),
    then replays their results in the same order without communicating: the layer's compute alone."""

    METHODS = ("exchange", "_exchange_counts")

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher
        self.calls: dict[str, list] = {name: [] for name in self.METHODS}
        self.sent: list[torch.Tensor] = []  # the blocks `exchange` was given (a static transport's send sizes)
        self.position = dict.fromkeys(self.METHODS, 0)
        self.replaying = False
        for name in self.METHODS:
            if hasattr(dispatcher, name):
                setattr(dispatcher, name, self._wrap(name, getattr(dispatcher, name)))

    def _wrap(self, name, original):
        def method(*args, **kwargs):
            if self.replaying:
                calls = self.calls[name]
                result = calls[self.position[name] % len(calls)]
                self.position[name] += 1
                return _Received(result.out) if hasattr(result, "wait") else result
            result = original(*args, **kwargs)
            self.calls[name].append(result)
            if name == "exchange":
                self.sent.append(args[0])
            return result

        return method

    def wire(self):
        """A function that re-issues, back to back, the row exchanges recorded (`all_to_all_single` with the
        same split sizes and bytes, buffers allocated once; "padded": its equal-split blocks, padding included):
        the wire time of the layer's exchanges alone."""
        from occult_hf.dispatch.static import PaddedDispatcher

        calls = []
        for pending, block in zip(self.calls["exchange"], self.sent):
            if isinstance(self.dispatcher, PaddedDispatcher):  # equal splits: the same blocks again
                calls.append((pending[0].new_empty(pending[0].shape), block.new_empty(block.shape), None, None))
                continue
            if not hasattr(pending, "send_splits"):
                return None  # a transport that is no all_to_all_single ("symm_mem": the device reads the splits)
            out = pending.out
            send = out.new_empty((sum(pending.send_splits), *out.shape[1:]))
            recv = out.new_empty((sum(pending.recv_splits), *out.shape[1:]))
            calls.append((recv, send, list(pending.recv_splits), list(pending.send_splits)))

        def run():
            for recv, send, recv_splits, send_splits in calls:
                dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits)

        return run

    def replay(self) -> None:
        """Replay from the first recorded call (call before each replayed run)."""
        self.replaying = True
        self.position = dict.fromkeys(self.METHODS, 0)

    def restore(self) -> None:
        for name in self.METHODS:
            self.dispatcher.__dict__.pop(name, None)


# ----- one case --------------------------------------------------------------------------------
def serving_dispatchers(requested: list[str] | None, world: int, device: torch.device) -> list[str]:
    """`--dispatchers` (None: `DISPATCHERS` on several ranks, "local" on one), refused before any model is built when
    none of them serves this group (each case would be skipped, and the run would end with an empty table)."""
    requested = requested or (list(DISPATCHERS) if world > 1 else ["local"])
    reasons = []
    for name in requested:
        try:
            dispatcher_class(name, _group_of(world), device if device.type == "cuda" else None)
            return requested
        except ValueError as error:
            reasons.append(str(error))
    raise ValueError(f"bench ep: no dispatcher of --dispatchers {' '.join(requested)} serves {world} rank(s): {'; '.join(reasons)}")


#: the dispatchers of the small-batch, CUDA-graph path, which run one mode (dedup+refined)
STATIC_DISPATCHERS = ("padded", "symm_mem")


def cases(args, world: int) -> list[tuple[str, Mode]]:
    """(dispatcher, mode) pairs to run: every mode on every requested dispatcher that serves this group."""
    dynamic = [name for name in args.dispatchers if name not in STATIC_DISPATCHERS]
    pruning_on = "all_to_all" if "all_to_all" in dynamic else next(iter(dynamic), None)
    chosen = []
    for name in args.dispatchers:
        for mode in MODES + EXTRA_MODES:
            if mode.name not in args.modes or (mode.max_devices_per_token or 0) > world:
                continue
            if mode.placement == "file" and getattr(args, "placement", None) is None:
                raise ValueError("bench ep mode dedup+file needs --placement FILE (an occult_placement.json)")
            if mode.max_devices_per_token and name != pruning_on:
                continue  # pruning changes the routing, not the transport: one dispatcher shows it
            if name in STATIC_DISPATCHERS and mode.name != "dedup+refined":
                continue  # the static dispatchers (the small-batch, CUDA-graph path): one row per shape and T
            chosen.append((name, mode))
    return chosen


def modes_without_cases(args, world: int) -> list[str]:
    """Why each requested mode runs in no case (said before the run, not left to a table that lacks its rows)."""
    running = {mode.name for _, mode in cases(args, world)}
    reasons = []
    for mode in MODES + EXTRA_MODES:
        if mode.name not in args.modes or mode.name in running:
            continue
        if (mode.max_devices_per_token or 0) > world:
            limit = mode.max_devices_per_token
            reasons.append(f"{mode.name}: prunes to {limit} devices per token, more than the {world} rank(s)")
        else:
            reasons.append(f"{mode.name}: --dispatchers {' '.join(args.dispatchers)} run only dedup+refined")
    return reasons


def measure(shape_name: str, tokens: int, trace, args, device, dtype, rank: int, world: int, log, saved=None) -> list[Row]:
    """Every case of one shape and T; `saved(rows)` (optional) after each case, so that a run cut short (a
    hung collective, the call's time limit) keeps the cases measured before it."""
    shape = SHAPES[shape_name]
    if args.hidden is not None:  # shrink the matrices, keep E, k and the routing
        shape = replace(shape, hidden=args.hidden)
    if args.intermediate is not None:
        shape = replace(shape, intermediate=args.intermediate)
    config = build_config(shape)
    model = build_model(config, device, dtype, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + 7 * rank)
    x_TH = torch.randn(tokens, shape.hidden, generator=generator, device=device).to(dtype)

    if trace_fits(trace, shape):
        logits_TE = trace_logits(trace, shape.num_experts, tokens, rank, device, args.seed)
        routing_name = "Qwen1.5 trace"
    else:
        logits_TE = None
        routing_name = "random router"

    rows: list[Row] = []
    planned = {}  # placement name -> Placement, planned once per shape and T
    ep_device = device if torch.device(device).type == "cuda" else None
    for dispatcher, mode in cases(args, world):
        try:
            dispatcher_class(dispatcher, _group_of(world), ep_device)
        except ValueError as error:
            log(f"{shape_name} T={tokens} {dispatcher}: skipped ({error})")
            continue
        if mode.placement == "contiguous":
            placement = Placement.contiguous(shape.num_experts, world, [0])
        elif mode.placement == "file":
            placement = Placement.load(args.placement)
            placement = Placement(placement.num_experts, placement.num_devices, {0: placement.device_of(min(placement.layers))},
                                  placement.meta, replicas={0: placement.replicas.get(min(placement.layers), {})})
        else:
            if mode.placement not in planned:
                _, probe = occult_layer(model, OccultConfig(num_devices=world), logits_TE)
                ids_Tk = probe.adapter.route(probe.original_block, x_TH[None]).topk_ids_Tk
                planned[mode.placement] = refined_placement(ids_Tk, shape, world, world if mode.placement == "replicated" else 0)
                del probe
            placement = planned[mode.placement]
        occult_config = OccultConfig(
            placement=placement,
            num_devices=world,
            dispatch=mode.dispatch,
            dispatcher=dispatcher,
            prune="router" if mode.max_devices_per_token else None,
            max_devices_per_token=mode.max_devices_per_token,
            expert_backend=args.expert_backend,
            dispatch_chunks=args.chunks if REGISTERED_DISPATCHERS.trait(dispatcher, "overlaps_chunks") else None,
            replica_choice=mode.replica_choice,
        )
        converted, layer = occult_layer(model, occult_config, logits_TE)
        try:
            rows.append(_measure_layer(layer, x_TH, shape_name, tokens, routing_name, dispatcher, mode, args, device, world))
            log(f"{shape_name} T={tokens} {rows[-1].case}: fwd {rows[-1].fwd_ms:.2f} ms (skipped exchange {rows[-1].skipped_fwd_ms:.2f})")
        except Exception as error:  # noqa: BLE001 - one failing case is a row that says so, not a lost run
            log(f"{shape_name} T={tokens} {dispatcher}: {mode.name} FAILED: {type(error).__name__}: {error}")
            rows.append(_failed_row(shape_name, tokens, routing_name, dispatcher, mode.name, world, f"{type(error).__name__}: {str(error)[:120]}"))
        del converted, layer
        if dispatcher == "symm_mem":
            from occult_hf.dispatch.static import release_symmetric_buffers

            release_symmetric_buffers()
        if saved is not None:
            saved(rows)
    if TRANSFORMERS_EP in args.modes:
        try:
            rows.append(_measure_transformers_ep(config, shape_name, tokens, args, device, dtype, rank, world))
            log(f"{shape_name} T={tokens} {TRANSFORMERS_EP}: fwd {rows[-1].fwd_ms:.2f} ms")
        except Exception as error:  # noqa: BLE001
            log(f"{shape_name} T={tokens} {TRANSFORMERS_EP} FAILED: {type(error).__name__}: {error}")
            rows.append(_failed_row(shape_name, tokens, "own router", TRANSFORMERS_EP, "all_to_all", world, f"{type(error).__name__}: {str(error)[:120]}"))
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _group_of(world: int):
    from occult_hf.dispatch import ExpertParallelGroup

    return ExpertParallelGroup.resolve(num_devices=world)


def _failed_row(shape_name, tokens, routing, dispatcher, mode, world, note) -> Row:
    nan = float("nan")
    return Row(shape_name, tokens, routing, dispatcher, mode, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, tokens * world, note)


def _measure_layer(layer, x_TH, shape_name, tokens, routing_name, dispatcher: str, mode: Mode, args, device, world) -> Row:
    hidden = x_TH[None]  # [1, T, H]: the block's input shape

    def forward():
        with torch.no_grad():
            layer(hidden)

    x_grad = hidden.detach().clone().requires_grad_(True)
    upstream = torch.randn_like(hidden)

    def forward_backward():
        layer(x_grad).backward(upstream)
        for param in layer.parameters():
            param.grad = None

    layer.stats.reset()
    forward()
    rows_sent_D = layer.stats.rows_sent.clone()
    row_bytes = int(layer.stats.bytes_sent.sum().item() // max(int(layer.stats.rows_sent.sum().item()), 1))
    own = layer.ep.rank
    remote_rows = int(rows_sent_D.sum().item() - rows_sent_D[own].item()) if world > 1 else 0
    # dispatch sends rows with metadata; combine returns activations only
    remote_bytes = remote_rows * (row_bytes + x_TH.shape[1] * x_TH.element_size())
    routing = layer.adapter.route(layer.original_block, hidden)
    dispatched = TokenRouting(routing.topk_ids_Tk, routing.topk_weights_Tk)
    if layer.pruner is not None:
        dispatched = layer.pruner.route(layer.original_block, routing)
    # CT from the devices the dispatch serves each pair on (with replicas: the replica rule's home)
    dest_Tk, _ = layer.dispatcher.destinations_of(dispatched)
    ct = float(torch.zeros(dest_Tk.shape[0], world, dtype=torch.bool, device=dest_Tk.device).scatter_(1, dest_Tk, True).sum(1).float().mean())

    def exchange():
        with torch.no_grad():
            sent = layer.dispatcher.dispatch(x_TH, dispatched)
            layer.dispatcher.combine(sent.x_RH, sent.plan)

    fwd_ms = timed(forward, args.iterations, device)
    fwd_bwd_ms = timed(forward_backward, args.iterations, device)
    exchange_ms = timed(exchange, args.iterations, device)

    skipped = []
    wire_ms = float("nan")
    for fn in (forward, forward_backward):
        recorder = ExchangeRecorder(layer.dispatcher)
        fn()  # recorded
        _synchronize(device)
        if fn is forward and world > 1:
            wire = recorder.wire()
            if wire is not None:
                wire_ms = timed(wire, args.iterations, device)

        def replayed(fn=fn, recorder=recorder):
            recorder.replay()
            fn()

        skipped.append(timed(replayed, args.iterations, device))
        recorder.restore()

    sent_max, sent_mean = max_and_mean(remote_bytes / 1e6, device)
    _, ct_mean = max_and_mean(ct, device)
    peak = uniform_all_to_all_gbs(int(sent_max * 1e6), args.iterations, device, world)
    exchange_max, _ = max_and_mean(exchange_ms, device)
    bandwidth = sent_max * 1e6 / (exchange_max / 1e3) / 1e9 if world > 1 else float("nan")
    fwd_max, _ = max_and_mean(fwd_ms, device)
    fwd_bwd_max, _ = max_and_mean(fwd_bwd_ms, device)
    skipped_fwd, _ = max_and_mean(skipped[0], device)
    skipped_fwd_bwd, _ = max_and_mean(skipped[1], device)
    wire_max, _ = max_and_mean(wire_ms, device)
    graph_ms = float("nan")
    if torch.device(device).type == "cuda" and layer.dispatcher.graph_capturable:
        graph_ms = graphed_ms(forward, args.iterations, device)
    graph_max, _ = max_and_mean(graph_ms, device)
    if args.profile:
        profile_layer(layer, x_TH, f"{shape_name} T={tokens} {dispatcher}: {mode.name}", Path(args.out), device)
    return Row(shape_name, tokens, routing_name, dispatcher, mode.name, fwd_max, fwd_bwd_max, skipped_fwd, skipped_fwd_bwd,
               exchange_max, ct_mean, sent_mean, sent_max, bandwidth, peak, tokens * world, wire_ms=wire_max,
               graph_fwd_ms=graph_max)  # fmt: skip


# ----- where the time goes ------------------------------------------------------------------------
def profile_layer(layer, x_TH, label: str, out: Path, device) -> None:
    """One forward and one forward+backward of `layer` under `torch.profiler` (`profile_steps`, each warmed
    once first). Rank 0 prints the summary and appends it to `<out>/bench_ep_profile.md`."""
    hidden = x_TH[None]
    x_grad = hidden.detach().clone().requires_grad_(True)
    upstream = torch.randn_like(hidden)

    def step(backward: bool):
        if backward:
            layer(x_grad).backward(upstream)
            for param in layer.parameters():
                param.grad = None
        else:
            with torch.no_grad():
                layer(hidden)

    summary = profile_steps(step, device, warm=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = f"### {label}\n\n{summary}\n"
        print(text, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "bench_ep_profile.md"
        earlier = path.read_text() if path.exists() else ""
        atomic_write_text(path, earlier + text + "\n")  # appended: the file keeps every profiled run


def profile_steps(step, device, *, warm: bool, top: int = 14) -> str:
    """`profile_summary` of `step(False)` (a forward) and `step(True)` (a forward+backward), each run once more
    before it when `warm`, the ranks aligned by a barrier and the device idle before each: per `occult::` stage
    (the dispatcher's named ranges) its host time and the device time of the kernels it launched, the GPU's busy
    time (union of kernel intervals) against the wall time, and the `top` costliest kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    sections = []
    for backward in (False, True):
        if warm:
            step(backward)
        if dist.is_initialized():
            dist.barrier()
        _synchronize(device)
        name = "forward+backward" if backward else "forward"
        with profile(activities=activities) as prof:
            with record_function(f"bench::{name}"):
                step(backward)
                _synchronize(device)
        sections.append(profile_summary(prof, name, top=top))
    return "\n\n".join(sections)


def idle_gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float, int, int]]:
    """`(start, end, before, after)` of every stretch between the first of the device `intervals` (start, end) and the
    last in which none runs: `before` indexes the interval that ran last before it (the one reaching furthest), `after`
    the one that ends it."""
    gaps, last_end, last = [], None, None
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        start, end = intervals[i]
        if last_end is not None and start > last_end:
            gaps.append((last_end, start, last, i))
        if last_end is None or end > last_end:
            last_end, last = end, i
    return gaps


def busy_time(intervals: list[tuple[float, float]]) -> tuple[float, float, int]:
    """(busy, span, gaps) of device `intervals` (start, end): the length of their union, the time from the first start
    to the last end, and how many idle gaps lie between (`idle_gaps`). `span - busy` is what the device idled within
    the step, which says whether a step is host-bound where wall against busy cannot: the wall also counts the host's
    time before the first kernel and the profiler's own."""
    if not intervals:
        return 0.0, 0.0, 0
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    gaps = idle_gaps(intervals)
    return span - sum(end - start for start, end, _, _ in gaps), span, len(gaps)


def _device_us(event) -> float:
    return float(getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0) or 0.0)


def profile_summary(prof, name: str, top: int = 14) -> str:
    """Markdown of a profiled step recorded inside `record_function(f"bench::{name}")`: its wall and GPU busy time,
    the device time of each `occult::` stage, the `top` costliest kernels and the `top` host operators by their own
    host time (also `occult bench realsize --profile` and `occult bench model --profile`)."""
    events = prof.events()
    kernels = [  # device events that are kernels, not the device-side spans of named ranges (which cover their kernels)
        e for e in events
        if str(getattr(e, "device_type", "")).endswith("CUDA")
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith(("bench::", "occult::", "nccl:"))
    ]  # fmt: skip
    busy, span, gaps = busy_time([(k.time_range.start, k.time_range.end) for k in kernels])
    wall = next((e.cpu_time_total for e in events if e.name == f"bench::{name}"), float("nan"))
    lines = [
        f"**{name}**: wall {wall / 1e3:.2f} ms (host, to the last kernel), GPU busy {busy / 1e3:.2f} ms "
        f"(union of kernel intervals, all streams) of the {span / 1e3:.2f} ms from the first kernel to the last (idle "
        f"{(span - busy) / 1e3:.2f} ms in {gaps} gaps), {len(kernels)} kernels, "
        f"{sum(k.time_range.end - k.time_range.start for k in kernels) / 1e3:.2f} ms summed",
        "",
        "(each stage twice: its host range, and its device-side range with host ms 0)",
        "",
    ]
    stages = [e for e in prof.key_averages() if e.key.startswith("occult::")]
    lines.append(markdown_table(["stage", "calls", "host ms", "device ms (its kernels)"], [
        [e.key[len("occult::"):], e.count, f"{e.cpu_time_total / 1e3:.3f}", f"{_device_us(e) / 1e3:.3f}"]
        for e in sorted(stages, key=lambda e: -_device_us(e))
    ]))  # fmt: skip
    by_kernel: dict[str, list[float]] = {}
    for k in kernels:
        by_kernel.setdefault(k.name, []).append(k.time_range.end - k.time_range.start)
    busiest = sorted(by_kernel.items(), key=lambda item: -sum(item[1]))[:top]
    lines += ["", markdown_table(["kernel", "calls", "device ms"], [[f"`{k[:90]}`", len(t), f"{sum(t) / 1e3:.3f}"] for k, t in busiest])]
    # where the host's time goes (an operator's own time, its children excluded): the launch and Python overhead
    # that leaves the GPU idle when wall exceeds busy
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and not e.key.startswith(("bench::", "occult::"))]
    slowest = sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]
    lines += ["", markdown_table(["host operator", "calls", "self host ms"], [[f"`{e.key[:90]}`", e.count, f"{e.self_cpu_time_total / 1e3:.3f}"] for e in slowest])]
    return "\n".join(lines)


# ----- transformers' own expert parallelism -----------------------------------------------------
def _transformers_ep_config(world: int):
    """`(DistributedConfig, each rank its own batch?)` of transformers' EP over `world` ranks."""
    import inspect

    from transformers.distributed import DistributedConfig

    if "ep_size" in inspect.signature(DistributedConfig).parameters:  # transformers >= 5.21
        return DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation="all_to_all"), True
    return DistributedConfig(tp_plan="auto", enable_expert_parallel=True), False


def transformers_ep_model(config, args, dtype, rank: int, world: int):
    """A one-layer checkpoint of the shape loaded with transformers' own expert parallelism."""
    from transformers import AutoModelForCausalLM

    holder = [tempfile.mkdtemp(prefix="occult_bench_ep_") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    if rank == 0:
        torch.manual_seed(args.seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    distributed_config, own_batch = _transformers_ep_config(world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=distributed_config)
    return model, own_batch


def first_moe_block(model):
    """The first decoder layer's MoE block of a model that transformers' EP sharded; under FSDP2 the
    layer's own parameters (the router) are gathered once, so that the timing sees only the experts' path."""
    decoder_layer = model.model.layers[0]
    if hasattr(decoder_layer, "unshard"):
        decoder_layer.unshard()
    return decoder_layer.mlp


def time_block(block, hidden_size: int, tokens: int, seed: int, iterations: int, device, dtype) -> tuple[float, float]:
    """Forward and forward+backward ms (the slowest rank) of one MoE block on random hidden states of
    `tokens` rows; gradients are cleared after every step so that no step pays for accumulation."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, tokens, hidden_size, generator=generator, device=device).to(dtype)
    x_grad = hidden.clone().requires_grad_(True)
    upstream = torch.randn_like(hidden)

    def forward():
        with torch.no_grad():
            block(hidden)

    def forward_backward():
        out = block(x_grad)
        (out[0] if isinstance(out, tuple) else out).backward(upstream)
        x_grad.grad = None
        for param in block.parameters():
            param.grad = None

    fwd_ms, _ = max_and_mean(timed(forward, iterations, device), device)
    fwd_bwd_ms, _ = max_and_mean(timed(forward_backward, iterations, device), device)
    return fwd_ms, fwd_bwd_ms


def _measure_transformers_ep(config, shape_name, tokens, args, device, dtype, rank, world) -> Row:
    model, own_batch = transformers_ep_model(config, args, dtype, rank, world)
    model = model.to(device)  # transformers 5.17 left a one-rank tensor-parallel load on the CPU
    seed = args.seed + (7 * rank if own_batch else 0)  # 5.17's EP: every rank the same batch
    fwd_ms, fwd_bwd_ms = time_block(first_moe_block(model), config.hidden_size, tokens, seed, args.iterations, device, dtype)
    nan = float("nan")
    group = tokens * world if own_batch else tokens
    note = "" if own_batch else "all ranks one batch (transformers < 5.21)"
    return Row(shape_name, tokens, "own router", TRANSFORMERS_EP, "all_to_all", fwd_ms, fwd_bwd_ms, nan, nan, nan, nan, nan, nan, nan, nan, group, note)


# ----- report ----------------------------------------------------------------------------------
def results_table(rows: list[Row]) -> str:
    header = ["shape", "T/rank", "routing", "dispatcher: mode", "CT", "fwd ms", "fwd ms, CUDA graph", "fwd+bwd ms", "fwd / skipped exch.",
              "fwd+bwd / skipped", "exchange ms", "wire ms", "sent MB mean/max", "exch. GB/s", "wire GB/s", "a2a GB/s same volume",
              "group Mtok/s fwd", "vs per_expert fwd", "fwd+bwd", "vs transformers EP fwd", "fwd+bwd"]  # fmt: skip
    lines = []
    baselines = {(r.shape, r.tokens_per_rank, r.dispatcher): r for r in rows if r.mode == BASELINE_MODE}
    theirs = {(r.shape, r.tokens_per_rank): r for r in rows if r.dispatcher == TRANSFORMERS_EP}
    for r in rows:
        base = baselines.get((r.shape, r.tokens_per_rank, r.dispatcher))
        hf = theirs.get((r.shape, r.tokens_per_rank))

        def ratio(other, backward):
            return f"{r.speedup_over(other, backward):.2f}x" if other is not None and r is not other else "-"

        cells = [r.shape, str(r.tokens_per_rank), r.routing, r.case + (f" ({r.note})" if r.note else ""), f"{r.ct:.2f}",
                 f"{r.fwd_ms:.2f}", "-" if r.graph_fwd_ms != r.graph_fwd_ms else f"{r.graph_fwd_ms:.2f}",
                 f"{r.fwd_bwd_ms:.2f}", f"{r.fwd_ms / r.skipped_fwd_ms:.2f}",
                 f"{r.fwd_bwd_ms / r.skipped_fwd_bwd_ms:.2f}", f"{r.exchange_ms:.2f}", f"{r.wire_ms:.2f}",
                 f"{r.sent_mb_mean:.1f}/{r.sent_mb_max:.1f}", f"{r.bandwidth_gbs:.0f}",
                 f"{r.sent_mb_max / r.wire_ms:.0f}", f"{r.peak_gbs:.0f}",
                 f"{r.group_tokens / r.fwd_ms / 1e3:.2f}", ratio(base, False), ratio(base, True),
                 ratio(hf, False), ratio(hf, True)]  # fmt: skip
        lines.append(cells)
    return markdown_table(header, lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.fwd_ms == r.fwd_ms]
    cases_ = sorted({(r.shape, r.tokens_per_rank) for r in shown})
    labels = list(dict.fromkeys(r.case for r in shown))
    fig, axes = plt.subplots(len(cases_), 1, figsize=(10, 2.2 * max(len(cases_), 1)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases_):
        values = [next((r.fwd_ms for r in shown if (r.shape, r.tokens_per_rank) == case and r.case == label), 0.0) for label in labels]
        skipped = [next((r.skipped_fwd_ms for r in shown if (r.shape, r.tokens_per_rank) == case and r.case == label), 0.0) for label in labels]
        ax.barh(range(len(labels)), values, color="tab:blue", label="forward")
        ax.barh(range(len(labels)), np.nan_to_num(skipped), height=0.4, color="tab:orange", label="exchange skipped")
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_title(f"{case[0]}, T={case[1]} per rank", fontsize=8)
        ax.set_xlabel("ms (slowest rank)", fontsize=7)
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)


def save_results(rows: list[Row], world: int, dtype, device, out: Path, chunks: int | None = None, final: bool = True) -> None:
    """Write `bench_ep_<D>x<device>.md/.json` under `out`; `final`: also print the table and draw the `.png`."""
    table = results_table(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"`occult bench ep`, {world} rank(s), {dtype}, dispatch_chunks={chunks or 'default'} (all_to_all), {stamp}, {machine_line(device)}"
    )
    if final:
        print(f"\n{header}\n\n{table}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{world}x{torch.device(device).type}"
    atomic_write_text(out / f"bench_ep{suffix}.md", f"{header}\n\n{table}\n")
    atomic_write_text(out / f"bench_ep{suffix}.json", json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    if final:
        plot(rows, out / f"bench_ep{suffix}.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..utils.arguments import positive_int

    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[128, 4096, 16384], help="tokens per rank")
    parser.add_argument(
        "--dispatchers", nargs="+",
        help=f"registered dispatchers (default: {' '.join(DISPATCHERS)}; on one rank 'local', the only one that serves it)",
    )
    parser.add_argument(
        "--modes", nargs="+", default=[m.name for m in MODES] + [TRANSFORMERS_EP],
        choices=[m.name for m in MODES + EXTRA_MODES] + [TRANSFORMERS_EP],
        help="cases to run (default: all but dedup+replicated[+load_aware] and dedup+file, which run on request)",
    )
    parser.add_argument(
        "--placement", default=None,
        help="occult_placement.json for mode dedup+file (its lowest layer is the benchmark's layer; replicas allowed)",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help=f"routing trace (.npz, topk_ids [T, k]) replayed for the shape with its E and k "
        f"(default: {QWEN15_TRACE} when present, else every shape uses its router)",
    )
    parser.add_argument(
        "--chunks", type=positive_int, default=None, help="OccultConfig.dispatch_chunks of every layer run by a dispatcher that overlaps chunks (all_to_all; default: "
        "occult_hf.dispatch.DEFAULT_CHUNKS)"
    )
    parser.add_argument("--iterations", type=positive_int, default=20)
    parser.add_argument(
        "--profile", action="store_true",
        help="also profile one forward and one forward+backward of every case (torch.profiler): time per dispatcher "
        "stage, GPU busy time, costliest kernels; appended to <out>/bench_ep_profile.md",
    )  # fmt: skip
    parser.add_argument("--expert-backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--hidden", type=positive_int, default=None, help="override H (CPU dry runs), keeping E, k and routing")
    parser.add_argument("--intermediate", type=positive_int, default=None, help="override I (CPU dry runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_ep.md/.json/.png (rank 0) (default: ./docs)")


def init_from_torchrun(timeout: datetime.timedelta | None = None) -> tuple[int, int, torch.device]:
    """`(rank, world size, device)`; under torchrun, the process group (NCCL on GPUs, gloo on CPUs) set up with
    this rank's GPU bound first (NVSHMEM binds one device per process at its first use); `timeout` bounds
    every collective (None: torch's default)."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=local, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, device


def run(args: argparse.Namespace) -> int:
    rank, world, device = init_from_torchrun()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    args.dispatchers = serving_dispatchers(args.dispatchers, world, device)

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    left_out = modes_without_cases(args, world)
    if not cases(args, world) and TRANSFORMERS_EP not in args.modes:
        raise ValueError(f"bench ep: no requested mode runs on {world} rank(s): {'; '.join(left_out)}")
    for reason in left_out:
        log(f"--modes {reason}: no row")

    if args.trace is None and not os.path.isfile(QWEN15_TRACE):
        log(f"no routing trace at {QWEN15_TRACE}: every shape routes with its own (random) router")
        trace = None
    else:
        trace = load_trace(args.trace or QWEN15_TRACE)
    rows = []
    for tokens in args.tokens:  # every shape at the first T first: a run cut short keeps whole comparisons
        for shape_name in args.shapes:

            def saved(shape_rows, before=list(rows)):  # after every case: a later failure or hang keeps what was measured
                if rank == 0:
                    save_results(before + shape_rows, world, dtype, device, Path(args.out), args.chunks, final=False)

            rows.extend(measure(shape_name, tokens, trace, args, device, dtype, rank, world, log, saved))
            if rank == 0:
                save_results(rows, world, dtype, device, Path(args.out), args.chunks)
    if dist.is_initialized():
        dist.barrier()
    return 0
