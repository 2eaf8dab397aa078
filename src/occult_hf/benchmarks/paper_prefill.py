"""The prefill experiment of `occult bench paper`: `model(input_ids, logits_to_keep=1)` under `no_grad` in every row,
timed and compared with the stock model's last-position logits on the same batch.

Shape legend: B sequences, S sequence length, T tokens, E routed experts, N trace tokens, L trace layers,
k experts per token, D ranks.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from occult_hf.benchmarks import failure_text
from occult_hf.benchmarks.ep import timed
from occult_hf.benchmarks.megablocks import apply_megablocks, megablocks_missing
from occult_hf.benchmarks.paper_context import Context, last_mean_ct
from occult_hf.benchmarks.paper_models import PaperModel
from occult_hf.benchmarks.paper_routing import RoutingRecorder, TraceReplay, detach, planned_placement
from occult_hf.benchmarks.paper_rows import PREFILL_ROWS, PaperRow

#: occult_hf rows of the prefill: key -> (OccultConfig fields, exact?)
OCCULT_PREFILL = {
    "occult_per_expert": (dict(dispatch="per_expert", placement="contiguous"), True),
    "occult_contiguous": (dict(dispatch="dedup", placement="contiguous"), True),
    "occult_placed": (dict(dispatch="dedup"), True),
    "occult_nd2": (dict(dispatch="dedup", prune="router", max_devices_per_token=2), True),  # exact iff D <= 2
    "occult_nd1": (dict(dispatch="dedup", prune="router", max_devices_per_token=1), False),
}
#: transformers' EP rows: key -> (ep_implementation, DistributedConfig sizes given D, one shared batch?)
HF_EP = {
    "hf_ep_all_to_all": ("all_to_all", lambda d: dict(ep_size=d, fsdp_size=d), False),
    "hf_ep_all_reduce": ("all_reduce", lambda d: dict(tp_size=d, ep_size=d), True),
    "hf_ep_occult": ("occult", lambda d: dict(ep_size=d, fsdp_size=d), False),
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (fp32)."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _logits(output) -> torch.Tensor:
    logits = output.logits
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def transformers_ep_reason(implementation: str) -> str | None:
    """Why transformers' EP row with `implementation` cannot run with the installed transformers (None: it can)."""
    import transformers

    from occult_hf.hf.native_ep import MIN_TRANSFORMERS_VERSION, transformers_ep_available

    if not transformers_ep_available():
        return (
            f"transformers {transformers.__version__} has no EPImplementation registry (ep_implementation needs "
            f">= {MIN_TRANSFORMERS_VERSION}; carry the 5.24 wheel)"
        )
    from transformers.distributed.expert_parallel import EPImplementationInterface

    if implementation not in EPImplementationInterface():
        return f"ep_implementation={implementation!r} is not registered in transformers {transformers.__version__}"
    return None


