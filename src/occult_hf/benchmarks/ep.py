"""`occult bench ep`: one expert-parallel MoE layer under torchrun, Occult against the per-expert all-to-all.

Shape legend: T tokens per rank, H hidden, E routed experts, k experts per token, D ranks.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench ep ...` (NCCL on GPUs, gloo on CPUs).
Each rank builds the same real transformers MoE block (OLMoE, Qwen2-MoE with its sigmoid-gated shared
expert, DeepSeek-V2 greedy with two shared experts for DeepSeek-MoE-16B), bf16 on GPU, and feeds its
own T tokens. Routing is replayed from the real Qwen1.5-MoE trace (`--trace`, tiled to D*T tokens,
rank r reading the window that starts at r*T) for the shape with its expert count, and comes from the
block's own (random) router for the other shapes: a random router has no co-activation structure, so
placement can only balance load there, and the table says which routing each row used. Replayed ids
enter through router logits built from the trace (trace ids highest), so the model's own selection
rule and pruning operate on them.

Modes, each a fresh block with the same weights: `transformers_ep`, transformers' own expert
parallelism as shipped (a one-layer checkpoint of the shape loaded with
`DistributedConfig(tp_plan="auto", enable_expert_parallel=True)`: every rank holds E/D experts, all
ranks see the same batch and the experts' outputs are all-reduced, so the group processes T tokens per
step, not D*T; it routes with its own router, and its communication does not depend on routing);
`per_expert` + contiguous placement (the baseline
that transformers' all-to-all EP, Tutel and Megatron's alltoall dispatcher implement), `dedup` +
contiguous, `dedup` + refined placement (planned on the first half of the replayed routing), and
`dedup` + refined pruned to N_d=2 and N_d=1 (router mode). Per mode: forward and forward+backward time
of the layer (median over iterations, ranks aligned by a barrier before each), the exchange alone
(dispatch + combine with the experts skipped), bytes each rank sends to other ranks (dispatch and
combine, mean and max over ranks), the achieved bandwidth of the exchange against a uniform
`all_to_all_single` of the same per-rank volume measured in the same run, group tokens per second
(D*T / layer time) and the ratio to `per_expert` + contiguous.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.benchmarks.experts import HF_EXPERTS, SHAPES, ExpertShape, machine_line
from occult_hf.config import OccultConfig
from occult_hf.dispatch import ExpertParallelGroup, TokenRouting
from occult_hf.metrics import mean_ct
from occult_hf.moe import OccultMoE
from occult_hf.patches import adapter_for
from occult_hf.placement import Placement, plan_placement
from occult_hf.profile import RoutingProfile
from occult_hf.routing_stats import LayerAccumulator

HELP = "expert-parallel MoE layer under torchrun: dedup/placement/pruning vs the per-expert all-to-all"
DESCRIPTION = __doc__.split("\n\n", 1)[1]

DEFAULT_TRACE = "../shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
BASELINE = "per_expert+contiguous"


@dataclass(frozen=True)
class Mode:
    """One way of running the layer."""

    dispatch: str
    placement: str
    max_devices_per_token: int | None = None

    @property
    def name(self) -> str:
        pruned = f"+Nd={self.max_devices_per_token}" if self.max_devices_per_token else ""
        return f"{self.dispatch}+{self.placement}{pruned}"


TRANSFORMERS_EP = Mode("transformers_ep", "contiguous")
MODES = (
    TRANSFORMERS_EP,
    Mode("per_expert", "contiguous"),
    Mode("dedup", "contiguous"),
    Mode("dedup", "refined"),
    Mode("dedup", "refined", 2),
    Mode("dedup", "refined", 1),
)

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
    mode: str
    fwd_ms: float
    fwd_bwd_ms: float
    exchange_ms: float
    ct: float
    sent_mb_mean: float
    sent_mb_max: float
    bandwidth_gbs: float
    peak_gbs: float

    def group_tokens(self, world: int) -> int:
        """Tokens the whole group processes per step (transformers' EP shares one batch)."""
        return self.tokens_per_rank * (1 if self.mode == TRANSFORMERS_EP.name else world)

    def speedup_over(self, base: "Row", world: int, backward: bool) -> float:
        """Group tokens per second relative to `base`, forward or forward+backward."""
        mine, theirs = (self.fwd_bwd_ms, base.fwd_bwd_ms) if backward else (self.fwd_ms, base.fwd_ms)
        return (self.group_tokens(world) / mine) / (base.group_tokens(world) / theirs)


# ----- the layer -------------------------------------------------------------------------------
def build_config(shape: ExpertShape):
    import transformers

    spec = HF_EXPERTS[shape.family]
    extra = BLOCKS[shape.family][2]
    return getattr(transformers, spec.config_class)(hidden_act="silu", num_hidden_layers=1, **spec.config_kwargs(shape), **extra)


def build_block(config, shape: ExpertShape, device, dtype, seed: int) -> torch.nn.Module:
    """The family's MoE block with weights drawn from `seed` (the same on every rank and for every mode)."""
    module, class_name, _ = BLOCKS[shape.family]
    torch.manual_seed(seed)
    with torch.device(device):
        block = getattr(importlib.import_module(module), class_name)(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    return block.to(dtype)


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


def refined_placement(routing_ids_Tk: torch.Tensor, shape: ExpertShape, world: int) -> Placement:
    """A refined placement planned on the first half of the routing that rank 0 sees (broadcast)."""
    accumulator = LayerAccumulator(shape.num_experts, shape.top_k, sample_size=None)
    accumulator.update(routing_ids_Tk[: routing_ids_Tk.shape[0] // 2].cpu())
    profile = RoutingProfile(shape.num_experts, shape.top_k, {0: accumulator.to_layer_routing()}, model_type=shape.family)
    placement = plan_placement(profile, world, "refined", progress=False)
    holder = [placement.to_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Placement.from_dict(holder[0])


# ----- timing ----------------------------------------------------------------------------------
def timed(fn, iterations: int, device) -> float:
    """Median ms of `fn` over `iterations`, the ranks aligned by a barrier before each call."""
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


def _max_and_mean(value: float, device) -> tuple[float, float]:
    if not dist.is_initialized():
        return value, value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    values = [g.item() for g in gathered]
    return max(values), sum(values) / len(values)


# ----- one case --------------------------------------------------------------------------------
def measure(shape_name: str, tokens: int, trace, args, device, dtype, rank: int, world: int, log) -> list[Row]:
    shape = SHAPES[shape_name]
    if args.hidden or args.intermediate:  # shrink the matrices, keep E, k and the routing
        shape = replace(shape, hidden=args.hidden or shape.hidden, intermediate=args.intermediate or shape.intermediate)
    config = build_config(shape)
    adapter = adapter_for(config)
    generator = torch.Generator(device=device).manual_seed(args.seed + 7 * rank)
    x_TH = torch.randn(tokens, shape.hidden, generator=generator, device=device).to(dtype)

    if trace_fits(trace, shape):
        logits_TE = trace_logits(trace, shape.num_experts, tokens, rank, device, args.seed)
        routing_name = "Qwen1.5 trace"
    else:
        logits_TE = None
        routing_name = "random router"

    rows: list[Row] = []
    for mode in MODES:
        if mode.name not in args.modes:
            continue
        if (mode.max_devices_per_token or 0) > world:
            log(f"{shape_name} T={tokens} {mode.name}: skipped, N_d exceeds the {world} rank(s)")
            continue
        if mode == TRANSFORMERS_EP:
            rows.append(_measure_transformers_ep(config, shape_name, tokens, args, device, dtype, rank, world))
            log(f"{shape_name} T={tokens} {mode.name}: fwd {rows[-1].fwd_ms:.2f} ms")
            continue
        block = build_block(config, shape, device, dtype, args.seed)
        family_adapter = adapter if logits_TE is None else ReplayAdapter(adapter, logits_TE)
        if mode.placement == "contiguous":
            placement = Placement.contiguous(shape.num_experts, world, [0])
        else:
            placement = refined_placement(family_adapter.route(block, x_TH).topk_ids_Tk, shape, world)
        occult_config = OccultConfig(
            placement=placement,
            num_devices=world,
            dispatch=mode.dispatch,
            prune="router" if mode.max_devices_per_token else None,
            max_devices_per_token=mode.max_devices_per_token,
            expert_backend=args.expert_backend,
        )
        ep = ExpertParallelGroup.resolve(num_devices=world)
        pruner = None
        if mode.max_devices_per_token:
            from occult_hf.pruning import build_pruner

            device_of_E = torch.tensor(placement.device_of(0), dtype=torch.int64)
            pruner = build_pruner(occult_config, adapter, block, 0, device_of_E, num_devices=world, top_k=shape.top_k)
        layer = OccultMoE(block, family_adapter, 0, placement, occult_config, ep, pruner)
        rows.append(_measure_layer(layer, x_TH, shape_name, tokens, routing_name, mode, args, device, world))
        log(f"{shape_name} T={tokens} {mode.name}: fwd {rows[-1].fwd_ms:.2f} ms")
        del layer, block
    return rows


def _measure_layer(layer: OccultMoE, x_TH, shape_name, tokens, routing_name, mode: Mode, args, device, world) -> Row:
    hidden = x_TH[None]  # [1, T, H]: the block's input shape

    def forward():
        with torch.no_grad():
            layer(hidden)

    x_grad = hidden.detach().clone().requires_grad_(True)
    upstream = torch.randn_like(hidden)

    def forward_backward():
        layer(x_grad).backward(upstream)

    layer.reset_counters()
    forward()
    rows_sent_D = layer.rows_sent.clone()
    topk_ids_Tk = layer.last_topk_ids_Tk
    row_bytes = int(layer.bytes_sent.sum().item() // max(int(layer.rows_sent.sum().item()), 1))
    own = layer.ep.rank
    remote_rows = int(rows_sent_D.sum().item() - rows_sent_D[own].item()) if world > 1 else 0
    # dispatch sends rows with metadata; combine returns activations only
    remote_bytes = remote_rows * (row_bytes + x_TH.shape[1] * x_TH.element_size())
    ct = mean_ct(topk_ids_Tk.cpu().numpy(), layer.device_of_E.cpu().numpy(), world)

    routing = layer.adapter.route(layer.original_block, hidden)
    weights_Tk = routing.topk_weights_Tk
    if layer.pruner is not None:
        weights_Tk, _ = layer.pruner(layer.original_block, routing)

    def exchange():
        with torch.no_grad():
            sent = layer.dispatcher.dispatch(x_TH, TokenRouting(topk_ids_Tk, weights_Tk))
            layer.dispatcher.combine(sent.x_RH, sent.plan)

    fwd_ms = timed(forward, args.iterations, device)
    fwd_bwd_ms = timed(forward_backward, args.iterations, device)
    exchange_ms = timed(exchange, args.iterations, device)
    sent_max, sent_mean = _max_and_mean(remote_bytes / 1e6, device)
    ct_max, ct_mean = _max_and_mean(ct, device)
    peak = uniform_all_to_all_gbs(int(sent_max * 1e6), args.iterations, device, world)
    exchange_max, _ = _max_and_mean(exchange_ms, device)
    bandwidth = sent_max * 1e6 / (exchange_max / 1e3) / 1e9 if world > 1 else float("nan")
    fwd_max, _ = _max_and_mean(fwd_ms, device)
    fwd_bwd_max, _ = _max_and_mean(fwd_bwd_ms, device)
    return Row(shape_name, tokens, routing_name, mode.name, fwd_max, fwd_bwd_max, exchange_max, ct_mean,
               sent_mean, sent_max, bandwidth, peak)  # fmt: skip


def transformers_ep_block(config, args, dtype, rank: int) -> torch.nn.Module:
    """The MoE block of a one-layer checkpoint loaded with transformers' own expert parallelism."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    holder = [tempfile.mkdtemp(prefix="occult_bench_ep_") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    if rank == 0:
        small = type(config).from_dict({**config.to_dict(), "vocab_size": 256})
        torch.manual_seed(args.seed)
        AutoModelForCausalLM.from_config(small).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
    )
    return model.model.layers[0].mlp


def _measure_transformers_ep(config, shape_name, tokens, args, device, dtype, rank, world) -> Row:
    # transformers 5.17 leaves a one-rank tensor-parallel load on the CPU
    block = transformers_ep_block(config, args, dtype, rank).to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)  # the same batch on every rank
    hidden = torch.randn(1, tokens, config.hidden_size, generator=generator, device=device).to(dtype)
    x_grad = hidden.clone().requires_grad_(True)
    upstream = torch.randn_like(hidden)

    def forward():
        with torch.no_grad():
            block(hidden)

    def forward_backward():
        block(x_grad).backward(upstream)

    fwd_ms, _ = _max_and_mean(timed(forward, args.iterations, device), device)
    fwd_bwd_ms, _ = _max_and_mean(timed(forward_backward, args.iterations, device), device)
    # all-reduce of the [T, H] output: a ring sends 2 (D-1)/D of it per rank
    sent_mb = 2 * (world - 1) / world * hidden.numel() * hidden.element_size() / 1e6
    nan = float("nan")
    return Row(shape_name, tokens, "own router", TRANSFORMERS_EP.name, fwd_ms, fwd_bwd_ms, nan, nan, sent_mb, sent_mb, nan, nan)


# ----- report ----------------------------------------------------------------------------------
def results_table(rows: list[Row], world: int) -> str:
    header = ["shape", "T/rank", "routing", "mode", "CT", "fwd ms", "fwd+bwd ms", "exchange ms",
              "sent MB mean/max", "exch. GB/s", "a2a peak GB/s", "group Mtok/s fwd", "group tok/s vs base fwd", "fwd+bwd"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    baselines = {(r.shape, r.tokens_per_rank): r for r in rows if r.mode == BASELINE}
    for r in rows:
        base = baselines.get((r.shape, r.tokens_per_rank))
        ratio = f"{r.speedup_over(base, world, backward=False):.2f}x" if base else "-"
        ratio_bwd = f"{r.speedup_over(base, world, backward=True):.2f}x" if base else "-"
        cells = [r.shape, str(r.tokens_per_rank), r.routing, r.mode, f"{r.ct:.2f}", f"{r.fwd_ms:.2f}",
                 f"{r.fwd_bwd_ms:.2f}", f"{r.exchange_ms:.2f}", f"{r.sent_mb_mean:.1f}/{r.sent_mb_max:.1f}",
                 f"{r.bandwidth_gbs:.0f}", f"{r.peak_gbs:.0f}", f"{r.group_tokens(world) / r.fwd_ms / 1e3:.2f}", ratio, ratio_bwd]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r.shape, r.tokens_per_rank) for r in rows})
    modes = [m.name for m in MODES if any(r.mode == m.name for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cases)), 4))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        values = [next((r.fwd_ms for r in rows if (r.shape, r.tokens_per_rank) == c and r.mode == mode), 0.0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], values, width, label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"{s}\nT={t}" for s, t in cases], fontsize=8)
    ax.set_ylabel("forward ms (slowest rank)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="tokens per rank")
    parser.add_argument("--modes", nargs="+", default=[m.name for m in MODES], choices=[m.name for m in MODES])
    parser.add_argument(
        "--trace",
        default=None,
        help=f"routing trace (.npz, topk_ids [T, k]) replayed for the shape with its E and k "
        f"(default: {DEFAULT_TRACE} when present, else every shape uses its router)",
    )
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--expert-backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--hidden", type=int, default=None, help="override H (CPU dry runs), keeping E, k and routing")
    parser.add_argument("--intermediate", type=int, default=None, help="override I (CPU dry runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_ep.md/.json/.png (rank 0)")


def run(args: argparse.Namespace) -> int:
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    if args.trace is None and not os.path.isfile(DEFAULT_TRACE):
        log(f"no routing trace at {DEFAULT_TRACE}: every shape routes with its own (random) router")
        trace = None
    else:
        trace = load_trace(args.trace or DEFAULT_TRACE)
    rows = []
    for shape_name in args.shapes:
        for tokens in args.tokens:
            rows.extend(measure(shape_name, tokens, trace, args, device, dtype, rank, world, log))
    if rank == 0:
        table = results_table(rows, world)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        header = f"`occult bench ep`, {world} rank(s), {dtype}, {stamp}, {machine_line(device)}"
        print(f"\n{header}\n\n{table}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"_{world}x{device.type}"
        (out / f"bench_ep{suffix}.md").write_text(f"{header}\n\n{table}\n")
        (out / f"bench_ep{suffix}.json").write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
        plot(rows, out / f"bench_ep{suffix}.png")
    if dist.is_initialized():
        dist.barrier()
    return 0
