"""`occult bench experts`: the local expert computation on one GPU, our Triton kernels against the
PyTorch grouped_mm path, transformers' own experts modules and open peers, on the same routing and weights.

Shape legend: T tokens, k experts per token, E experts, H hidden, I expert width, N = T*k pairs.

Per model shape and token count T: x [T, H], expert weights (std 1/sqrt(fan-in)) and routing (top-k
of the softmax of Gaussian logits, weights not renormalised) are drawn once; every implementation
computes the same function of them:
- `triton_<reduce>`: layout (pairs sorted by expert on the device) + `expert_mlp_triton` with each
  reduction of pair outputs into rows (`REDUCE_MODES`: fp32 atomics; per-row sums of fp32 pair outputs,
  which is `deterministic=True`; per-row sums of pair outputs in x's dtype);
- `torch_grouped_mm`: layout + `expert_mlp_grouped_mm` (gather, two grouped GEMMs, `index_add`);
- `hf_grouped_mm`, `hf_eager`: the family's transformers experts module, with
  `config._experts_implementation` set as transformers does (the baseline is `hf_grouped_mm`);
- peers (`PEERS`), each an optional import whose row says why it is missing: `liger` (Liger-Kernel's
  `LigerFusedMoEFunction`, Triton, the same [E, 2I, H] / [E, H, I] weights), `sonic_moe` (SonicMoE,
  CuTe DSL).
Times are `triton.testing.do_bench` medians: forward under `no_grad`; fwd+bwd = forward + backward of
a random upstream gradient into x, the routing weights and both expert weights. Up to
`INTERLEAVE_MAX_TOKENS` tokens the implementations of a case are timed in interleaved rounds and each
row is the median of its rounds (`expert_timing`: at small T a call is host time, and the host's
speed drifts); beside the plain call, the replay of a CUDA graph of it (device time alone). FLOPs: 6 N H I
forward, 18 N H I forward + backward. The dense bf16 GEMM rate (8192^3 `torch.matmul`) is measured
in the same run. "saved for bwd" is the activation memory a forward with gradients leaves for the
backward, per token (`saved_activation_bytes`). `stage breakdown` times each Triton kernel stage alone
(`expert_mlp_triton_stages`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.arguments import positive_float
from occult_hf.benchmarks.expert_timing import (
    INTERLEAVE_MAX_TOKENS, INTERLEAVE_ROUNDS, cuda_timer, graph_replay_ms, interleaved_ms,
)  # fmt: skip
from occult_hf.expert_shapes import SHAPES, ExpertShape  # the one table of model shapes (placement reads it too)
from occult_hf.kernels import ExpertSegments, expert_mlp_grouped_mm, expert_mlp_reference
from occult_hf.benchmarks import measures_a_gpu

HELP = "expert kernels: Triton vs PyTorch grouped_mm vs transformers' experts modules vs Liger-Kernel / SonicMoE"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu
#: no `--cpu` check: the kernels it times are Triton's and CUDA's, which do not run on the CPU
CPU_CHECK = False


@dataclass(frozen=True)
class HFExperts:
    """How to build transformers' experts module of one family."""

    module: str
    experts_class: str
    config_class: str
    config_kwargs: Callable[[ExpertShape], dict]


HF_EXPERTS: dict[str, HFExperts] = {
    "olmoe": HFExperts(
        "transformers.models.olmoe.modeling_olmoe", "OlmoeExperts", "OlmoeConfig",
        lambda s: dict(hidden_size=s.hidden, intermediate_size=s.intermediate, num_experts=s.num_experts, num_experts_per_tok=s.top_k),
    ),
    "qwen2_moe": HFExperts(
        "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts", "Qwen2MoeConfig",
        lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.intermediate, num_experts=s.num_experts, num_experts_per_tok=s.top_k),
    ),
    "deepseek_v2": HFExperts(
        "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Experts", "DeepseekV2Config",
        lambda s: dict(hidden_size=s.hidden, moe_intermediate_size=s.intermediate, n_routed_experts=s.num_experts, num_experts_per_tok=s.top_k),
    ),
}  # fmt: skip

#: peers: name -> what it is (each an optional import; `peer_forward` says why one cannot run)
PEERS = {
    "liger": "Liger-Kernel's fused MoE (liger_kernel.ops.fused_moe.LigerFusedMoEFunction, Triton)",
    "sonic_moe": "SonicMoE (sonic-moe, CuTe DSL on QuACK's grouped GEMM)",
}
IMPLEMENTATIONS = (
    "triton_rows_io", "triton_rows_fp32", "triton_atomic", "grouped_mm_fused", "torch_grouped_mm", "hf_grouped_mm", "hf_eager", *PEERS
)  # fmt: skip
#: what runs without --implementations (`triton_atomic`, the non-repeatable reduction, only on request)
DEFAULT_IMPLEMENTATIONS = tuple(name for name in IMPLEMENTATIONS if name != "triton_atomic")
BASELINE = "hf_grouped_mm"
DEFAULT_TOKENS = (128, 1024, 4096, 16384, 65536)
#: why SonicMoE's row is missing on the device machine: its pinned CuTe DSL runtime (docs/bench_experts_h200.md,
#: "SonicMoE, re-checked")
SONIC_MOE_NEEDS = (
    "sonic-moe 0.1.2.post1 pins nvidia-cutlass-dsl==4.4.2, whose nvidia-cutlass-dsl-libs-base wheel "
    "(cp312, manylinux_2_28 x86_64) is 74.4 MB, over the 64 MiB a device call carries, and pins torch<=2.9.1"
)


