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
import copy
import datetime
import gc
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.benchmarks.ep import max_and_mean, init_from_torchrun, timed, trace_logits
from occult_hf.benchmarks.megablocks import MLP_IMPL, apply_megablocks, megablocks_missing
from occult_hf.benchmarks.model import MODEL_SHAPES
from occult_hf.profile.replay import STUDY_TRACE, fit_routing, trace_layer
from occult_hf.profile.trace import read_trace_ids
from occult_hf.benchmarks import QWEN15_TRACE, failure_text, measures_a_gpu

HELP = "the paper's whole-model prefill and fine-tuning comparisons (OLMoE, Qwen1.5-MoE, DeepSeek-MoE) under torchrun"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

PAPER_HARDWARE = "4x A6000 PCIe"
EXPERIMENTS = ("prefill", "finetune")


# ----- the models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PaperModel:
    """One model of the paper: its transformers config class and the checkpoint's `config.json` values."""

    name: str
    config_class: str  # a transformers class name, or "deepseek" (occult_hf's native class)
    full: dict
    #: the paper's figure for a row key (prefill), on PAPER_HARDWARE
    paper_prefill: dict = field(default_factory=dict)

    def config(self, scale: str):
        """The transformers config at `scale` ("full": the checkpoint's; "tiny": same E, k and layer kinds)."""
        kwargs = dict(self.full)
        if scale == "tiny":
            kwargs.update({key: value for key, value in TINY.items() if key in kwargs})
        if self.config_class == "deepseek":
            from occult_hf.models.deepseek import DeepseekMoeConfig

            return DeepseekMoeConfig(**kwargs)
        import transformers

        return getattr(transformers, self.config_class)(**kwargs)


#: what `--scale tiny` overrides (E, k, the router rule and which layers are MoE stay the real ones)
TINY = dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=256,
            num_hidden_layers=2)  # fmt: skip

_PAPER_FINETUNE = "Occult 1.54x MegaBlocks, 2.65x FSDP, ~9x DeepSpeed (tokens/s)"
PAPER_FINETUNE = {"occult_exact": _PAPER_FINETUNE, "occult_pruned": _PAPER_FINETUNE,
                  "fsdp2": "Occult 2.65x faster", "megablocks": "Occult 1.54x faster"}  # fmt: skip

PAPER_MODELS = {
    "olmoe-1b-7b": PaperModel(
        "olmoe-1b-7b", "OlmoeConfig",
        dict(MODEL_SHAPES["olmoe-1b-7b"][1], num_hidden_layers=16, rms_norm_eps=1e-5, norm_topk_prob=False,
             tie_word_embeddings=False),
        {"occult_contiguous": "15.93 s (contiguous)", "occult_placed": "12.53 s (Occult placement)",
         "occult_nd2": "9.22 s (N_d=2 of 4 devices)", "occult_nd1": "5.82 s (N_d=1)",
         "occult_per_expert": "Occult 8.66x faster than Tutel", "megablocks": "Occult 1.70x faster than MegaBlocks"},
    ),
    "qwen1.5-moe-a2.7b": PaperModel(
        "qwen1.5-moe-a2.7b", "Qwen2MoeConfig",
        dict(MODEL_SHAPES["qwen1.5-moe-a2.7b"][1], num_hidden_layers=24, rms_norm_eps=1e-6, rope_theta=1e6,
             norm_topk_prob=False, tie_word_embeddings=False),
        {"occult_nd2": "Occult (N_d=2 of 4) 0.71x MegaBlocks", "megablocks": "Occult (N_d=2 of 4) 0.71x MegaBlocks"},
    ),
    "deepseek-moe-16b": PaperModel(
        "deepseek-moe-16b", "deepseek",
        dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
             num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, vocab_size=102400,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False,
             aux_loss_alpha=0.001, seq_aux=True, tie_word_embeddings=False),
        {"occult_nd2": "Occult (N_d=2 of 4) 0.66x MegaBlocks", "megablocks": "Occult (N_d=2 of 4) 0.66x MegaBlocks"},
    ),
}  # fmt: skip

#: `--dtype` -> the weights' dtype (None: bf16 on GPU, fp32 on CPU)
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: per-scale defaults of the sizes (`--prefill-tokens` ... left unset take these)
SCALE_DEFAULTS = {
    "full": dict(prefill_tokens=2**14, prefill_seq=4096, finetune_batch=8, finetune_seq=1024, iterations=3, steps=3),
    "tiny": dict(prefill_tokens=64, prefill_seq=32, finetune_batch=4, finetune_seq=16, iterations=1, steps=1),
}


