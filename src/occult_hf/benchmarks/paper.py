"""`occult bench paper`: the Occult paper's two whole-model experiments, one command.

Shape legend: B sequences, S sequence length, T tokens, E routed experts, k experts per token,
V vocabulary, D ranks.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench paper --experiment all` (NCCL on
GPUs, gloo on CPUs). Every rank builds the same randomly initialised model with the exact
configuration of OLMoE-1B-7B, Qwen1.5-MoE-A2.7B or DeepSeek-MoE-16B (`--scale full`, the
checkpoints' `config.json` values written below; DeepSeek-MoE-16B through the project's native
`deepseek` class) or a tiny configuration with the same E and k (`--scale tiny`: the same rows on
CPU/gloo in seconds, for the tests).

**Routing.** A random router has no co-activation structure, so placement and pruning rows need real
routing. Every router of every row of a model is replayed from a per-token trace (`--trace
MODEL=PATH`; defaults in `profile.replay`: the real Qwen1.5-MoE-A2.7B GSM8K trace of
`../shared/data/routing/` for Qwen1.5, the project's `study` model's held-out routing for OLMoE and,
its top-6, for DeepSeek-MoE; `MODEL=none`: the model's own random router). `TraceReplay`: a forward
hook on the model's own router module replaces its logits by ones whose top-k is the trace's set,
rank r reading the trace from token r*T, tiled; the family's own selection and weight rule then runs
on them, in the stock model, in occult_hf's blocks and in transformers' EP alike, so all rows of a
model route the same tokens the same way. MoE layer i of M reads trace layer i*L//M (a one-layer
trace drives every layer). The `routing` column says which routing a row used.

**Prefill** (`--experiment prefill`, 2^14 tokens per rank as B x S): `model(input_ids,
logits_to_keep=1)` under `no_grad`, bf16 on GPU, median over iterations, the slowest rank. Rows:
stock transformers on one GPU (every GPU its own replica, no communication); stock transformers
loaded with `device_map="auto"` over all D GPUs in one process (the other ranks wait on the host);
transformers' own EP (`ep_implementation` "all_to_all" with `ep_size=fsdp_size=D`, each rank its
batch; "all_reduce" with `tp_size=ep_size=D`, one batch shared by the group; and occult_hf's own
"occult" implementation), on transformers >= 5.23; occult_hf (`apply_occult`) with
per-expert rows and contiguous placement (the Tutel / Megatron baseline), one row per device
(dedup) with contiguous placement, with a placement planned on the routing it then runs
(`--placement-method`), and pruned to N_d = 2 and N_d = 1 devices per token (router mode); and
MegaBlocks dMoE where it is importable (`benchmarks/megablocks.py`: its `dMoE` in every MoE block, with
the model's router and weights). Each row's last-position logits are compared with the stock
model's on the same batch (`max rel. err.`: exact rows must agree to fp32/bf16 rounding) and its
mean CT (devices per token, over MoE layers and ranks) is given.

**Fine-tuning** (`--experiment finetune`): tokens per second per full optimizer step (forward,
backward, `torch.optim.AdamW` step) at a global batch of `--finetune-batch` sequences (8) of
`--finetune-seq` tokens split over the D ranks, peak memory per GPU beside each row. Precision as a
transformers user fine-tunes a bf16 checkpoint (`from_pretrained(dtype=torch.bfloat16)` and
`Trainer(bf16=True)`, docs/runtime.md): bf16 weights, gradients and AdamW states under bf16 autocast
(fp32 weights on CPU unless `--dtype bfloat16`). fp32 master weights are not used: under autocast both
transformers' experts and occult_hf's would then compute in fp32 (autocast does not cover grouped GEMMs
or Triton kernels), and neither Qwen1.5-MoE nor DeepSeek-MoE would fit two GPUs. Rows: occult_hf EP exact and pruned to
N_d = 1 (under DDP for the replicated parameters, as `apply_occult` arranges), FSDP2
(`torch.distributed.fsdp.fully_shard` on every decoder layer, then the root, the wrapping accelerate's
FSDP2 plugin applies), DDP replicas, and MegaBlocks where importable. A row whose weights, gradients
and AdamW states alone would take more than `TRAINING_MEMORY_FRACTION` of a GPU is not started and
says so.

A row that cannot run says why in its `reason` instead of ending the run; results are written after
every row (`paper_comparison_<D>x<device>.md/.json/.png` under `--out`), with the command, the
machine kind (`--machine-kind`), date and versions, and a column with the paper's figure for the same
row (4x A6000 over PCIe).
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from occult_hf.benchmarks import QWEN15_TRACE, failure_text, measures_a_gpu
from occult_hf.benchmarks.ep import init_from_torchrun
from occult_hf.benchmarks.paper_context import Context
from occult_hf.benchmarks.paper_finetune import finetune
from occult_hf.benchmarks.paper_models import DTYPES, PAPER_MODELS, SCALE_DEFAULTS
from occult_hf.benchmarks.paper_prefill import prefill
from occult_hf.benchmarks.paper_routing import routing_for
from occult_hf.benchmarks.paper_rows import EXPERIMENTS, FINETUNE_ROWS, PREFILL_ROWS, PaperRow
from occult_hf.profile.replay import STUDY_TRACE

HELP = "the paper's whole-model prefill and fine-tuning comparisons (OLMoE, Qwen1.5-MoE, DeepSeek-MoE) under torchrun"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..utils.arguments import positive_int

    parser.add_argument("--experiment", default="all", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=list(PAPER_MODELS))
    parser.add_argument("--scale", default="full", choices=list(SCALE_DEFAULTS),
                        help="full: the checkpoints' configurations; tiny: the same rows on tiny configs (CPU tests)")  # fmt: skip
    parser.add_argument(
        "--trace", action="append", default=[], metavar="MODEL=PATH",
        help=f"replay a per-token routing trace (.npz topk_ids [N, k] or [N, L, k]) in MODEL's routers (defaults, when "
        f"present: qwen1.5-moe-a2.7b={QWEN15_TRACE}, olmoe-1b-7b and deepseek-moe-16b={STUDY_TRACE}); MODEL=none "
        "routes MODEL with its own router",
    )  # fmt: skip
    parser.add_argument(
        "--rows", nargs="+", default=None, metavar="KEY", choices=sorted({key for key, _ in (*PREFILL_ROWS, *FINETUNE_ROWS)}),
        help="run only these row keys (of either experiment; default all): to re-run the rows a cut run missed",
    )  # fmt: skip
    parser.add_argument("--placement-method", default="refined", help="planner of the placed rows (occult_hf.available_planners())")
    parser.add_argument("--prefill-tokens", type=positive_int, default=None, help="tokens per rank (full: 2^14; tiny: 64)")
    parser.add_argument("--prefill-seq", type=positive_int, default=None, help="sequence length of the prefill batch (full: 4096)")
    parser.add_argument("--finetune-batch", type=positive_int, default=None, help="global batch in sequences (full: 8)")
    parser.add_argument("--finetune-seq", type=positive_int, default=None, help="tokens per sequence (full: 1024)")
    parser.add_argument("--iterations", type=positive_int, default=None, help="timed prefill forwards (full: 3)")
    parser.add_argument("--steps", type=positive_int, default=None, help="timed optimizer steps (full: 3)")
    parser.add_argument("--expert-backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument(
        "--dtype", default="auto", choices=list(DTYPES),
        help="the weights' dtype (auto: bfloat16 on GPU, float32 on CPU); fine-tuning runs under bf16 autocast either way",
    )  # fmt: skip
    parser.add_argument("--machine-kind", default="unspecified", help="the lent machine kind, for the header (e.g. nvidia-h200-x2)")
    parser.add_argument(
        "--collective-timeout-s", type=positive_int, default=300,
        help="bound on every collective: a rank that died (out of memory) ends the run after this, not after torch's 10 minutes",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs", help="directory for paper_comparison_<D>x<device>.md/.json/.png (rank 0) (default: ./docs)")


def parse_traces(entries: list[str]) -> dict[str, str]:
    """`{model: trace path}` from `MODEL=PATH` entries over the defaults; `MODEL=none` removes one."""
    traces = {"qwen1.5-moe-a2.7b": QWEN15_TRACE} if os.path.isfile(QWEN15_TRACE) else {}
    if os.path.isfile(STUDY_TRACE):
        traces.update({"olmoe-1b-7b": STUDY_TRACE, "deepseek-moe-16b": STUDY_TRACE})
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or name not in PAPER_MODELS:
            raise ValueError(f"--trace {entry!r} must be MODEL=PATH with MODEL one of {sorted(PAPER_MODELS)}")
        if path == "none":
            traces.pop(name, None)
        else:
            traces[name] = path
    return traces


def run(args: argparse.Namespace) -> int:
    from occult_hf.utils.progress import progress_bar

    for name, value in SCALE_DEFAULTS[args.scale].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    traces = parse_traces(args.trace)
    rank, world, device = init_from_torchrun(datetime.timedelta(seconds=args.collective_timeout_s))
    ctx = Context(args, rank, world, device)
    experiments = EXPERIMENTS if args.experiment == "all" else (args.experiment,)
    per_model = sum(ctx.wants(key) for key, _ in PREFILL_ROWS) if "prefill" in experiments else 0
    per_model += sum(ctx.wants(key) for key, _ in FINETUNE_ROWS) if "finetune" in experiments else 0
    ctx.progress = progress_bar(total=per_model * len(args.models), desc="occult bench paper", enabled=rank == 0)
    for name in args.models:
        spec = PAPER_MODELS[name]
        config = spec.config(args.scale)
        trace_NLk, routing = routing_for(name, config, traces)
        for experiment in experiments:
            try:
                (prefill if experiment == "prefill" else finetune)(ctx, spec, config, trace_NLk, routing)
            except Exception as error:  # noqa: BLE001 - the next model still runs
                ctx.log(f"{experiment} {name} stopped: {failure_text(error)}")
                ctx.add(PaperRow(experiment, name, "all", "(the rows not yet reported)", routing, reason=failure_text(error)))
            ctx.free()
        ctx.save()
    ctx.progress.close()
    if rank == 0 and ctx.rows:
        print("\n" + (Path(args.out) / f"paper_comparison_{world}x{device.type}.md").read_text(), flush=True)
    ctx.barrier()
    return 0