def hf_experts_module(shape: ExpertShape, device, dtype) -> torch.nn.Module:
    """transformers' experts module of the shape's family, random weights, on `device` in `dtype`."""
    import importlib

    import transformers

    if shape.family not in HF_EXPERTS:
        raise ValueError(f"ExpertShape.family {shape.family!r} is not one of {sorted(HF_EXPERTS)}")
    spec = HF_EXPERTS[shape.family]
    config = getattr(transformers, spec.config_class)(hidden_act="silu", num_hidden_layers=1, **spec.config_kwargs(shape))
    with torch.device(device):
        module = getattr(importlib.import_module(spec.module), spec.experts_class)(config)
    expected = (shape.num_experts, 2 * shape.intermediate, shape.hidden)
    if tuple(module.gate_up_proj.shape) != expected:
        raise RuntimeError(f"{spec.experts_class} built gate_up_proj {tuple(module.gate_up_proj.shape)}, expected {expected}")
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for weight in (module.gate_up_proj, module.down_proj):
            weight.normal_(0.0, 1.0 / math.sqrt(weight.shape[-1]), generator=generator)
    return module.to(dtype)


def _layout_then(kernel: Callable, **kwargs) -> Callable:
    """forward(...) of one of our kernels, the layout included in every call (`ExpertSegments.from_topk`: one to
    three Triton launches up to `TOPK_MAX_EXPERTS` experts, torch's sort above), as transformers' modules sort
    theirs."""

    def forward(module, x_TH, topk_ids_Tk, topk_weights_Tk):
        segments, weight_N = ExpertSegments.from_topk(topk_ids_Tk, topk_weights_Tk, module.gate_up_proj.shape[0])
        return kernel(x_TH, segments, weight_N, module.gate_up_proj, module.down_proj, **kwargs)

    return forward


def _hf(implementation: str) -> Callable:
    def forward(module, x_TH, topk_ids_Tk, topk_weights_Tk):
        module.config._experts_implementation = implementation
        return module(x_TH, topk_ids_Tk, topk_weights_Tk)

    return forward


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run here; the message is the table's reason."""


@functools.lru_cache(maxsize=None)
def peer_forward(name: str) -> Callable:
    """forward(experts_module, x_TH, topk_ids_Tk, topk_weights_Tk) of a peer, or PeerUnavailable saying why."""
    if name == "liger":
        # Liger's own autotuner tries 32 configs per GEMM kernel and 16 per weight-gradient kernel; its
        # documented switch LIGER_FUSED_MOE_AUTOTUNE=0 pins one config each. The bench sets it unless the
        # caller did (`--liger-autotune`), since the tuner alone outlasts a device call here.
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
        try:
            fused_moe = importlib.import_module("liger_kernel.ops.fused_moe")
        except ImportError as error:
            raise PeerUnavailable(f"not installed ({error}); pip install liger-kernel") from error
        except Exception as error:  # noqa: BLE001 - e.g. a Triton API it expects that this Triton lacks
            raise PeerUnavailable(f"import failed: {type(error).__name__}: {error}") from error

        def liger(module, x_TH, topk_ids_Tk, topk_weights_Tk):
            return fused_moe.LigerFusedMoEFunction.apply(
                x_TH, module.gate_up_proj, module.down_proj, topk_ids_Tk.to(torch.int32), topk_weights_Tk
            )

        return liger
    if name == "sonic_moe":
        try:
            importlib.import_module("sonicmoe")
        except ImportError as error:
            raise PeerUnavailable(f"not installed ({error}): {SONIC_MOE_NEEDS}") from error
        # Never run on this project's machines (see SONIC_MOE_NEEDS): no adapter is offered untested.
        raise PeerUnavailable("sonicmoe imports, but this benchmark has no adapter tested against it")
    raise ValueError(f"peer {name!r} is not one of {list(PEERS)}")