# ----- rows ------------------------------------------------------------------------------------
@dataclass
class PaperRow:
    experiment: str
    model: str
    key: str  # stable row id, e.g. "occult_nd1"
    setup: str  # what ran, in words
    routing: str
    tokens: int = 0  # group tokens per timed call (forward, or optimizer step)
    ms: float = float("nan")  # median ms per call, slowest rank
    tokens_per_s: float = float("nan")
    peak_gib: list = field(default_factory=list)  # per GPU, rank order ([] on CPU)
    ct: float | None = None  # mean devices per token (occult rows)
    max_rel_err: float | None = None  # last-position logits against the stock model on the same batch
    loss: float | None = None  # first step's loss, mean over ranks (fine-tuning)
    paper: str = "-"
    reason: str = ""  # why the row did not run ("" when it ran)

    @property
    def ran(self) -> bool:
        return not self.reason


#: the MegaBlocks rows (benchmarks/megablocks.py): its dMoE with the model's router and weights
MEGABLOCKS_SETUP = (
    f"MegaBlocks dMoE, dropless, mlp_impl={MLP_IMPL!r}, the model's router; per-expert rows, contiguous experts"
    " (DDP for the replicated parameters in fine-tuning)"
)
PREFILL_ROWS = (
    ("stock_1gpu", "stock transformers, one GPU (each GPU its own replica, no communication)"),
    ("device_map_auto", 'stock transformers, from_pretrained(device_map="auto") over {D} GPUs, one process'),
    ("hf_ep_all_to_all", "transformers EP, ep_implementation='all_to_all' (ep_size=fsdp_size={D}, each rank its batch)"),
    ("hf_ep_all_reduce", "transformers EP, ep_implementation='all_reduce' (tp_size=ep_size={D}, one shared batch)"),
    ("hf_ep_occult", "transformers EP, ep_implementation='occult' (occult_hf's; contiguous)"),
    ("occult_per_expert", "occult_hf EP, per-expert rows, contiguous (Tutel/Megatron-style baseline)"),
    ("occult_contiguous", "occult_hf EP, one row per device (dedup), contiguous placement"),
    ("occult_placed", "occult_hf EP, dedup, {method} placement"),
    ("occult_nd2", "occult_hf EP, dedup, {method} placement, pruned to N_d=2 (router)"),
    ("occult_nd1", "occult_hf EP, dedup, {method} placement, pruned to N_d=1 (router)"),
    ("megablocks", MEGABLOCKS_SETUP),
)
FINETUNE_ROWS = (
    ("occult_exact", "occult_hf EP, exact, {method} placement (DDP for replicated parameters)"),
    ("occult_pruned", "occult_hf EP, pruned to N_d=1 (router), {method} placement"),
    ("fsdp2", "FSDP2 (fully_shard per decoder layer + root)"),
    ("ddp", "DDP, a full replica per GPU"),
    ("megablocks", MEGABLOCKS_SETUP),
)

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


