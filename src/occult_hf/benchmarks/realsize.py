"""`occult bench realsize`: the whole OLMoE-1B-7B model under expert parallelism against a data-parallel replica.

Shape legend: B sequences, S sequence length, D ranks.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench realsize`. Every rank builds the same
randomly initialised model with the exact OLMoE-1B-7B configuration (the checkpoint's
`config.json`: 16 layers, hidden 2048, 64 experts of width 1024, top-8, vocabulary 50304, 6.9B
parameters; `--layers` shrinks it for dry runs) in bf16, and feeds its own B x S tokens (default 4 x 4096):

1. **replica**: the stock model, all experts on every rank (data parallelism; no gradient
   synchronisation is timed);
2. **EP**: the same model after `apply_occult(model)` (D ranks, contiguous placement, the default
   "auto" dispatcher), each rank holding E/D experts.

For each: parameters on this rank, peak memory of the forward+backward, forward and
forward+backward of `model(input_ids, labels=input_ids).loss` (medians, ranks aligned by a barrier
before each), and greedy decoding at batch 1 (`--prompt` tokens, then `--new-tokens`) through
`occult_hf.decode.GreedyDecoder`: a static cache and one CUDA graph per token; under EP the layers
use the static-capacity dispatcher ("symm_mem" where NVSHMEM serves, else "padded"). The
replica's tokens and EP's must agree (same weights, same prompt).
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from occult_hf.atomic import atomic_write_text
from occult_hf.benchmarks.ep import timed

HELP = "the whole OLMoE-1B-7B model under EP (torchrun) vs a data-parallel replica: fwd, fwd+bwd, decode, memory"
DESCRIPTION = __doc__.split("\n\n", 1)[1]

#: the decode target under EP (issue 10), ms per token at batch 1
DECODE_TARGET_MS = 20.0


@dataclass
class RealRow:
    setup: str
    params_per_rank: float  # billions
    peak_gib: float
    fwd_ms: float
    fwd_bwd_ms: float
    decode_ms_per_token: float
    decode_graphed: bool
    decode_dispatcher: str
    tokens_agree: bool | None = None


def _slowest(value: float, device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(model, setup: str, ids_BS, prompt_1P, args, device, decode_with: str | None) -> tuple[RealRow, torch.Tensor]:
    """Training-step times and memory of `model` as it is, then greedy decoding through the dispatcher
    `decode_with` (None: no EP, nothing to exchange)."""
    from occult_hf.decode import GreedyDecoder, use_dispatcher

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
    with use_dispatcher(model, decode_with) if decode_with else _nothing():
        decoder = GreedyDecoder(model, 1, prompt_1P.shape[1] + args.new_tokens + 1, graph=None if args.graph else False)
        result = decoder.generate(prompt_1P, args.new_tokens)
    row = RealRow(setup, params, _slowest(peak, device), _slowest(fwd, device), _slowest(fwd_bwd, device),
                  _slowest(result.ms_per_token, device), result.graphed, decode_with or "none")  # fmt: skip
    return row, result.tokens


def _dispatcher_of(model) -> str:
    from occult_hf.moe import OccultMoE

    return next(m.dispatcher.name for m in model.modules() if isinstance(m, OccultMoE))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def results_table(rows: list[RealRow]) -> str:
    lines = [
        "| setup | params per GPU | peak memory | fwd ms | fwd+bwd ms | greedy decode, batch 1 | CUDA graph | decode dispatcher | tokens = replica's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        agree = "-" if r.tokens_agree is None else ("yes" if r.tokens_agree else "NO")
        lines.append(
            f"| {r.setup} | {r.params_per_rank:.2f}B | {r.peak_gib:.1f} GiB | {r.fwd_ms:.1f} | {r.fwd_bwd_ms:.1f} | "
            f"{r.decode_ms_per_token:.2f} ms/token | {'yes' if r.decode_graphed else 'no'} | {r.decode_dispatcher} | {agree} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: OLMoE-1B-7B's 16)")
    parser.add_argument("--hidden", type=int, default=None, help="override H (CPU dry runs)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens for the decode")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-graph", dest="graph", action="store_false", help="decode without CUDA graphs")
    parser.add_argument("--skip-replica", action="store_true", help="only the EP model (saves memory and time)")
    parser.add_argument(
        "--dispatchers", nargs="*", default=["symm_mem"],
        help="also time the EP training step with these dispatchers (besides 'auto'); a failing one is reported",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for bench_realsize_<D>x<device>.md/.json (rank 0)")


def run(args: argparse.Namespace) -> int:
    from occult_hf import apply_occult
    from occult_hf.benchmarks.ep import init_from_torchrun
    from occult_hf.benchmarks.experts import machine_line
    from occult_hf.benchmarks.model import build_model, model_config
    from occult_hf.decode import use_dispatcher

    rank, world, device = init_from_torchrun()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # OLMoE-1B-7B's own config.json values (newer transformers changed OlmoeConfig's defaults)
    config = model_config("olmoe-1b-7b", args.layers or 16, args.hidden, args.hidden // 2 if args.hidden else None)
    generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    ids_BS = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator, device=device)
    prompt_1P = torch.randint(0, config.vocab_size, (1, args.prompt), generator=generator, device=device)

    def log(message):
        if rank == 0:
            print(message, flush=True)

    model = build_model(config, device, dtype, args.seed)
    rows, replica_tokens = [], None

    def save() -> None:  # after every row: a later failure keeps what was measured
        if rank != 0:
            return
        table = results_table(rows)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (
            f"`occult bench realsize`, {world} rank(s), {dtype}, {config.num_hidden_layers} layers, "
            f"{args.batch} x {args.seq} tokens per rank, decode {args.prompt} + {args.new_tokens} tokens, {stamp}, {machine_line(device)}"
        )
        print(f"\n{header}\n\n{table}", flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"_{world}x{device.type}"
        atomic_write_text(out / f"bench_realsize{suffix}.md", f"{header}\n\n{table}\n")
        atomic_write_text(out / f"bench_realsize{suffix}.json", json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))

    def agree(tokens) -> bool | None:
        if replica_tokens is None:
            return None
        same = torch.tensor([float(torch.equal(tokens, replica_tokens))], device=device)
        if dist.is_initialized():
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return bool(same.item())

    if not args.skip_replica:
        row, replica_tokens = measure(model, "stock transformers, full replica per GPU (no gradient sync timed)", ids_BS, prompt_1P, args, device, None)
        rows.append(row)
        save()
    apply_occult(model)
    static = "padded" if world > 1 else None  # the NCCL static path first: it needs no NVSHMEM
    row, tokens = measure(model, f"occult_hf EP, D={world}, dispatcher 'auto' ({_dispatcher_of(model)})", ids_BS, prompt_1P, args, device, static)
    row.tokens_agree = agree(tokens)
    rows.append(row)
    save()
    for name in args.dispatchers if world > 1 else []:  # training step and decode through another dispatcher
        try:
            with use_dispatcher(model, name):
                row, tokens = measure(model, f"occult_hf EP, D={world}, dispatcher {name!r}", ids_BS, prompt_1P, args, device, name)
            row.tokens_agree = agree(tokens)
            rows.append(row)
            save()
        except Exception as error:  # noqa: BLE001 - a dispatcher that cannot serve this group is a line, not a lost run
            log(f"EP with dispatcher {name!r} failed: {type(error).__name__}: {error}")
    if dist.is_initialized():
        dist.barrier()
    return 0
