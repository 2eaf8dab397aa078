"""One MoE layer inside transformers' own expert parallelism, by `DistributedConfig.ep_implementation`.

Shape legend: T tokens per rank, H hidden, E routed experts, k experts per token, D ranks.

    torchrun --nproc-per-node 2 -m occult_hf.benchmarks.hf_ep --tokens 4096 16384 --out DIR

Needs transformers >= 5.23 (the `EPImplementationInterface` registry). Rank 0 saves a one-layer
checkpoint of the shape (`--shape`, default OLMoE-1B-7B: H 2048, I 1024, E 64, k 8; the layer's own
random router), and every case loads it with `from_pretrained(..., distributed_config=...)`, bf16 on
the GPU, and times the decoder layer's MoE block (its FSDP2-sharded parameters gathered once) on T
random tokens per rank: the median over `--iterations` of forward and forward+backward, the slowest
rank's time (ranks aligned by a barrier before each call).

Cases:
- `occult` (dedup): `DistributedConfig(ep_size=D, fsdp_size=D, ep_implementation="occult")`, one row
  per (token, destination rank), local experts pre-summed (occult_hf's dispatcher and kernels);
- `occult` (per_expert): the same, reconfigured with `OccultConfig(dispatch="per_expert")` (one row
  per (token, expert), the usual all-to-all, on the same code);
- `all_to_all`: transformers' `AllToAllEP` (one row per (token, expert)), same mesh;
- `all_reduce`: transformers' `AllReduceEP`, `DistributedConfig(tp_plan="auto", ep_size=D,
  ep_implementation="all_reduce")`: every rank holds the same batch (the TP group is the EP group),
  runs its experts on all of it and all-reduces the outputs. Its group processes T tokens, the
  others D * T: the table's "group tokens/s" column compares them per token.

This module is separate from `occult bench ep` (benchmarks/ep.py), which times occult_hf's own
`occult_config` path; it imports that module's layer builder and timer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.benchmarks.ep import build_config, first_moe_block, init_from_torchrun, time_block
from occult_hf.expert_shapes import SHAPES

CASES = ("occult", "occult_per_expert", "all_to_all", "all_reduce")


@dataclass
class Row:
    case: str
    tokens_per_rank: int
    group_tokens: int
    fwd_ms: float
    fwd_bwd_ms: float
    note: str = ""

    def tokens_per_s(self, backward: bool) -> float:
        return self.group_tokens / (self.fwd_bwd_ms if backward else self.fwd_ms) * 1e3


def distributed_config_for(case: str, world: int):
    """`(DistributedConfig, each rank its own batch?)` of a case."""
    from transformers.distributed import DistributedConfig

    if case == "all_reduce":
        return DistributedConfig(tp_plan="auto", ep_size=world, ep_implementation="all_reduce"), False
    implementation = "all_to_all" if case == "all_to_all" else "occult"
    return DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation=implementation), True


def save_checkpoint(config, seed: int, rank: int) -> str:
    """A one-layer checkpoint of `config` written by rank 0 into a directory every rank gets the path of."""
    from transformers import AutoModelForCausalLM

    holder = [tempfile.mkdtemp(prefix="occult_bench_hf_ep_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if rank == 0:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(holder[0])
    dist.barrier()
    return holder[0]


def measure_case(case: str, path: str, config, tokens_list, args, device, dtype, rank: int, world: int) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult_ep

    distributed_config, own_batch = distributed_config_for(case, world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=distributed_config).to(device)
    if case == "occult_per_expert":
        apply_occult_ep(model, OccultConfig(dispatch="per_expert"))
    block = first_moe_block(model)
    rows = []
    for tokens in tokens_list:
        seed = args.seed + (7 * rank if own_batch else 0)
        fwd_ms, fwd_bwd_ms = time_block(block, config.hidden_size, tokens, seed, args.iterations, device, dtype)
        note = "" if own_batch else "all ranks one batch"
        rows.append(Row(case, tokens, tokens * world if own_batch else tokens, fwd_ms, fwd_bwd_ms, note))
    del model, block
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def results_table(rows: list[Row]) -> str:
    base = {r.tokens_per_rank: r for r in rows if r.case == "all_to_all"}
    header = ["case", "T/rank", "group tokens", "fwd ms", "fwd+bwd ms", "group tokens/s fwd vs all_to_all", "fwd+bwd vs all_to_all", "note"]
    lines = []
    for r in rows:
        b = base.get(r.tokens_per_rank)
        ratio = lambda backward: f"{r.tokens_per_s(backward) / b.tokens_per_s(backward):.2f}x" if b else "n/a"  # noqa: E731
        lines.append([r.case, r.tokens_per_rank, r.group_tokens, f"{r.fwd_ms:.2f}", f"{r.fwd_bwd_ms:.2f}", ratio(False), ratio(True), r.note])
    return markdown_table(header, lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per rank")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="occult_bench", help="directory for hf_ep.md and hf_ep.json (default: ./occult_bench)")
    args = parser.parse_args(argv)

    import occult_hf  # noqa: F401  (registers ep_implementation="occult")
    from occult_hf.hf.native_ep import transformers_ep_available

    if not transformers_ep_available():
        raise SystemExit("transformers >= 5.23 is needed (EPImplementationInterface)")
    rank, world, device = init_from_torchrun()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = build_config(SHAPES[args.shape])
    path = save_checkpoint(config, args.seed, rank)
    rows = []
    for case in args.cases:
        try:
            rows += measure_case(case, path, config, args.tokens, args, device, dtype, rank, world)
        except Exception as error:  # noqa: BLE001  (a case that cannot run is a row that says why)
            rows += [Row(case, t, 0, float("nan"), float("nan"), f"failed: {type(error).__name__}: {error}"[:200]) for t in args.tokens]
        if rank == 0:
            print(results_table(rows), flush=True)
    if rank == 0:
        import transformers

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        header = (
            f"{world} x {name}, torch {torch.__version__}, transformers {transformers.__version__}, {dtype}, "
            f"shape {args.shape}, {args.iterations} iterations\n\n"
        )
        atomic_write_text(out / "hf_ep.md", header + results_table(rows) + "\n")
        atomic_write_text(out / "hf_ep.json", json.dumps([asdict(r) for r in rows], indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