def implementation_fn(name: str) -> Callable:
    """name -> forward(experts_module, x_TH, topk_ids_Tk, topk_weights_Tk) -> [T, H]; a peer that
    cannot run here raises PeerUnavailable."""
    if name in PEERS:
        return peer_forward(name)
    if name.startswith("triton_"):
        from occult_hf.kernels.triton_expert_mlp import REDUCE_MODES, expert_mlp_triton

        reduce = name.removeprefix("triton_")
        if reduce in REDUCE_MODES:
            return _layout_then(expert_mlp_triton, reduce=reduce)
    if name == "grouped_mm_fused":
        from occult_hf.kernels.grouped_mm_fused import expert_mlp_grouped_mm_fused

        return _layout_then(expert_mlp_grouped_mm_fused)
    if name == "torch_grouped_mm":
        return _layout_then(expert_mlp_grouped_mm)
    if name in ("hf_grouped_mm", "hf_eager"):
        return _hf(name.removeprefix("hf_"))
    raise ValueError(f"implementation {name!r} is not one of {list(IMPLEMENTATIONS)}")


@dataclass
class Measurement:
    shape: str
    tokens: int
    implementation: str
    fwd_ms: float | None
    fwd_bwd_ms: float | None
    fwd_rel_err: float | None  # forward output vs the fp32 reference
    saved_bytes: int | None = None  # activation memory a forward with gradients keeps for the backward
    note: str | None = None  # why a row has no numbers
    graph_fwd_ms: float | None = None  # replay of a CUDA graph of the call (`expert_timing.graph_replay_ms`)
    graph_fwd_bwd_ms: float | None = None
    graph_note: str | None = None  # why a row has no graph replay time

    def flops(self, shape: ExpertShape, backward: bool) -> float:
        return (18.0 if backward else 6.0) * self.tokens * shape.top_k * shape.hidden * shape.intermediate