# ----- routing replay --------------------------------------------------------------------------
class TraceReplay:
    """Forward hooks on every MoE router of a model that replace its choice by a routing trace's.

    The hooked router's output `(logits_TE, weights_Tk, ids_Tk)` becomes: logits whose top-k are the
    trace's expert set of each token (`ep.trace_logits`; MoE layer i of M reads trace layer i*L//M of
    `trace_NLk`, rank `window` reads tokens window*T.., tiled), plus zero times the router's own logits (so the router stays in the autograd graph and
    DDP sees its gradient), and the family's own selection and weight rule applied to them
    (`adapter.select`). Stock blocks, occult_hf's blocks (which keep the router instance) and
    transformers' EP all call the router module, so all of them route alike. Logits are cached per
    (layer, T, device, dtype): the replay costs no host work inside a timed call after the first.
    """

    def __init__(self, trace_NLk: np.ndarray, window: int, seed: int) -> None:
        self.trace_NLk = trace_NLk
        self.window = window
        self.seed = seed
        self._cache: dict = {}

    def attach(self, model) -> list:
        from occult_hf.patches import adapter_for

        adapter = adapter_for(model)
        blocks = list(adapter.iter_moe_blocks(model))
        handles = []
        for moe_index, (layer, _, block) in enumerate(blocks):
            router = adapter.router(block)
            trace_Nk = self.trace_NLk[:, trace_layer(moe_index, len(blocks), self.trace_NLk.shape[1])]
            handles.append(router.register_forward_hook(self._hook(adapter, block, layer, trace_Nk)))
        return handles

    def _hook(self, adapter, block, layer: int, trace_Nk: np.ndarray):
        def hook(router, inputs, output):
            own_TE = output[0]
            key = (layer, own_TE.shape[0], own_TE.device, own_TE.dtype, self.window)
            if key not in self._cache:
                replay_TE = trace_logits(trace_Nk, own_TE.shape[1], own_TE.shape[0], self.window, own_TE.device, self.seed + layer)
                self._cache[key] = replay_TE.to(own_TE.dtype)
            logits_TE = self._cache[key] + 0 * own_TE
            allowed_TE = torch.ones_like(logits_TE, dtype=torch.bool)
            weights_Tk, ids_Tk = adapter.select(block, logits_TE, allowed_TE)
            return logits_TE, weights_Tk, ids_Tk

        return hook


class RoutingRecorder:
    """Forward hooks that keep each MoE layer's `[T, k]` expert ids (the router's output, replayed or own)."""

    def __init__(self) -> None:
        self.ids: dict[int, list[torch.Tensor]] = {}

    def attach(self, model) -> list:
        from occult_hf.patches import adapter_for

        adapter = adapter_for(model)
        return [
            adapter.router(block).register_forward_hook(self._hook(layer)) for layer, _, block in adapter.iter_moe_blocks(model)
        ]

    def _hook(self, layer: int):
        def hook(router, inputs, output):
            self.ids.setdefault(layer, []).append(output[2].detach().cpu())

        return hook


def _detach(handles) -> None:
    for handle in handles:
        handle.remove()


def routing_for(name: str, config, traces: dict[str, str]) -> tuple[np.ndarray | None, str]:
    """`(trace ids [N, L, k] or None, routing label)` for model `name`: its trace, fitted to its E and k."""
    from occult_hf.patches import adapter_for

    adapter = adapter_for(config)
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    path = traces.get(name)
    if path is None:
        return None, f"own router (random weights: no co-activation structure; E={num_experts}, k={top_k})"
    ids_NLk, _, meta = read_trace_ids(path)
    try:
        ids_NLk, adapted = fit_routing(ids_NLk, meta, path, num_experts, top_k)
    except ValueError as error:
        raise ValueError(f"--trace {name}={path}: {error}") from error
    layers = "its one layer at every layer" if ids_NLk.shape[1] == 1 else f"its {ids_NLk.shape[1]} layers in depth order"
    source = " (the project's study model, E=64 top-8: docs/quality.md)" if meta.get("format", "").startswith("occult_hf.paper_routing") else ""
    return ids_NLk, f"trace {os.path.basename(path)}{source} replayed ({ids_NLk.shape[0]} real tokens; {layers}{'; ' + adapted if adapted else ''})"


# ----- placement -------------------------------------------------------------------------------
#: tokens per layer the placement is planned on: the first of rank 0's batch. A replayed trace tiles a few
#: thousand real tokens (4,384 of Qwen, 6,144 of the study model), so more would mostly be copies, and the
#: refined planner's time grows with them (about 1 s a layer at 4,096 tokens on one CPU core)
PLAN_TOKENS = 4096