def _alone_ms(fn, iterations: int, devices: list) -> float:
    """Median ms of `fn` in one process (no barrier: the other ranks wait on the host), after one warm-up;
    every CUDA device in `devices` synchronised around each call."""
    fn()
    times = []
    for _ in range(iterations):
        for device in devices:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        for device in devices:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def prefill(ctx: Context, spec: PaperModel, config, trace_NLk, routing: str) -> None:
    from occult_hf import OccultConfig, apply_occult
    from occult_hf.benchmarks.model import build_model

    args, rank, world, device = ctx.args, ctx.rank, ctx.world, ctx.device
    dtype = ctx.dtype
    tokens, seq = args.prefill_tokens, args.prefill_seq
    if tokens % seq:
        raise ValueError(f"--prefill-tokens ({tokens}) must be a multiple of --prefill-seq ({seq})")
    batch = tokens // seq

    def ids_of(source_rank: int) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(args.seed + 1000 * source_rank)
        return torch.randint(0, config.vocab_size, (batch, seq), generator=generator, device=device)

    own_BS, shared_BS = ids_of(rank), ids_of(0)
    setups = {key: text.format(D=world, method=args.placement_method) for key, text in PREFILL_ROWS}

    def row(key, **values) -> PaperRow:
        return PaperRow("prefill", spec.name, key, setups[key], routing, paper=spec.paper_prefill.get(key, "-"), **values)

    def replay(window: int) -> TraceReplay | None:
        return TraceReplay(trace_NLk, window, args.seed) if trace_NLk is not None else None

    def hooked(model, window: int) -> list:
        r = replay(window)
        return r.attach(model) if r is not None else []

    def last_logits(model, ids_BS) -> torch.Tensor:
        with torch.no_grad():
            return _logits(model(input_ids=ids_BS, logits_to_keep=1))[:, -1].float()

    # 1. the stock model on every rank: reference logits, routing for the planner, the one-GPU row
    model = build_model(config, device, dtype, args.seed)
    handles = hooked(model, rank)
    recorder = RoutingRecorder()
    record = recorder.attach(model)
    reference_own = last_logits(model, own_BS)
    detach(record)
    detach(handles)
    handles = hooked(model, 0)
    reference_shared = last_logits(model, shared_BS)
    detach(handles)
    if ctx.wants("stock_1gpu"):
        handles = hooked(model, rank)
        ctx.reset_peak()
        ms = ctx.max(timed(lambda: last_logits(model, own_BS), args.iterations, device))
        ctx.add(row("stock_1gpu", tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=ctx.peaks(), max_rel_err=0.0))
        detach(handles)
    placement = ctx.placements.get(spec.name)
    if placement is None and ctx.wants("occult_placed", "occult_nd2", "occult_nd1"):
        placement = ctx.placements[spec.name] = planned_placement(recorder, config, world, args.placement_method)
    del recorder
    stock_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30

    # 2. occult_hf rows and MegaBlocks': a converted copy of the stock model each
    def converted_row(key: str, convert, with_ct: bool) -> PaperRow:
        converted = None
        try:
            converted = convert(copy.deepcopy(model))
            handles = hooked(converted, rank)
            ctx.reset_peak()
            error = ctx.max(rel_err(last_logits(converted, own_BS), reference_own))
            ct = ctx.mean(last_mean_ct(converted, world)) if with_ct else None
            ms = ctx.max(timed(lambda: last_logits(converted, own_BS), args.iterations, device))
            detach(handles)
            return row(key, tokens=tokens * world, ms=ms, tokens_per_s=tokens * world / ms * 1e3,
                       peak_gib=ctx.peaks(set_aside_gib=stock_gib), ct=ct, max_rel_err=error)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a row that fails says why; the run goes on
            return row(key, reason=failure_text(error))
        finally:
            converted = None
            ctx.free()

    for key, (fields, exact) in OCCULT_PREFILL.items():
        if not ctx.wants(key):
            continue
        if fields.get("max_devices_per_token", 0) > world:
            ctx.add(row(key, reason=f"N_d={fields['max_devices_per_token']} > D={world}"))
            continue
        occult_config = OccultConfig(
            num_devices=world, placement=fields.get("placement", placement), expert_backend=args.expert_backend,
            **{k: v for k, v in fields.items() if k != "placement"},
        )  # fmt: skip
        result = converted_row(key, lambda copied: apply_occult(copied, occult_config), with_ct=True)
        if result.ran and (not exact or (key == "occult_nd2" and world > 2)):
            result.setup += " (changes the model)"
        elif result.ran and key == "occult_nd2":
            result.setup += f" (at D={world} no token is pruned: N_d >= D is the exact model)"
        ctx.add(result)
    if ctx.wants("megablocks"):
        reason = megablocks_missing()
        group = dist.group.WORLD if dist.is_initialized() else None
        ctx.add(row("megablocks", reason=reason) if reason else converted_row("megablocks", lambda copied: apply_megablocks(copied, group), with_ct=False))

    # 3. rows that load a checkpoint: device_map="auto" (one process) and transformers' EP (every rank)
    if not ctx.wants("device_map_auto", *HF_EP):
        del model
        return
    holder = [tempfile.mkdtemp(prefix="occult_bench_paper_") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    checkpoint = holder[0]
    try:
        if rank == 0:
            model.save_pretrained(checkpoint)
        del model
        ctx.free()
        ctx.barrier()
        if ctx.wants("device_map_auto"):
            _device_map_row(ctx, row, checkpoint, dtype, own_BS, reference_own, hooked, last_logits)
        ctx.barrier()
        for key, (implementation, sizes, shared) in HF_EP.items():
            if not ctx.wants(key):
                continue
            _transformers_ep_row(ctx, row, key, implementation, sizes(world), shared, checkpoint, dtype,
                                 shared_BS if shared else own_BS, reference_shared if shared else reference_own,
                                 hooked, last_logits)  # fmt: skip
            ctx.free()
    finally:
        ctx.barrier()
        if rank == 0:
            shutil.rmtree(checkpoint, ignore_errors=True)


def _device_map_row(ctx, row, checkpoint, dtype, ids_BS, reference, hooked, last_logits) -> None:
    """Rank 0 loads the checkpoint with `device_map="auto"` over every GPU it sees; the others wait on the host."""
    from transformers import AutoModelForCausalLM

    if ctx.rank != 0:
        return
    tokens = ids_BS.numel()
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map="auto")
        placed = sorted({str(p.device) for p in model.parameters()})
        devices = [torch.device(d) for d in placed if d.startswith("cuda")]
        handles = hooked(model, 0)
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
        inputs_BS = ids_BS.to(model.device)
        error = rel_err(last_logits(model, inputs_BS).to(reference.device), reference)
        ms = _alone_ms(lambda: last_logits(model, inputs_BS), ctx.args.iterations, devices)
        peaks = [round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in devices]
        result = row("device_map_auto", tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=peaks, max_rel_err=error)
        result.setup += f" (parameters on {', '.join(placed)})"
        detach(handles)
        del model
    except Exception as error:  # noqa: BLE001
        result = row("device_map_auto", reason=failure_text(error))
    ctx.add(result)
    ctx.free()


def _transformers_ep_row(ctx, row, key, implementation, sizes, shared, checkpoint, dtype, ids_BS, reference, hooked, last_logits) -> None:
    reason = transformers_ep_reason(implementation)
    if reason is not None:
        ctx.add(row(key, reason=reason))
        return
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    tokens = ids_BS.numel() * (1 if shared else ctx.world)
    ok = torch.ones(1, device=ctx.device)
    try:
        distributed_config = DistributedConfig(ep_implementation=implementation, **sizes)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, distributed_config=distributed_config)
        handles = hooked(model, 0 if shared else ctx.rank)
        ctx.reset_peak()
        error = ctx.max(rel_err(last_logits(model, ids_BS), reference))
        ms = ctx.max(timed(lambda: last_logits(model, ids_BS), ctx.args.iterations, ctx.device))
        result = row(key, tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=ctx.peaks(), max_rel_err=error)
        detach(handles)
        del model
    except Exception as error:  # noqa: BLE001
        ok.zero_()
        result = row(key, reason=failure_text(error))
    if dist.is_initialized():  # every rank reports the same: a row that failed anywhere failed
        reasons = [None] * ctx.world
        dist.all_gather_object(reasons, result.reason)
        failed = [f"rank {r}: {text}" for r, text in enumerate(reasons) if text]
        if failed:
            result = row(key, reason="; ".join(failed))
    ctx.add(result)