def routing(shape: ExpertShape, tokens: int, device, dtype, seed: int):
    """x [T, H], topk_ids [T, k], topk_weights [T, k] (softmax over E, top-k, not renormalised)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x_TH = torch.randn(tokens, shape.hidden, generator=generator, device=device).to(dtype)
    logits_TE = torch.randn(tokens, shape.num_experts, generator=generator, device=device)
    topk_weights_Tk, topk_ids_Tk = logits_TE.softmax(dim=-1).topk(shape.top_k, dim=-1)
    return x_TH, topk_ids_Tk, topk_weights_Tk.to(dtype)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30))


def saved_activation_bytes(forward: Callable, inputs: list[torch.Tensor]) -> int:
    """Bytes that `forward()` (run with gradients) leaves alive for the backward, the output excluded.

    On CUDA: the growth of the allocator's live bytes across the call (everything the autograd graph
    holds, index tensors included). Elsewhere: the storages of the tensors autograd saves, other than
    `inputs` (tensors kept in a custom Function's attributes are not seen there)."""
    device = inputs[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        out = forward()
        torch.cuda.synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before - out.untyped_storage().nbytes()
        del out
        return kept
    known = {t.untyped_storage().data_ptr() for t in inputs}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    del out
    return sum(saved.values())


def measure_case(shape_name, shape, tokens, implementations, module, timer, seed, eager_max_tokens, log) -> list[Measurement]:
    """Every implementation on one (shape, T): the forward's error against the fp32 reference and the memory
    it keeps for the backward, then the plain call's times (interleaved rounds up to `INTERLEAVE_MAX_TOKENS`,
    `expert_timing`), then the replay of a CUDA graph of each call."""
    device, dtype = module.gate_up_proj.device, module.gate_up_proj.dtype
    x_TH, ids_Tk, weights_Tk = routing(shape, tokens, device, dtype, seed)
    segments, order_N = ExpertSegments.from_topk_ids(ids_Tk, shape.num_experts)
    with torch.no_grad():
        reference = expert_mlp_reference(
            x_TH.float(), segments, weights_Tk.reshape(-1)[order_N].float(),
            module.gate_up_proj.float(), module.down_proj.float(),
        )  # fmt: skip
    # the bench's own random draws take seeded generators: none reads the default one after a graph capture
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    grad_out_TH = torch.randn(x_TH.shape, generator=generator, device=device).to(dtype)
    leaves = [x_TH, weights_Tk, module.gate_up_proj, module.down_proj]
    rows: dict[str, Measurement] = {}
    calls: dict[str, _Calls] = {}
    for name in implementations:
        if name == "hf_eager" and tokens > eager_max_tokens:
            rows[name] = Measurement(shape_name, tokens, name, None, None, None, note=f"skipped above T={eager_max_tokens}")
            continue
        try:
            forward = implementation_fn(name)
        except PeerUnavailable as reason:
            rows[name] = Measurement(shape_name, tokens, name, None, None, None, note=str(reason))
            log(f"{shape_name} T={tokens} {name}: not run: {reason}")
            continue
        calls[name] = _calls(forward, module, x_TH, ids_Tk, weights_Tk, grad_out_TH)
        try:
            rel_err, saved = _check(calls[name], leaves, reference)
        except Exception as error:  # noqa: BLE001 - one failing implementation leaves a row that says why
            rows[name] = _failed(shape_name, tokens, name, error, log, device)
            del calls[name]
            continue
        finally:
            _reset(leaves)
        rows[name] = Measurement(shape_name, tokens, name, None, None, rel_err, saved)
    _time_calls(rows, calls, leaves, tokens, timer, log, device)
    for name in calls:
        m = rows[name]
        if m.fwd_ms is not None:
            log(
                f"{shape_name} T={tokens} {name}: fwd {m.fwd_ms:.3f} ms, fwd+bwd {m.fwd_bwd_ms:.3f} ms (graph "
                f"{_fmt(m.graph_fwd_ms, '.3f')} / {_fmt(m.graph_fwd_bwd_ms, '.3f')}), rel. err {m.fwd_rel_err:.1e}, "
                f"saved for bwd {m.saved_bytes / tokens / 1024:.1f} KiB/token"
            )
    return [rows[name] for name in implementations if name in rows]


@dataclass(frozen=True)
class _Calls:
    """One implementation's calls on one case."""

    fwd: Callable  # the forward under `no_grad`
    step: Callable  # forward + backward into x, the routing weights and both expert weights
    with_grad: Callable  # the forward with gradients (its output and graph; for the saved-memory count)


def _calls(forward, module, x_TH, ids_Tk, weights_Tk, grad_out_TH) -> _Calls:
    def fwd():
        with torch.no_grad():
            return forward(module, x_TH, ids_Tk, weights_Tk)

    def with_grad():
        x_TH.requires_grad_(), weights_Tk.requires_grad_()
        return forward(module, x_TH, ids_Tk, weights_Tk)

    return _Calls(fwd, lambda: with_grad().backward(grad_out_TH), with_grad)


def _check(calls: _Calls, leaves: list[torch.Tensor], reference: torch.Tensor) -> tuple[float, int]:
    """(forward rel. error against the fp32 reference, bytes a forward with gradients keeps for the backward)."""
    rel_err = _rel_err(calls.fwd(), reference)
    return rel_err, saved_activation_bytes(calls.with_grad, leaves)


def _reset(leaves: list[torch.Tensor]) -> None:
    for leaf in leaves:
        leaf.grad = None
    leaves[0].requires_grad_(False)
    leaves[1].requires_grad_(False)


def _failed(shape_name, tokens, name, error, log, device) -> Measurement:
    message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    log(f"{shape_name} T={tokens} {name}: failed: {message}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Measurement(shape_name, tokens, name, None, None, None, note=f"failed: {message}")


def _time_calls(rows: dict, calls: dict[str, _Calls], leaves, tokens: int, timer, log, device) -> None:
    """The plain calls' times (interleaved rounds at small T) and the graph replays, into `rows`."""
    rounds = INTERLEAVE_ROUNDS if tokens <= INTERLEAVE_MAX_TOKENS and len(calls) > 1 else 1
    try:
        fwd = interleaved_ms({name: (c.fwd, None) for name, c in calls.items()}, timer, rounds)
        step = interleaved_ms({name: (c.step, leaves) for name, c in calls.items()}, timer, rounds)
    finally:
        _reset(leaves)
    for name, c in calls.items():
        m = rows[name]
        error = next((t for t in (fwd[name], step[name]) if isinstance(t, Exception)), None)
        if error is not None:
            rows[name] = _failed(m.shape, tokens, name, error, log, device)
            continue
        m.fwd_ms, m.fwd_bwd_ms = fwd[name], step[name]
        if device.type != "cuda":  # CPU dry runs (tests): no graphs
            continue
        try:
            graphs = graph_replay_ms(c.fwd, timer), graph_replay_ms(c.step, timer, grad_to_none=leaves)
        finally:
            _reset(leaves)
        m.graph_fwd_ms, m.graph_fwd_bwd_ms = (t if isinstance(t, float) else None for t in graphs)
        m.graph_note = next((t for t in graphs if isinstance(t, str)), None)


def stage_breakdown(shape: ExpertShape, tokens: int, module, timer, seed: int) -> dict[str, list[tuple[str, float, float]]]:
    """reduce mode -> (stage, ms, FLOPs) of each Triton stage alone, on the benchmark's routing: every
    stage for the default mode, the stages that depend on the reduction for `deterministic=True`'s."""
    from occult_hf.kernels.triton_expert_mlp import DETERMINISTIC_REDUCE, FAST_REDUCE, expert_mlp_triton_stages

    x_TH, ids_Tk, weights_Tk = routing(shape, tokens, module.gate_up_proj.device, module.gate_up_proj.dtype, seed)
    segments, order_N = ExpertSegments.from_topk_ids(ids_Tk, shape.num_experts)
    breakdowns = {}
    with torch.no_grad():
        for i, reduce in enumerate((FAST_REDUCE, DETERMINISTIC_REDUCE)):
            stages = expert_mlp_triton_stages(
                x_TH, segments, weights_Tk.reshape(-1)[order_N], module.gate_up_proj, module.down_proj, reduce
            )
            rows = [("layout: sort pairs by expert", timer(lambda: ExpertSegments.from_topk_ids(ids_Tk, shape.num_experts)), 0.0)] if i == 0 else []
            rows += [(name, timer(fn), flops) for name, (fn, flops) in stages.items() if i == 0 or "row" in name]
            breakdowns[reduce] = rows
    return breakdowns


#: candidate sets `candidate_comparison` times against each other: name -> which configs of the kernels
#: that have TMA candidates (scatter GEMM, dgate_up, weight gradients) are tuned
CANDIDATE_SETS = {
    "pointer loads only": lambda config: not config.kwargs.get("USE_TMA", False),
    "TMA loads only": lambda config: bool(config.kwargs.get("USE_TMA", False)),
    "all (the default)": lambda config: True,
}


def candidate_comparison(shape: ExpertShape, tokens: int, module, timer, seed: int) -> list[tuple[str, str, float]]:
    """(candidate set, what, ms): `expert_mlp_triton` forward, forward + backward and the stages of the
    kernels with TMA candidates, each candidate set tuned afresh in this process (`CANDIDATE_SETS`), so
    one run times the pointer-load kernels against the tensor-descriptor ones. The kernels' candidates
    and tuning caches are restored afterwards."""
    from occult_hf.kernels import triton_expert_mlp_kernels as kernels
    from occult_hf.kernels.triton_expert_mlp import expert_mlp_triton, expert_mlp_triton_stages

    tuners = [kernels.scatter_gemm_kernel, kernels.dgate_up_kernel, kernels.segment_outer_kernel]
    saved = [(tuner.configs, tuner.cache) for tuner in tuners]
    x_TH, ids_Tk, weights_Tk = routing(shape, tokens, module.gate_up_proj.device, module.gate_up_proj.dtype, seed)
    segments, order_N = ExpertSegments.from_topk_ids(ids_Tk, shape.num_experts)
    weight_N = weights_Tk.reshape(-1)[order_N]
    grad_out_TH = torch.randn_like(x_TH)
    leaves = [x_TH.requires_grad_(), weight_N.requires_grad_(), module.gate_up_proj, module.down_proj]
    rows = []
    try:
        for label, keep in CANDIDATE_SETS.items():
            for tuner, (configs, _) in zip(tuners, saved):
                tuner.configs = [config for config in configs if keep(config)] or configs
                tuner.cache = {}
            run = lambda: expert_mlp_triton(x_TH, segments, weight_N, module.gate_up_proj, module.down_proj)  # noqa: E731
            with torch.no_grad():
                rows.append((label, "forward", timer(run)))
            rows.append((label, "forward + backward", timer(lambda: run().backward(grad_out_TH), grad_to_none=leaves)))
            with torch.no_grad():
                stages = expert_mlp_triton_stages(x_TH, segments, weight_N, module.gate_up_proj, module.down_proj)
                for name, (fn, _) in stages.items():
                    if "GEMM" in name and "gate_up GEMM" not in name or "bwd" in name:
                        rows.append((label, name, timer(fn)))
    finally:
        for tuner, (configs, cache) in zip(tuners, saved):
            tuner.configs, tuner.cache = configs, cache
        for leaf in leaves:
            leaf.grad = None
    return rows


def comparison_table(rows: list[tuple[str, str, float]]) -> str:
    """One column per candidate set, one row per measured call."""
    labels = list(dict.fromkeys(label for label, _, _ in rows))
    whats = list(dict.fromkeys(what for _, what, _ in rows))
    ms = {(label, what): value for label, what, value in rows}
    cells = [[what] + [_fmt(ms.get((label, what)), ".3f") for label in labels] for what in whats]
    return markdown_table(["ms", *labels], cells)


#: the side of the square matmul whose rate the benchmarks' "% dense" and roofline figures are against
DENSE_GEMM_SIZE = 8192


def dense_gemm_tflops(device, dtype, timer, size: int = DENSE_GEMM_SIZE) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2.0 * size**3 / timer(lambda: a @ b) / 1e9


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def results_table(measurements: list[Measurement], shapes: dict[str, ExpertShape], dense_tflops: float) -> str:
    """The results as markdown; rows without numbers point to a numbered note printed below the table."""
    baseline = {(m.shape, m.tokens): m for m in measurements if m.implementation == BASELINE}
    notes: dict[str, int] = {}
    rows = []
    for m in measurements:
        shape = shapes[m.shape]
        base = baseline.get((m.shape, m.tokens))
        cells = [f"{m.shape} ({shape.label()})", str(m.tokens), m.implementation]
        for ms, base_ms, backward in ((m.fwd_ms, base and base.fwd_ms, False), (m.fwd_bwd_ms, base and base.fwd_bwd_ms, True)):
            tflops = None if ms is None else m.flops(shape, backward) / ms / 1e9
            cells += [
                _fmt(ms, ".3f"),
                _fmt(tflops, ".0f"),
                _fmt(None if tflops is None else 100 * tflops / dense_tflops, ".0f"),
                _fmt(None if ms is None or not base_ms else base_ms / ms, ".2f"),
            ]
        cells.append(_fmt(m.fwd_rel_err, ".1e"))
        cells.append(_fmt(None if m.saved_bytes is None else m.saved_bytes / m.tokens / 1024, ".1f"))
        for ms, base_ms in ((m.graph_fwd_ms, base and base.graph_fwd_ms), (m.graph_fwd_bwd_ms, base and base.graph_fwd_bwd_ms)):
            ratio = "" if ms is None or not base_ms else f" ({base_ms / ms:.2f}x)"
            cells.append(_fmt(ms, ".3f") + ratio)
        why = [f"{m.implementation}: {text}" for text in (m.note, m.graph_note) if text is not None]
        cells.append(", ".join(f"note {notes.setdefault(key, len(notes) + 1)}" for key in why))
        rows.append(cells)
    header = ["model (H/I/E/k)", "T", "implementation",
              "fwd ms", "fwd TFLOP/s", "fwd % dense", f"fwd x vs {BASELINE}",
              "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd % dense", f"fwd+bwd x vs {BASELINE}",
              "fwd rel. err vs fp32", "saved for bwd KiB/token",
              f"CUDA-graph replay fwd ms (x vs {BASELINE})", "CUDA-graph replay fwd+bwd ms (x)", ""]  # fmt: skip
    table = markdown_table(header, rows)
    if notes:
        table += "\n\n" + "\n".join(f"- note {number}: {text}" for text, number in notes.items())
    return table


def breakdown_table(rows: list[tuple[str, float, float]], dense_tflops: float) -> str:
    cells = []
    for name, ms, flops in rows:
        tflops = flops / ms / 1e9 if flops else None
        cells.append([name, f"{ms:.3f}", _fmt(tflops, ".0f"), _fmt(None if tflops is None else 100 * tflops / dense_tflops, ".0f")])
    return markdown_table(["stage", "ms", "TFLOP/s", "% dense"], cells)


def plot(measurements: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(m.shape for m in measurements))
    tokens = sorted({m.tokens for m in measurements})
    implementations = list(dict.fromkeys(m.implementation for m in measurements if m.fwd_ms is not None))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 3.2 * len(shapes)), squeeze=False)
    width = 0.8 / len(implementations)
    for row, shape in enumerate(shapes):
        for col, (attr, title) in enumerate((("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))):
            ax = axes[row][col]
            for i, name in enumerate(implementations):
                values = []
                for t in tokens:
                    match = [m for m in measurements if (m.shape, m.tokens, m.implementation) == (shape, t, name)]
                    values.append(getattr(match[0], attr) if match and getattr(match[0], attr) is not None else float("nan"))
                ax.bar([j + i * width for j in range(len(tokens))], values, width, label=name)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], [f"T={t}" for t in tokens])
            ax.set_yscale("log")
            ax.set_ylabel("ms (log)")
            ax.set_title(f"{shape}: {title}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    plt.close(fig)


def run_benchmark(
    shapes: dict[str, ExpertShape],
    tokens: list[int],
    implementations: list[str],
    *,
    device,
    dtype=torch.bfloat16,
    timer: Callable,
    eager_max_tokens: int = 16384,
    breakdown: tuple[str, int] | None = None,
    seed: int = 0,
    dense_size: int = DENSE_GEMM_SIZE,
    progress: bool = True,
) -> dict:
    """Measures every (shape, T, implementation); returns the results and the markdown tables."""
    from occult_hf.utils.progress import progress_bar

    for name in implementations:
        try:
            implementation_fn(name)  # validates the name before any work
        except PeerUnavailable:
            pass  # measure_case gives it a row that says why
    dense = dense_gemm_tflops(device, dtype, timer, dense_size)
    measurements: list[Measurement] = []
    breakdowns: dict[str, list] = {}
    cases = [(name, t) for name in shapes for t in tokens]
    bar = progress_bar(cases, desc="occult bench experts", enabled=progress)
    log = bar.write if progress else (lambda message: None)
    for shape_name, t in bar:
        shape = shapes[shape_name]
        module = hf_experts_module(shape, device, dtype)
        measurements += measure_case(shape_name, shape, t, implementations, module, timer, seed, eager_max_tokens, log)
        if breakdown == (shape_name, t):
            try:
                breakdowns = stage_breakdown(shape, t, module, timer, seed)
            except Exception as error:  # noqa: BLE001 - the results table matters more than the breakdown
                log(f"stage breakdown failed: {type(error).__name__}: {error}")
        del module
    tables = {"results": results_table(measurements, shapes, dense)}
    for mode, rows in breakdowns.items():
        tables[f"reduce={mode}"] = breakdown_table(rows, dense)
    return {"dense_tflops": dense, "measurements": measurements, "breakdowns": breakdowns, "tables": tables}


def machine_line(device) -> str:
    import transformers
    import triton

    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else platform.processor() or "cpu"
    return (
        f"{datetime.date.today().isoformat()}, {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}"
    )


#: (shape, T, forward speed-up, forward + backward speed-up, forward's fraction of the dense rate) that
#: the default Triton path must reach against BASELINE
TARGET = ("olmoe-1b-7b", 16384, 2.0, 1.7, 0.65)
#: (forward, forward + backward) speed-ups over BASELINE that every measured (shape, T) must reach
EVERY_CASE_TARGET = (1.5, 1.3)


def target_lines(measurements: list[Measurement], shapes: dict[str, ExpertShape], dense_tflops: float) -> list[str]:
    from occult_hf.kernels.triton_expert_mlp import DETERMINISTIC_REDUCE, FAST_REDUCE

    shape_name, tokens, fwd_goal, fwd_bwd_goal, rate_goal = TARGET
    found = {m.implementation: m for m in measurements if (m.shape, m.tokens) == (shape_name, tokens)}
    base = found.get(BASELINE)
    lines = []
    if base is not None and base.fwd_ms is not None:
        for ours in (f"triton_{FAST_REDUCE}", "grouped_mm_fused"):
            lines += _every_case_lines(measurements, ours)
    labelled = (
        (f"triton_{FAST_REDUCE}", "default Triton, deterministic=False"),
        (f"triton_{DETERMINISTIC_REDUCE}", "Triton, deterministic=True"),
        ("grouped_mm_fused", "CUTLASS grouped GEMMs, Triton around them"),
    )
    for name, label in labelled:
        ours = found.get(name)
        if ours is None or base is None or None in (ours.fwd_ms, ours.fwd_bwd_ms, base.fwd_ms, base.fwd_bwd_ms):
            continue
        shape = shapes[shape_name]
        fwd_x, fwd_bwd_x = base.fwd_ms / ours.fwd_ms, base.fwd_bwd_ms / ours.fwd_bwd_ms
        fwd_rate = ours.flops(shape, False) / ours.fwd_ms / 1e9 / dense_tflops
        fwd_bwd_rate = ours.flops(shape, True) / ours.fwd_bwd_ms / 1e9 / dense_tflops
        lines.append(
            f"- {shape_name} T={tokens}, {name} ({label}): forward {fwd_x:.2f}x {BASELINE} (target {fwd_goal}x), "
            f"forward+backward {fwd_bwd_x:.2f}x (target {fwd_bwd_goal}x), {100 * fwd_rate:.0f}% (forward) and "
            f"{100 * fwd_bwd_rate:.0f}% (forward+backward) of the dense bf16 GEMM rate (target {100 * rate_goal:.0f}% forward)"
        )
    return lines


def _every_case_lines(measurements: list[Measurement], ours: str) -> list[str]:
    """The every-case targets for `ours`, and every case where a peer is faster than `ours`."""
    by_case: dict[tuple[str, int], dict[str, Measurement]] = {}
    for m in measurements:
        by_case.setdefault((m.shape, m.tokens), {})[m.implementation] = m
    fwd_goal, fwd_bwd_goal = EVERY_CASE_TARGET
    short, faster_peers, cases = [], [], 0
    for (shape, tokens), found in by_case.items():
        mine, base = found.get(ours), found.get(BASELINE)
        if mine is None or base is None or None in (mine.fwd_ms, mine.fwd_bwd_ms, base.fwd_ms, base.fwd_bwd_ms):
            continue
        cases += 1
        fwd_x, fwd_bwd_x = base.fwd_ms / mine.fwd_ms, base.fwd_bwd_ms / mine.fwd_bwd_ms
        if fwd_x < fwd_goal or fwd_bwd_x < fwd_bwd_goal:
            short.append(f"{shape} T={tokens} ({fwd_x:.2f}x / {fwd_bwd_x:.2f}x)")
        for peer in PEERS:
            theirs = found.get(peer)
            if theirs is None or theirs.fwd_ms is None or theirs.fwd_bwd_ms is None:
                continue
            for label, attr in (("forward", "fwd_ms"), ("forward+backward", "fwd_bwd_ms")):
                if getattr(theirs, attr) < getattr(mine, attr):
                    faster_peers.append(f"{peer} {label} at {shape} T={tokens} ({getattr(theirs, attr):.3f} vs {getattr(mine, attr):.3f} ms)")
    lines = [
        f"- every case, {ours} (target {fwd_goal}x forward and {fwd_bwd_goal}x forward+backward over {BASELINE}): "
        + (f"{cases - len(short)} of {cases} met; short: " + ", ".join(short) if short else f"all {cases} met")
    ]
    lines.append(f"- peers faster than {ours}: " + ("; ".join(faster_peers) if faster_peers else "none"))
    return lines


def report(result: dict, shapes: dict[str, ExpertShape], device, breakdown: tuple[str, int] | None) -> str:
    parts = [
        f"Machine: {machine_line(device)}. Dense bf16 GEMM (8192^3 torch.matmul): {result['dense_tflops']:.0f} TFLOP/s.",
        result["tables"]["results"],
    ]
    targets = target_lines(result["measurements"], shapes, result["dense_tflops"])
    if targets:
        parts.append("Targets:\n" + "\n".join(targets))
    for name, table in result["tables"].items():
        if name != "results" and breakdown:
            parts.append(f"Triton stages alone, {breakdown[0]} T={breakdown[1]}, {name}:\n\n{table}")
    tuned = tuned_configs_table()
    if tuned:
        parts.append(f"Configurations the Triton autotuner chose (kernel, tuning key, config):\n\n{tuned}")
    return "\n\n".join(parts) + "\n"


def tuned_configs_table() -> str:
    """Each Triton kernel's tuned configuration per tuning key, as far as this process tuned them."""
    import sys

    tuned = {
        "occult_hf.kernels.triton_expert_mlp_kernels": (
            "gate_up_kernel", "scatter_gemm_kernel", "segment_sum_kernel", "dgate_up_kernel", "segment_outer_kernel",
        ),
        "occult_hf.kernels.grouped_mm_fused_kernels": ("gather_rows_kernel",),
    }  # fmt: skip
    rows = []
    for module_name, names in tuned.items():
        for name in names:
            tuner = getattr(sys.modules.get(module_name), name, None)
            for key, config in sorted(getattr(tuner, "cache", {}).items(), key=str):
                rows.append([name, ", ".join(map(str, key)), str(config)])
    return markdown_table(["kernel", "key", "config"], rows) if rows else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="model shapes (default: all)")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS), help="token counts T (default: %(default)s)")
    parser.add_argument(
        "--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(DEFAULT_IMPLEMENTATIONS),
        help=f"what to time (default: all but triton_atomic; ratios are against {BASELINE})",
    )  # fmt: skip
    parser.add_argument(
        "--liger-autotune", action="store_true",
        help="let Liger-Kernel's fused MoE run its own autotuner (minutes of compiling; default: its one pinned config)",
    )  # fmt: skip
    parser.add_argument("--eager-max-tokens", type=int, default=16384, help="skip hf_eager above this T (it is slow)")
    parser.add_argument(
        "--breakdown", default="olmoe-1b-7b:16384",
        help="SHAPE:T whose Triton stages are also timed one by one, or 'none' (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-candidates", default="none",
        help="SHAPE:T at which the Triton kernels are also tuned and timed with each candidate set "
        "(pointer loads only, TMA only, all), or 'none' (default)",
    )  # fmt: skip
    parser.add_argument("--out", default="occult_bench", help="directory for experts.md, experts.json, experts.png (default: ./occult_bench)")
    parser.add_argument("--warmup-ms", type=positive_float, default=25.0, help="do_bench warm-up (ms)")
    parser.add_argument("--rep-ms", type=positive_float, default=100.0, help="do_bench repetition time (ms)")
    parser.add_argument("--seed", type=int, default=0)