def planned_placement(recorder: RoutingRecorder, config, world: int, method: str):
    """A placement of `method` planned on the first `PLAN_TOKENS` tokens of the routing rank 0 recorded
    (every MoE layer), broadcast."""
    from occult_hf.patches import adapter_for
    from occult_hf.placement import Placement, plan_placement
    from occult_hf.profile import LayerAccumulator, RoutingProfile

    adapter = adapter_for(config)
    num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
    holder = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        layers = {}
        for layer, chunks in sorted(recorder.ids.items()):
            accumulator = LayerAccumulator(num_experts, top_k, sample_size=None)
            accumulator.update(torch.cat(chunks)[:PLAN_TOKENS].to(torch.int64))
            layers[layer] = accumulator.to_layer_routing()
        profile = RoutingProfile(num_experts, top_k, layers, model_type=config.model_type)
        holder = [plan_placement(profile, world, method, progress=False).to_dict()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Placement.from_dict(holder[0])


# ----- helpers ---------------------------------------------------------------------------------
class Context:
    """What every row needs: the ranks, the device, the host-side group for waits, and the output."""

    def __init__(self, args, rank: int, world: int, device) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        #: the weights' dtype (`--dtype`; auto: bf16 on GPU, fp32 on CPU, where the exact rows are compared to 1e-5)
        self.dtype = DTYPES[getattr(args, "dtype", "auto")] or (torch.bfloat16 if self.cuda else torch.float32)
        # a rank that waits while another works waits on the host (gloo), not in a spinning NCCL kernel
        self.host_group = dist.new_group(backend="gloo") if dist.is_initialized() and self.cuda else None
        self.rows: list[PaperRow] = []
        self.progress = None
        self.placements: dict = {}  # model name -> the Placement its placed rows use (planned once per run)
        self.started = time.perf_counter()
        #: the row keys to run (`--rows`; default every row)
        self.wanted = set(args.rows) if getattr(args, "rows", None) else {key for key, _ in (*PREFILL_ROWS, *FINETUNE_ROWS)}

    def wants(self, *keys: str) -> bool:
        """Whether any of `keys` is a row to run."""
        return any(key in self.wanted for key in keys)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.host_group)

    def log(self, message: str) -> None:
        if self.rank == 0:
            (self.progress.write if self.progress is not None else print)(message)

    def add(self, row: PaperRow) -> None:
        self.rows.append(row)
        state = "ran" if row.ran else f"not run: {row.reason}"
        elapsed = time.perf_counter() - self.started
        self.log(f"[{elapsed:6.0f} s] {row.experiment} {row.model} {row.key}: {state}" + (f", {row.ms:.1f} ms" if row.ran else ""))
        if self.progress is not None:
            self.progress.update(1)
        if self.rank == 0:  # md and JSON after every row (a run cut at its time limit keeps them); the plot per model
            save_results(self.rows, self.args, self.world, self.device, plot_too=False)

    def save(self) -> None:
        """Write every output, the plot included (after each model's experiment and at the end)."""
        if self.rank == 0 and self.rows:
            save_results(self.rows, self.args, self.world, self.device)

    def free(self) -> None:
        """Give a dropped model's GPU memory back before the next row (on a CPU nothing: a full `gc.collect`
        costs a second there with transformers and peft imported, and tiny models need no room)."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self, set_aside_gib: float = 0.0) -> list[float]:
        """Peak GiB allocated on every rank's GPU since the last reset, less `set_aside_gib` that the row does
        not use (the stock model kept for the next rows); rank order, [] on CPU."""
        if not self.cuda:
            return []
        peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30 - set_aside_gib
        mine = torch.tensor([peak_gib], dtype=torch.float64, device=self.device)
        if not dist.is_initialized():
            return [mine.item()]
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        return [round(g.item(), 2) for g in gathered]

    def mean(self, value: float) -> float:
        return max_and_mean(value, self.device)[1]

    def max(self, value: float) -> float:
        return max_and_mean(value, self.device)[0]


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


def _mean_ct(model, world: int) -> float:
    """Mean CT over the MoE layers of an occult_hf model's last forward (this rank's tokens)."""
    from occult_hf.metrics import mean_ct
    from occult_hf.moe import OccultMoE

    values = [
        mean_ct(m.last_topk_ids_Tk.cpu().numpy(), m.layout.device_of_E.cpu().numpy(), world)
        for m in model.modules()
        if isinstance(m, OccultMoE) and m.last_topk_ids_Tk is not None
    ]
    return float(np.mean(values)) if values else float("nan")


# ----- prefill ---------------------------------------------------------------------------------
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
    _detach(record)
    _detach(handles)
    handles = hooked(model, 0)
    reference_shared = last_logits(model, shared_BS)
    _detach(handles)
    if ctx.wants("stock_1gpu"):
        handles = hooked(model, rank)
        ctx.reset_peak()
        ms = ctx.max(timed(lambda: last_logits(model, own_BS), args.iterations, device))
        ctx.add(row("stock_1gpu", tokens=tokens, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=ctx.peaks(), max_rel_err=0.0))
        _detach(handles)
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
            ct = ctx.mean(_mean_ct(converted, world)) if with_ct else None
            ms = ctx.max(timed(lambda: last_logits(converted, own_BS), args.iterations, device))
            _detach(handles)
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
        _detach(handles)
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
        _detach(handles)
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


# ----- fine-tuning -----------------------------------------------------------------------------
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
        _detach(record + handles)
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
                result.ct = ctx.mean(_mean_ct(model, world))
            _detach(handles)
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


# ----- report ----------------------------------------------------------------------------------
def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def results_tables(rows: list[PaperRow]) -> dict[str, str]:
    """One markdown table per experiment."""
    tables = {}
    for experiment in EXPERIMENTS:
        order = [key for key, _ in (PREFILL_ROWS if experiment == "prefill" else FINETUNE_ROWS)]
        models = list(PAPER_MODELS)
        chosen = sorted(
            (r for r in rows if r.experiment == experiment),
            key=lambda r: (models.index(r.model), order.index(r.key) if r.key in order else len(order)),
        )
        if not chosen:
            continue
        base_key = "stock_1gpu" if experiment == "prefill" else "fsdp2"
        bases = {r.model: r for r in chosen if r.key == base_key and r.ran}
        unit = "forward" if experiment == "prefill" else "optimizer step"
        header = ["model", "setup", "routing", f"tokens per {unit}", f"ms per {unit}", "tokens/s", f"vs {base_key}", "CT",
                  "max rel. err. vs stock" if experiment == "prefill" else "loss (step 1)", "peak GiB per GPU",
                  f"paper ({PAPER_HARDWARE})", "not run because"]  # fmt: skip
        lines = []
        for r in chosen:
            base = bases.get(r.model)
            ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base is not None and r.ran else "-"
            check = _cell(r.max_rel_err, ".1e") if experiment == "prefill" else _cell(r.loss, ".4f")
            peaks = " / ".join(f"{p:.1f}" for p in r.peak_gib) or "-"
            cells = [r.model, r.setup, r.routing, str(r.tokens) if r.ran else "-", _cell(r.ms, ".1f"),
                     _cell(r.tokens_per_s, ",.0f"), ratio, _cell(r.ct, ".2f"), check, peaks, r.paper,
                     r.reason.replace("|", "/") or "-"]  # fmt: skip
            lines.append(cells)
        tables[experiment] = markdown_table(header, lines)
    return tables


def header_lines(args, world: int, device) -> str:
    from occult_hf.benchmarks.experts import machine_line

    launcher = f"torchrun --nproc-per-node {world} -m occult_hf.cli" if world > 1 else "occult"
    command = " ".join([launcher, *(shlex.quote(a) for a in sys.argv[1:])])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"`occult bench paper`, {world} rank(s), scale {args.scale}, machine kind {args.machine_kind}, {stamp}, "
        f"{machine_line(device)}\n\ncommand: `{command}`"
    )


def plot(rows: list[PaperRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experiments = [e for e in EXPERIMENTS if any(r.experiment == e and r.ran for r in rows)]
    fig, axes = plt.subplots(1, max(len(experiments), 1), figsize=(7 * max(len(experiments), 1), 6), squeeze=False)
    for ax, experiment in zip(axes[0], experiments):
        shown = [r for r in rows if r.experiment == experiment and r.ran]
        labels = [f"{r.model}: {r.key}" for r in shown]
        ax.barh(range(len(shown)), [r.tokens_per_s for r in shown], color="tab:blue")
        ax.set_yticks(range(len(shown)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (group)", fontsize=7)
        ax.set_title(experiment, fontsize=9)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)


def save_results(rows: list[PaperRow], args, world: int, device, plot_too: bool = True) -> None:
    """Write `paper_comparison_<D>x<device>.md/.json` and, with `plot_too`, `.png` under `args.out` (rank 0;
    the plot costs about a second per call on a CPU, so rows save without it)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = header_lines(args, world, device)
    tables = results_tables(rows)
    text = header + "".join(f"\n\n### {experiment}\n\n{table}" for experiment, table in tables.items()) + "\n"
    stem = out / f"paper_comparison_{world}x{device.type}"
    atomic_write_text(stem.with_suffix(".md"), text)
    atomic_write_text(stem.with_suffix(".json"), json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    if plot_too:
        plot(rows, stem.with_suffix(".png"))


# ----- command line ----------------------------------------------------------------------------
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
