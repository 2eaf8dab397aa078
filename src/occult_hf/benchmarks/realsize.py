"""`occult bench realsize`: the whole OLMoE-1B-7B model under expert parallelism against a data-parallel replica.

Shape legend: B sequences, S sequence length, D ranks, E routed experts, L MoE layers.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench realsize`. Every rank builds the same
randomly initialised model with the exact OLMoE-1B-7B configuration (the checkpoint's
`config.json`: 16 layers, hidden 2048, 64 experts of width 1024, top-8, vocabulary 50304, 6.9B
parameters; `--layers` shrinks it for dry runs) in bf16, and feeds its own B x S tokens (default 4 x 4096):

1. **replica**: the stock model, all experts on every rank (data parallelism; no gradient
   synchronisation is timed);
2. **EP**: the same model after `apply_occult(model, {"placement": ...})` (D ranks, the default "auto"
   dispatcher), each rank holding E/D experts, once per `--placements` entry: "contiguous" (experts
   0..E/D-1 on rank 0, ...), "refined" (Occult's placement, planned from a routing profile of the same
   model on `--calibration-tokens` other tokens: the paper's workflow, profile then place) and "oracle"
   (the same planner on the timed tokens themselves: the best balance a placement gives this batch, a
   bound rather than a deployable setup). Each planned setup rebuilds the model (same seed, same weights).

For each: parameters on this rank, peak memory of the forward+backward, forward and
forward+backward of `model(input_ids, labels=input_ids).loss` (medians, ranks aligned by a barrier
before each), and greedy decoding at batch 1 (`--prompt` tokens, then `--new-tokens`) through transformers'
`generate(cache_implementation="static")`, which compiles the decoding step and replays it as CUDA graphs
(`bench decode`'s `time_step`: ms per step from whole generate() calls of N and 1 tokens); under EP the ranks
decode in lockstep and the compiled step exchanges through static capacities. The replica's tokens and EP's must
agree (same weights, same prompt).

Why the placement matters here: a randomly initialised model routes very unevenly, and per sequence (the
tokens of one sequence share a large common component of their hidden states, so the router sends them
to the same few experts). On the CPU, at the real configuration, 3 sequences of 4096 tokens, 16 layers:
the busiest expert of a layer gets 2-8x the mean load; with 2 sequences as the 2 ranks' batches, one rank
of the contiguous split gets 57% of a layer's pairs on average (up to 66%); the refined placement planned
on a third sequence gets the same 57-58% (the lean does not carry over from one sequence to another), and
planned on the two timed sequences themselves 50.6% (at most 51.2%), with CT 1.73 instead of 2.00. Under EP
a layer waits for its busiest rank, so the balance of the batch decides the step time. Each EP setup
prints its routing per layer (pairs and rows each rank received in one forward, CT); `--profile` adds a
`torch.profiler` summary of one forward and one forward+backward of every setup (device time per
`occult::` stage, GPU busy time, costliest kernels).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.benchmarks.decode import generate_greedy, time_step
from occult_hf.benchmarks.ep import max_and_mean, profile_steps, timed
from occult_hf.benchmarks import measures_a_gpu

HELP = "the whole OLMoE-1B-7B model under EP (torchrun) vs a data-parallel replica: fwd, fwd+bwd, decode, memory"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

#: the expert placements an EP setup can use (`--placements`)
PLACEMENTS = ("contiguous", "refined", "oracle")
#: the calibration profile's token sample (the planner's CT objective; the loads count every token) and search rounds
PLAN_SAMPLE_TOKENS = 4096
PLAN_ROUNDS = 10
#: kernels listed per profiled step (a whole model launches attention, norms, the LM head and the loss besides the MoE)
PROFILE_KERNELS = 24


@dataclass
class RealRow:
    setup: str
    params_per_rank: float  # billions
    peak_gib: float
    fwd_ms: float
    fwd_bwd_ms: float
    decode_ms_per_token: float
    tokens_agree: bool | None = None


def measure(model, setup: str, ids_BS, prompt_1P, args, device) -> tuple[RealRow, torch.Tensor]:
    """Training-step times and memory of `model` as it is, then greedy decoding through the static-cache
    `generate()`: the row and the decoded tokens."""
    params = sum(p.numel() for p in model.parameters()) / 1e9

    def forward():
        with torch.no_grad():
            model(input_ids=ids_BS, labels=ids_BS)

    def forward_backward():
        model(input_ids=ids_BS, labels=ids_BS).loss.backward()
        for param in model.parameters():
            param.grad = None

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fwd_bwd = timed(forward_backward, args.iterations, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    fwd = timed(forward, args.iterations, device)
    decode_ms = time_step(model, prompt_1P, args.new_tokens, "static", args.iterations).ms_per_step
    tokens = generate_greedy(model, prompt_1P, args.new_tokens, "static")[:, prompt_1P.shape[1] :]

    def slowest(value: float) -> float:
        return max_and_mean(value, device)[0]

    return RealRow(setup, params, slowest(peak), slowest(fwd), slowest(fwd_bwd), slowest(decode_ms)), tokens


def _dispatcher_of(model) -> str:
    from occult_hf.moe import OccultMoE

    return next(m.dispatcher.name for m in model.modules() if isinstance(m, OccultMoE))


def planned_placement(model, ids_BS, args, rank: int, world: int, source: str):
    """Occult's refined placement for `model`, planned on rank 0 from the model's own routing of `ids_BS` (a
    `ProfileCollector` on its routers; `--max-load-ratio`, `PLAN_ROUNDS` perturbation rounds: 1.5-2.3 s for 16
    layers on the development CPU, against 18.5 s for the planner's default 40), then broadcast."""
    from occult_hf.placement import Placement, plan_placement
    from occult_hf.profile import RoutingProfile
    from occult_hf.profile.collect import ProfileCollector

    holder = [None]
    if rank == 0:
        with ProfileCollector(model, sample_size=PLAN_SAMPLE_TOKENS, seed=args.seed) as collector, torch.no_grad():
            model(input_ids=ids_BS)
        profile = RoutingProfile.from_collector(collector, source=source)
        placement = plan_placement(profile, world, "refined", progress=False, search_rounds=PLAN_ROUNDS, max_load_ratio=args.max_load_ratio)
        holder = [placement.to_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Placement.from_dict(holder[0])


def placements_to_run(model, config, ids_BS, args, device, rank: int, world: int) -> dict:
    """`--placements` by name: None for "contiguous" (the default), else a planned `Placement`, all planned on the
    stock model before anything is timed. "refined": on `--calibration-tokens` other tokens in sequences of
    `--seq` (the paper's workflow, profile then place); "oracle": on the timed tokens of every rank themselves, so
    the best balance a placement can give this very batch (an upper bound, not a deployable setup)."""
    placements = {}
    for name in args.placements:
        if name == "contiguous":
            placements[name] = None
        elif name == "refined":
            generator = torch.Generator(device=device).manual_seed(args.seed + 10_000)
            sequences = max(1, args.calibration_tokens // args.seq)
            calibration_BS = torch.randint(0, config.vocab_size, (sequences, args.seq), generator=generator, device=device)
            placements[name] = planned_placement(model, calibration_BS, args, rank, world, "realsize: other random token ids")
        else:
            timed_BS = ids_BS
            if dist.is_initialized():  # every rank's batch, on rank 0
                parts = [torch.empty_like(ids_BS) for _ in range(world)]
                dist.all_gather(parts, ids_BS)
                timed_BS = torch.cat(parts)
            placements[name] = planned_placement(model, timed_BS, args, rank, world, "realsize: the timed token ids")
    return placements


@dataclass
class LayerBalance:
    """One layer's routing in one forward under EP, summed over the ranks."""

    layer: int
    pairs_D: list[int]  # (token, expert) pairs each rank received
    rows_D: list[int]  # rows each rank received
    tokens: int  # tokens of all ranks

    @property
    def busiest_share(self) -> float:
        """Fraction of the pairs on the busiest rank (1/D: balanced)."""
        return max(self.pairs_D) / max(sum(self.pairs_D), 1)

    @property
    def ct(self) -> float:
        """Devices per token (rows per token)."""
        return sum(self.rows_D) / max(self.tokens, 1)


def routing_balance(model, ids_BS) -> list[LayerBalance]:
    """Per MoE layer, the pairs and rows each rank received in one forward (the layers' own counters, summed over
    the ranks: one all-reduce)."""
    from occult_hf.moe import OccultMoE

    layers = [m for m in model.modules() if isinstance(m, OccultMoE)]
    for layer in layers:
        layer.stats.reset()
    with torch.no_grad():
        model(input_ids=ids_BS)
    sent_LD2 = torch.stack([layer.stats.sent_D2 for layer in layers])
    tokens = torch.tensor([ids_BS.numel()], device=sent_LD2.device)
    if dist.is_initialized():
        dist.all_reduce(sent_LD2)
        dist.all_reduce(tokens)
    counts = sent_LD2.tolist()
    for layer in layers:
        layer.stats.reset()
    return [
        LayerBalance(layer.layer_idx, [p for _, p in per_D], [r for r, _ in per_D], int(tokens.item()))
        for layer, per_D in zip(layers, counts)
    ]


def balance_table(balance: list[LayerBalance]) -> str:
    ranks = len(balance[0].pairs_D) if balance else 0
    header = ["layer", *(f"pairs to rank {d}" for d in range(ranks)), "busiest rank's share", "CT"]
    lines = [[b.layer, *b.pairs_D, f"{b.busiest_share:.3f}", f"{b.ct:.2f}"] for b in balance]
    if balance:
        mean_share = sum(b.busiest_share for b in balance) / len(balance)
        mean_ct = sum(b.ct for b in balance) / len(balance)
        lines.append(["mean", *([""] * ranks), f"{mean_share:.3f}", f"{mean_ct:.2f}"])
    return markdown_table(header, lines)


def profile_model(model, ids_BS, device) -> str:
    """`bench ep`'s `profile_steps` of one forward and one forward+backward of the model's loss (already warm:
    the setup was timed before)."""

    def step(backward: bool):
        if backward:
            model(input_ids=ids_BS, labels=ids_BS).loss.backward()
            for param in model.parameters():
                param.grad = None
        else:
            with torch.no_grad():
                model(input_ids=ids_BS, labels=ids_BS)

    return profile_steps(step, device, warm=False, top=PROFILE_KERNELS)


def results_table(rows: list[RealRow]) -> str:
    header = ["setup", "params per GPU", "peak memory", "fwd ms", "fwd+bwd ms", "greedy decode, batch 1 (static cache)",
              "tokens = replica's"]  # fmt: skip
    lines = []
    for r in rows:
        agree = "-" if r.tokens_agree is None else ("yes" if r.tokens_agree else "NO")
        lines.append([r.setup, f"{r.params_per_rank:.2f}B", f"{r.peak_gib:.1f} GiB", f"{r.fwd_ms:.1f}", f"{r.fwd_bwd_ms:.1f}",
                      f"{r.decode_ms_per_token:.2f} ms/token", agree])  # fmt: skip
    return markdown_table(header, lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from occult_hf.benchmarks.model import dry_run_hidden
    from occult_hf.utils.arguments import positive_int

    parser.add_argument("--layers", type=positive_int, default=16, help="decoder layers (default: OLMoE-1B-7B's 16)")
    parser.add_argument("--hidden", type=dry_run_hidden, default=None, help="override H (CPU dry runs; I = H/2)")
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=4096)
    parser.add_argument("--iterations", type=positive_int, default=5)
    parser.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens for the decode")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--skip-replica", action="store_true", help="only the EP model (saves memory and time)")
    parser.add_argument(
        "--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS,
        help="EP setups, one per expert placement ('refined': planned on a routing profile of --calibration-tokens other "
        "tokens; 'oracle': planned on the timed tokens themselves, the balance a placement could give at best)",
    )  # fmt: skip
    parser.add_argument(
        "--max-load-ratio", type=float, default=1.02,
        help="the planned placements' load bound (refined's max_load_ratio): at D=2 the experts are most of a layer, "
        "so balance matters more than CT",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-tokens", type=int, default=16384,
        help="tokens (in sequences of --seq) whose routing the 'refined' placement is planned on; not the timed ones",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler summary of one forward and one forward+backward of each setup")
    parser.add_argument(
        "--dispatchers", nargs="*", default=["symm_mem"],
        help="also time the EP training step with these dispatchers (besides 'auto'); a failing one is reported",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_realsize_<D>x<device>.md/.json (rank 0) (default: ./docs)")


def run(args: argparse.Namespace) -> int:
    from occult_hf import apply_occult
    from occult_hf.benchmarks.ep import init_from_torchrun
    from occult_hf.benchmarks.experts import machine_line
    from occult_hf.benchmarks.model import build_model, model_config
    from occult_hf.hf.decode import use_dispatcher

    rank, world, device = init_from_torchrun()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # OLMoE-1B-7B's own config.json values (newer transformers changed OlmoeConfig's defaults)
    config = model_config("olmoe-1b-7b", args.layers, args.hidden, args.hidden // 2 if args.hidden is not None else None)
    generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    ids_BS = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator, device=device)
    prompt_1P = torch.randint(0, config.vocab_size, (1, args.prompt), generator=generator, device=device)

    def log(message):
        if rank == 0:
            print(message, flush=True)

    model = build_model(config, device, dtype, args.seed)
    placements = placements_to_run(model, config, ids_BS, args, device, rank, world)
    rows, replica_tokens, notes = [], None, []

    def save() -> None:  # after every row: a later failure keeps what was measured
        if rank != 0:
            return
        table = results_table(rows)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (
            f"`occult bench realsize`, {world} rank(s), {dtype}, {config.num_hidden_layers} layers, "
            f"{args.batch} x {args.seq} tokens per rank, decode {args.prompt} + {args.new_tokens} tokens, {stamp}, {machine_line(device)}"
        )
        text = "\n\n".join([f"{header}\n\n{table}", *notes])
        print(f"\n{text}", flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"_{world}x{device.type}"
        atomic_write_text(out / f"bench_realsize{suffix}.md", f"{text}\n")
        atomic_write_text(out / f"bench_realsize{suffix}.json", json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))

    def agree(tokens) -> bool | None:
        if replica_tokens is None:
            return None
        same = torch.tensor([float(torch.equal(tokens, replica_tokens))], device=device)
        if dist.is_initialized():
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return bool(same.item())

    def diagnose(setup: str) -> None:
        if args.profile:
            summary = profile_model(model, ids_BS, device)
            if rank == 0:
                notes.append(f"Profile of {setup} (rank 0):\n\n{summary}")

    if not args.skip_replica:
        setup = "stock transformers, full replica per GPU (no gradient sync timed)"
        row, replica_tokens = measure(model, setup, ids_BS, prompt_1P, args, device)
        rows.append(row)
        diagnose(setup)
        save()
    for index, (name, placement) in enumerate(placements.items()):
        if index:  # the same weights again (same seed), converted with the next placement
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = build_model(config, device, dtype, args.seed)
        apply_occult(model, {"placement": placement} if placement is not None else None)
        balance = routing_balance(model, ids_BS)
        mean_share = sum(b.busiest_share for b in balance) / max(len(balance), 1)
        if rank == 0:
            notes.append(f"Routing under EP, {name} placement (one forward, all ranks' tokens):\n\n{balance_table(balance)}")
        setup = f"occult_hf EP, D={world}, {name} placement (busiest rank {mean_share:.0%} of pairs), dispatcher 'auto' ({_dispatcher_of(model)})"
        row, tokens = measure(model, setup, ids_BS, prompt_1P, args, device)
        row.tokens_agree = agree(tokens)
        rows.append(row)
        diagnose(setup)
        save()
        for other in args.dispatchers if world > 1 and index == 0 else []:  # training step and decode through another dispatcher
            try:
                with use_dispatcher(model, other):
                    row, tokens = measure(model, f"occult_hf EP, D={world}, {name} placement, dispatcher {other!r}", ids_BS, prompt_1P, args, device)
                row.tokens_agree = agree(tokens)
                rows.append(row)
                save()
            except Exception as error:  # noqa: BLE001 - a dispatcher that cannot serve this group is a line, not a lost run
                log(f"EP with dispatcher {other!r} failed: {type(error).__name__}: {error}")
    if dist.is_initialized():
        dist.barrier()
    return 0