def _parse_breakdown(value: str, shapes: list[str], flag: str = "--breakdown") -> tuple[str, int] | None:
    if value == "none":
        return None
    name, _, tokens = value.rpartition(":")
    if name not in shapes or not tokens.isdigit():
        raise SystemExit(f"{flag} {value!r} must be SHAPE:T with SHAPE one of {shapes}, or 'none'")
    return name, int(tokens)


def run(args: argparse.Namespace) -> int:
    if min(args.tokens) < 1:
        raise SystemExit(f"--tokens must be positive, got {args.tokens}")
    breakdown = _parse_breakdown(args.breakdown, args.shapes)
    compare = _parse_breakdown(args.compare_candidates, args.shapes, "--compare-candidates")
    if args.liger_autotune:
        os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "1"
    device = torch.device("cuda")
    result = run_benchmark(
        {name: SHAPES[name] for name in args.shapes}, args.tokens, args.implementations,
        device=device, timer=cuda_timer(args.warmup_ms, args.rep_ms),
        eager_max_tokens=args.eager_max_tokens, breakdown=breakdown, seed=args.seed,
    )  # fmt: skip
    text = report(result, {name: SHAPES[name] for name in args.shapes}, device, breakdown)
    if compare is not None:
        shape = SHAPES[compare[0]]
        module = hf_experts_module(shape, device, torch.bfloat16)
        rows = candidate_comparison(shape, compare[1], module, cuda_timer(args.warmup_ms, args.rep_ms), args.seed)
        text += f"\nTriton candidate sets, {compare[0]} T={compare[1]} (each tuned afresh):\n\n{comparison_table(rows)}\n"
        del module
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "experts.md", text)
    payload = {
        "machine": machine_line(device),
        "dense_tflops": result["dense_tflops"],
        "measurements": [asdict(m) for m in result["measurements"]],
        "breakdowns": result["breakdowns"],
    }
    atomic_write_text(out / "experts.json", json.dumps(payload, indent=1))
    plot(result["measurements"], out / "experts.png")
    print(f"wrote {out / 'experts.md'}, {out / 'experts.json'}, {out / 'experts.png'}")
    return 0
