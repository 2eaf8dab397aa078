"""The fine-tuning experiment of `occult bench paper`: tokens per second per full optimizer step (forward, backward,
AdamW) under bf16 autocast, and peak memory per GPU, for occult_hf EP, FSDP2, DDP and MegaBlocks.

Shape legend: B sequences, S sequence length, N trace tokens, L trace layers, k experts per token, D ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from occult_hf.benchmarks import failure_text
from occult_hf.benchmarks.ep import timed
from occult_hf.benchmarks.megablocks import apply_megablocks, megablocks_missing
from occult_hf.benchmarks.paper_context import Context, last_mean_ct
from occult_hf.benchmarks.paper_models import PaperModel
from occult_hf.benchmarks.paper_routing import RoutingRecorder, TraceReplay, detach, planned_placement
from occult_hf.benchmarks.paper_rows import FINETUNE_ROWS, PaperRow

#: the paper's figures for the fine-tuning rows
_PAPER_FINETUNE = "Occult 1.54x MegaBlocks, 2.65x FSDP, ~9x DeepSpeed (tokens/s)"
PAPER_FINETUNE = {"occult_exact": _PAPER_FINETUNE, "occult_pruned": _PAPER_FINETUNE,
                  "fsdp2": "Occult 2.65x faster", "megablocks": "Occult 1.54x faster"}  # fmt: skip


def parameter_counts(config) -> tuple[int, int]:
    """`(all parameters, routed-expert parameters)` of `config`'s causal LM, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    return total, experts


#: tensors per parameter in training: weights, gradients and AdamW's two moments, all in the weights' dtype
TRAINING_TENSORS_PER_PARAMETER = 4
#: the part of a GPU's memory those may take; the rest is for activations. A rank that runs out of memory
#: mid-step leaves its peers in a collective until --collective-timeout-s, so a doubtful row is not started
TRAINING_MEMORY_FRACTION = 0.8


def finetune(ctx: Context, spec: PaperModel, config, trace_NLk, routing: str) -> None:
    from occult_hf import OccultConfig, apply_occult
    from occult_hf.benchmarks.model import build_model

    args, rank, world, device = ctx.args, ctx.rank, ctx.world, ctx.device
    if args.finetune_batch % world:
        raise ValueError(f"--finetune-batch ({args.finetune_batch}) must be divisible by the {world} ranks")
    per_rank = args.finetune_batch // world
    tokens = args.finetune_batch * args.finetune_seq
    generator = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank)
    ids_BS = torch.randint(0, config.vocab_size, (per_rank, args.finetune_seq), generator=generator, device=device)
    setups = {key: text.format(method=args.placement_method) for key, text in FINETUNE_ROWS}
    total, experts = parameter_counts(config)
    sharded_experts = total - experts + math.ceil(experts / world)  # EP: the routed experts sharded, the rest replicated
    per_rank_params = {"occult": sharded_experts, "megablocks": sharded_experts, "fsdp2": math.ceil(total / world), "ddp": total}
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if ctx.cuda else float("inf")
    dtype = ctx.dtype

    def row(key, **values) -> PaperRow:
        return PaperRow("finetune", spec.name, key, setups[key], routing, paper=PAPER_FINETUNE.get(key, "-"), **values)

    def too_big(kind: str) -> str | None:
        need = per_rank_params[kind] * TRAINING_TENSORS_PER_PARAMETER * dtype.itemsize / 2**30
        if need > TRAINING_MEMORY_FRACTION * gpu_gib:
            return (
                f"not started: {per_rank_params[kind] / 1e9:.2f}B parameters per GPU need {need:.0f} GiB for {dtype} "
                f"weights, gradients and AdamW states before any activation, over {TRAINING_MEMORY_FRACTION:.0%} "
                f"of the GPU's {gpu_gib:.0f} GiB"
            )
        return None

    def fresh():
        model = build_model(config, device, dtype, args.seed).train()
        handles = TraceReplay(trace_NLk, rank, args.seed).attach(model) if trace_NLk is not None else []
        return model, handles

    # the placement: the prefill's of this model in this run, else planned on the routing of the first batch
    # (rank 0) as in the prefill (on a replayed trace both read its first tokens: the same placement)
    placement = ctx.placements.get(spec.name)

    def plan() -> object:
        model, handles = fresh()
        recorder = RoutingRecorder()
        record = recorder.attach(model)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(input_ids=ids_BS)
        detach(record + handles)
        del model
        return planned_placement(recorder, config, world, args.placement_method)

    for key, _ in FINETUNE_ROWS:
        if not ctx.wants(key):
            continue
        kind = "occult" if key.startswith("occult") else key
        reason = megablocks_missing() if kind == "megablocks" else None
        reason = reason or too_big(kind)
        if reason is not None:
            ctx.add(row(key, reason=reason))
            continue
        model = wrapped = None
        try:
            ctx.free()
            if kind == "occult" and placement is None:
                placement = ctx.placements[spec.name] = plan()
            model, handles = fresh()
            if kind == "occult":
                pruned = dict(prune="router", max_devices_per_token=1) if key == "occult_pruned" else {}
                apply_occult(model, OccultConfig(num_devices=world, placement=placement, expert_backend=args.expert_backend, **pruned))
                wrapped = _ddp(model, device) if world > 1 else model
            elif kind == "megablocks":  # its experts are rank-local: the model tells DDP to leave them alone
                apply_megablocks(model, dist.group.WORLD if world > 1 else None)
                wrapped = _ddp(model, device) if world > 1 else model
            elif kind == "fsdp2":
                wrapped = _fsdp2(model) if world > 1 else model
            else:
                wrapped = _ddp(model, device) if world > 1 else model
            ctx.free()
            ctx.reset_peak()  # from here: the training step's memory (not the full model built before apply_occult)
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)

            def step() -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = wrapped(input_ids=ids_BS, labels=ids_BS).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            loss = ctx.mean(step().float().item())  # step 1: every exact row starts from the same weights
            ms = ctx.max(timed(step, args.steps, device))
            result = row(key, tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=ctx.peaks(), loss=loss)
            if kind == "occult":
                result.ct = ctx.mean(last_mean_ct(model, world))
            detach(handles)
            ctx.add(result)
            del optimizer
        except Exception as error:  # noqa: BLE001
            ctx.add(row(key, reason=failure_text(error)))
        finally:
            del model, wrapped
            ctx.free()


def _ddp(model, device):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)


def _fsdp2(model):
    """FSDP2 as accelerate's plugin wraps a transformers model: every decoder layer, then the root
    (gradients reduced in the weights' dtype, as DDP does)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model
