"""Triton expert MLP (forward and backward) against the PyTorch reference.

CPU tests run the kernels under the Triton interpreter. The interpreter must be chosen before
triton is first imported in a process (triton.language's own library functions are `@triton.jit`'d
at import), and another test file may import triton first; so the interpreted tests run in a child
pytest process started with TRITON_INTERPRET=1 (`test_interpreted_kernels_in_child_process`), and
nothing here sets the variable in the parent process. A session started with TRITON_INTERPRET=1 runs
them directly. Interpreted kernels use 16-wide blocks, so the tiny shapes below still span several
tiles. Every buffer the kernels must fill is allocated NaN-poisoned (`_empty` swapped), so an
unwritten element shows up as NaN.

`gpu` tests run compiled kernels in bf16 at real shapes (skipped without CUDA or when interpreting).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from occult_hf.kernels import ExpertSegments, expert_mlp_grouped_mm, expert_mlp_reference
from occult_hf.kernels import triton_expert_mlp
from occult_hf.kernels import triton_expert_mlp_kernels as kernels
from occult_hf.kernels.activations import activation_name
from occult_hf.kernels.triton_expert_mlp import REDUCE_MODES, expert_mlp_triton

expert_mlp_reference_module = importlib.import_module("occult_hf.kernels.expert_mlp_reference")
GROUPED_MM = expert_mlp_reference_module.grouped_mm_op()  # the real one, before a test patches it

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]

#: seconds the child pytest of the interpreted kernel tests may run
INTERPRETED_TIMEOUT_S = 600


@pytest.mark.skipif(INTERPRETING, reason="this process already interprets the kernels")
def test_interpreted_kernels_in_child_process():
    """This file's CPU tests in a child pytest under `TRITON_INTERPRET=1`, in one process (`-n 0`: the worker that
    runs this test waits on it, so the child takes that worker's core)."""
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-m", "not gpu", "-p", "no:cacheprovider", "-n", "0"]
    try:
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=INTERPRETED_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the interpreted kernel tests ran past {INTERPRETED_TIMEOUT_S} s")
    assert done.returncode == 0, f"interpreted kernel tests failed (exit {done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert " passed" in done.stdout and " failed" not in done.stdout


@dataclass(frozen=True)
class Problem:
    """Tensors of one local expert computation; `pairs` lists (row, local expert)."""

    x_RH: torch.Tensor
    segments: ExpertSegments
    pair_weight_N: torch.Tensor
    gate_up_L2IH: torch.Tensor
    down_LHI: torch.Tensor

    def inputs(self, dtype: torch.dtype, requires_grad: bool = True):
        tensors = [t.detach().to(dtype).requires_grad_(requires_grad) for t in (self.x_RH, self.pair_weight_N, self.gate_up_L2IH, self.down_LHI)]
        return tensors[0], tensors[1], tensors[2], tensors[3]


def make_problem(rows, hidden, inter, experts, pairs, seed=0, device="cpu") -> Problem:
    generator = torch.Generator().manual_seed(seed)
    pair_row = torch.tensor([r for r, _ in pairs], dtype=torch.int64)
    pair_expert = torch.tensor([e for _, e in pairs], dtype=torch.int64)
    segments, order = ExpertSegments.from_pairs(pair_row, pair_expert, rows, experts)
    weight = torch.rand(len(pairs), generator=generator)[order] if pairs else torch.zeros(0)
    tensors = dict(
        x_RH=torch.randn(rows, hidden, generator=generator),
        pair_weight_N=weight,
        gate_up_L2IH=torch.randn(experts, 2 * inter, hidden, generator=generator) / math.sqrt(hidden),
        down_LHI=torch.randn(experts, hidden, inter, generator=generator) / math.sqrt(inter),
    )
    segments = ExpertSegments(segments.pair_row.to(device), segments.expert_offsets.to(device), rows)
    return Problem(segments=segments, **{k: v.to(device) for k, v in tensors.items()})


def random_pairs(rows, experts, per_row, seed):
    generator = torch.Generator().manual_seed(seed + 1)
    return [(r, int(e)) for r in range(rows) for e in torch.randperm(experts, generator=generator)[:per_row]]


# name -> (R, H, I, L, pairs): what each case stresses is in the comment.
CASES = {
    # H, I not multiples of the 16-wide blocks (masked K and N edges); every row on 2 of 3 experts
    "odd_sizes": (11, 40, 24, 3, random_pairs(11, 3, 2, seed=1)),
    # experts 1 and 3 own no pair: the on-device tile schedule must skip them; H = 32 takes the unmasked-K path
    "empty_experts": (9, 32, 16, 5, [(r, e) for r in range(9) for e in (0, 2, 4) if (r + e) % 2 == 0] + [(4, 0)]),
    # one received row, served by every local expert
    "single_row": (1, 24, 20, 3, [(0, 0), (0, 1), (0, 2)]),
    # rows 1, 2, 5..10 are served by no pair and must come out zero
    "unserved_rows": (12, 24, 16, 2, [(0, 0), (3, 0), (3, 1), (4, 1), (11, 0)]),
    # 40 pairs on one expert: several M tiles and a ragged last tile per segment, multi-chunk weight-grad reduction
    "long_segment": (40, 16, 32, 2, [(r, 1) for r in range(40)] + [(r, 0) for r in range(0, 40, 7)]),
    # one local expert (L = 1) with k = 1
    "one_expert": (6, 16, 16, 1, [(r, 0) for r in range(6)]),
    # row 0 on all 10 experts (more pairs than the row sum loads at once: two rounds), row 1 on 3 beside it in
    # one row-sum program, row 2 on 9 alone in the last (its neighbour masked)
    "wide_rows": (3, 16, 16, 10, [(0, e) for e in range(10)] + [(1, e) for e in (2, 5, 7)] + [(2, e) for e in range(9)]),
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def run_with_grads(fn, problem: Problem, dtype: torch.dtype, grad_out: torch.Tensor, **kwargs):
    x, weight, gate_up, down = problem.inputs(dtype)
    out = fn(x, problem.segments, weight, gate_up, down, **kwargs)
    out.backward(grad_out.to(dtype))
    return out.detach(), [t.grad for t in (x, weight, gate_up, down)]


@pytest.fixture
def interpreted(monkeypatch):
    """Kernels interpreted on CPU, with every buffer they must fill NaN-poisoned."""
    if not INTERPRETING:
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of test_interpreted_kernels_in_child_process")

    def poisoned_empty(*shape, dtype=None, device=None):
        return torch.empty(*shape, dtype=dtype, device=device).fill_(math.nan)

    monkeypatch.setattr(triton_expert_mlp, "_empty", poisoned_empty)


@pytest.mark.parametrize("reduce", REDUCE_MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_reference(interpreted, case, reduce):
    rows, hidden, inter, experts, pairs = CASES[case]
    problem = make_problem(rows, hidden, inter, experts, pairs)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out, reduce=reduce)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)

    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel_err(out, ref_out) <= 1e-4
    served = torch.zeros(rows, dtype=torch.bool)
    served[problem.segments.pair_row] = True
    assert (out[~served] == 0).all(), "rows served by no pair must be zero"
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert grad is not None and grad.dtype == torch.float32 and not grad.isnan().any(), name
        assert rel_err(grad, ref) <= 1e-4, f"d {name}: rel. error {rel_err(grad, ref):.2e}"


def _gelu_tanh(t):
    return F.gelu(t, approximate="tanh")


@pytest.mark.parametrize("case", ["odd_sizes", "long_segment"])
def test_gelu_tanh_activation_matches_reference(interpreted, case):
    """The activation is the model's: GELU (tanh approximation) forward and derivative in every kernel."""
    rows, hidden, inter, experts, pairs = CASES[case]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=4)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(8))
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out, activation="gelu_tanh")
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out, act_fn=_gelu_tanh)
    assert rel_err(out, ref_out) <= 1e-4
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert rel_err(grad, ref) <= 1e-4, f"d {name}: rel. error {rel_err(grad, ref):.2e}"


def test_dgate_up_epilogue_on_the_whole_tile(interpreted, monkeypatch):
    """The interpreter's dgate_up config runs its epilogue on two column halves (EPI_SPLIT=2, the
    path of the wide tiles); this checks the one-piece epilogue (EPI_SPLIT=1) too."""
    import triton

    whole = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "EPI_SPLIT": 1}, num_warps=1, num_stages=1)
    monkeypatch.setattr(kernels.dgate_up_kernel, "configs", [whole])
    monkeypatch.setattr(kernels.dgate_up_kernel, "cache", {})
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=6)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(9))
    _, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out)
    _, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)
    assert all(rel_err(g, r) <= 1e-4 for g, r in zip(grads, ref_grads))


#: the kernels with TMA configs (`USE_TMA`): their operands may come through tensor descriptors
TMA_KERNELS = ("scatter_gemm_kernel", "dgate_up_kernel", "segment_outer_kernel")


def _only_configs(monkeypatch, use_tma: bool, interpreted: bool) -> None:
    """Restrict the TMA kernels' candidates to the TMA ones (or to the pointer ones), tuning cache cleared."""
    import triton

    for name in TMA_KERNELS:
        tuner = getattr(kernels, name)
        if interpreted:  # the one interpreted config, with USE_TMA set
            base = tuner.configs[0]
            configs = [triton.Config({**base.kwargs, "USE_TMA": use_tma}, num_warps=1, num_stages=1, pre_hook=base.pre_hook)]
        else:
            configs = [c for c in tuner.configs if c.kwargs.get("USE_TMA", False) == use_tma]
        assert configs, name
        monkeypatch.setattr(tuner, "configs", configs)
        monkeypatch.setattr(tuner, "cache", {})


@pytest.mark.parametrize("case", ["odd_sizes", "empty_experts", "long_segment"])
def test_tma_configs_match_reference(interpreted, monkeypatch, case):
    """The TMA configs (operands through tensor descriptors, whole weight-gradient blocks unmasked, the
    ragged tail by pointers) compute the same function: forced for every kernel that has them, on the
    edge cases that reach their branches (K not a multiple of the block: A's descriptor zero-fills, B
    falls back to pointers where a block would cross into the next expert's rows; empty experts; whole
    weight-gradient blocks and a ragged tail)."""
    monkeypatch.setattr(triton_expert_mlp, "TMA_MIN_ROWS", 0)
    _only_configs(monkeypatch, use_tma=True, interpreted=True)
    rows, hidden, inter, experts, pairs = CASES[case]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=5)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(10))
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)
    assert rel_err(out, ref_out) <= 1e-4
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert rel_err(grad, ref) <= 1e-4, f"d {name}: rel. error {rel_err(grad, ref):.2e}"


def test_tuned_launches_skip_the_autotuner_until_its_cache_is_replaced(interpreted, monkeypatch):
    """`run_tuned`: after the first launch per key the tuner's choice runs without the autotuner (the
    same bits; with the TMA configs forced, so the direct launch runs the config's descriptor pre-hook
    too); a replaced tuning cache sends the next launch through the tuner again."""
    monkeypatch.setattr(triton_expert_mlp, "TMA_MIN_ROWS", 0)
    _only_configs(monkeypatch, use_tma=True, interpreted=True)
    tuner = kernels.scatter_gemm_kernel
    tuned = []
    autotuner_run = type(tuner).run
    monkeypatch.setattr(tuner, "run", lambda *args, **kwargs: tuned.append(1) or autotuner_run(tuner, *args, **kwargs))
    problem = make_problem(*CASES["long_segment"], seed=11)
    with torch.no_grad():
        first = expert_mlp_triton(*_args(problem))
        second = expert_mlp_triton(*_args(problem))
        assert len(tuned) == 1 and torch.equal(first, second)
        assert rel_err(second, expert_mlp_reference(*_args(problem, torch.float64))) <= 1e-4
        monkeypatch.setattr(tuner, "cache", {})
        expert_mlp_triton(*_args(problem))
    assert len(tuned) == 2


@pytest.mark.skipif(INTERPRETING, reason="interpreted kernels are no `triton.jit` functions: no direct launches")
@pytest.mark.parametrize("tuner", ["gate_up_kernel", "scatter_gemm_kernel", "dgate_up_kernel", "segment_outer_kernel"])
def test_direct_launch_passes_every_parameter(tuner):
    """`run_tuned`'s direct launch (`_direct`) gives, beside the call's own arguments, every parameter the
    compiled kernel takes: the config's, the heuristics' values and the defaulted constexprs (`USE_TMA` of a
    pointer config); a parameter left out would send every launch back through `JITFunction.run`."""
    tuner = getattr(kernels, tuner)
    function = tuner.fn
    while not hasattr(function, "params"):  # under the heuristics
        function = function.fn
    first_constexpr = next(i for i, param in enumerate(function.params) if param.is_constexpr)
    args = tuple(64 for _ in tuner.arg_names[:first_constexpr])  # what the launchers pass by position
    call_site = ("ATOMIC", "TMA_OK", "B_K_AXIS", "SAVE_GU", "WRITE_HW", "GATHER_A", "GATHER_B", "ACTIVATION", "DOT_PRECISION", "BLOCK_E")
    constexprs = {name: 0 for name in tuner.arg_names[first_constexpr:] if name in call_site}
    for config in tuner.configs:
        function, meta = triton_expert_mlp._direct(tuner, config, args, constexprs)
        assert set(function.arg_names[len(args) :]) <= {*constexprs, *meta}
        assert not meta.get("USE_TMA", False) or config.kwargs.get("USE_TMA")


def test_topk_layout_only_where_it_was_run(monkeypatch):
    """`from_topk` takes the Triton layout on CUDA (and on CPU under the interpreter) up to `TOPK_MAX_EXPERTS`
    experts (the most it has run with on a GPU), any number of pairs; torch's sort elsewhere. One launch only for
    few pairs of few experts."""
    from types import SimpleNamespace

    from occult_hf.kernels import layout, triton_support
    from occult_hf.kernels.triton_layout import TOPK_MAX_EXPERTS, one_launch

    def ids(numel, is_cuda=True):
        return SimpleNamespace(is_cuda=is_cuda, numel=lambda: numel)

    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    assert layout.topk_kernel_applies(ids(1 << 20), TOPK_MAX_EXPERTS)
    assert not layout.topk_kernel_applies(ids(128), TOPK_MAX_EXPERTS + 1)
    assert not layout.topk_kernel_applies(ids(128, is_cuda=False), 8) and not layout.topk_kernel_applies(ids(0), 8)
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    assert layout.topk_kernel_applies(ids(128, is_cuda=False), 8)
    assert one_launch(8192, 128) and not one_launch(16384, 128)  # 64 experts: T = 1024 / 2048 at k = 8
    assert one_launch(1024, 256) and not one_launch(8192, 256) and not one_launch(1024, 512)


@pytest.mark.parametrize("num_pairs", [1, 37, 300])
def test_one_program_layout_is_torchs_stable_sort(interpreted, num_pairs):
    """`sort_by_group` (one Triton program) gives what torch's stable sort and a binary search give:
    the expert layout (by expert, then row) with the rows in order, and the row index (by row alone,
    including rows equal to the group count, which sort past every range)."""
    from occult_hf.kernels.layout import sort_by_group_torch
    from occult_hf.kernels.triton_layout import sort_by_group

    generator = torch.Generator().manual_seed(num_pairs)
    rows, experts = 23, 5
    pair_row = torch.randint(0, rows, (num_pairs,), generator=generator)
    pair_expert = torch.randint(0, experts, (num_pairs,), generator=generator)
    order_N, offsets, pair_row_N = sort_by_group(pair_expert, experts, pair_row, rows)
    expected = sort_by_group_torch(pair_expert, experts, pair_row, rows)
    assert torch.equal(order_N, expected[0]) and torch.equal(offsets, expected[1]) and torch.equal(pair_row_N, expected[2])
    separate = sort_by_group(pair_expert, experts, pair_row, rows, separate=True)  # the operator's own tensors
    assert all(torch.equal(a, b) for a, b in zip(separate, expected)) and separate[0].data_ptr() != separate[1].data_ptr()
    row_N = torch.randint(0, rows + 1, (num_pairs,), generator=generator)  # row R: a pair past the segments
    row_pairs_N, row_offsets, _ = sort_by_group(row_N, rows)
    sorted_N, expected_pairs_N = torch.sort(row_N, stable=True)
    assert torch.equal(row_pairs_N, expected_pairs_N)
    assert torch.equal(row_offsets, torch.searchsorted(sorted_N, torch.arange(rows + 1)))


@pytest.mark.parametrize("one_launch_work", [1 << 20, 0], ids=["one launch", "counted first"])
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 1, 3), (37, 6, 5), (70, 8, 64), (200, 2, 7), (40, 8, 200)])
def test_topk_layout_is_the_from_pairs_layout(interpreted, monkeypatch, tokens, top_k, experts, one_launch_work):
    """`ExpertSegments.from_topk` through `topk_layout_kernel` (several programs: 16 tokens each, the last one
    ragged; 200 experts: a 256-wide expert block), in one launch and after `topk_count_kernel` and
    `topk_scan_kernel` (13 programs: a scan over two steps of 8 programs' counts), gives `from_pairs`'s layout of
    the same pairs, the row -> pairs index `plan_launch` would build, the weights in segment order, and their
    gradient put back at the top-k places."""
    from occult_hf.kernels import layout, triton_layout

    generator = torch.Generator().manual_seed(tokens)
    ids_Tk = torch.randint(0, experts, (tokens, top_k), generator=generator)
    weights_Tk = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64).requires_grad_()
    row_N = torch.arange(tokens * top_k) // top_k
    expected, order_N = ExpertSegments.from_pairs(row_N, ids_Tk.reshape(-1), tokens, experts)
    expected_row_pairs_N, expected_row_offsets = layout.row_index(expected.pair_row, tokens)
    monkeypatch.setattr(layout, "topk_kernel_applies", lambda *args: True)
    monkeypatch.setattr(triton_layout, "TOPK_ONE_LAUNCH_WORK", one_launch_work)
    monkeypatch.setattr(triton_layout, "_SCAN_PROGRAMS", 8)
    segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, experts)
    assert torch.equal(segments.pair_row, expected.pair_row) and torch.equal(segments.expert_offsets, expected.expert_offsets)
    assert torch.equal(segments.row_pairs, expected_row_pairs_N) and torch.equal(segments.row_offsets, expected_row_offsets)
    assert segments.num_rows == tokens and torch.equal(weight_N, weights_Tk.detach().reshape(-1)[order_N])
    upstream_N = torch.randn(weight_N.shape, generator=generator, dtype=torch.float64)
    (weight_N * upstream_N).sum().backward()
    expected_grad = torch.zeros(tokens * top_k, dtype=torch.float64).index_add_(0, order_N, upstream_N)
    assert torch.equal(weights_Tk.grad.reshape(-1), expected_grad)


def test_tma_descriptors_only_where_tma_can_read():
    """`_descriptor` refuses rows that are not 16-byte aligned and non-unit last strides (the pointer
    configs run there); `_expert_matrix` reads both weight layouts as one matrix."""
    assert triton_expert_mlp._descriptor(torch.zeros(4, 8)) is not None
    assert triton_expert_mlp._descriptor(torch.zeros(4, 6)) is None  # 24-byte rows
    assert triton_expert_mlp._descriptor(torch.zeros(8, 4).t()) is None
    assert triton_expert_mlp._descriptor(torch.zeros(4, 9)[:, 1:]) is None  # unaligned start and rows
    down_LHI = torch.zeros(3, 8, 4)
    desc, axis = triton_expert_mlp._expert_matrix(down_LHI.transpose(1, 2))  # B_e = down_e^T [I, H]
    assert axis == 1 and desc.shape == [24, 4]
    desc, axis = triton_expert_mlp._expert_matrix(down_LHI)  # B_e = down_e [H, I]
    assert axis == 0 and desc.shape == [24, 4]
    assert triton_expert_mlp._expert_matrix(down_LHI[:, :, :2])[0] is None


def test_backward_keeps_only_the_pre_activations(interpreted):
    """Beyond its inputs the forward saves gu [N, 2I] alone: hw [N, I] is recomputed by the backward."""
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = make_problem(rows, hidden, inter, experts, pairs)
    x, weight, gate_up, down = problem.inputs(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        expert_mlp_triton(x, problem.segments, weight, gate_up, down)
    inputs = {t.data_ptr() for t in (x, weight, gate_up, down)}
    extra = [tuple(t.shape) for t in saved if t.data_ptr() not in inputs]
    assert extra == [(len(pairs), 2 * inter)], extra


def test_tile_pruning_keeps_candidates_for_every_segment_length():
    """`_prune_by_rows`: short segments tune only tiles of <= 64 rows, long ones only >= 128, and every
    kernel keeps at least one candidate at every mean segment length."""
    import triton

    for candidates in (kernels._GATE_UP_HOPPER, kernels._GEMM_HOPPER, kernels._DGATE_UP_HOPPER):
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}) for m, n, k, *_ in candidates]
        for rows in (1, 16, 64, 128, 512, 1024, 1 << 16):
            kept = kernels._prune_by_rows(configs, {"ROWS_PER_EXPERT": rows})
            block_m = {c.kwargs["BLOCK_M"] for c in kept}
            assert kept and set(kept) <= set(configs), rows
            if rows <= kernels.SMALL_T_ROWS:
                assert max(block_m) <= 64 and min(block_m) <= kernels.SMALL_M, (rows, block_m)
            elif rows >= kernels.LARGE_T_ROWS:
                assert min(block_m) >= 128, (rows, block_m)
            else:
                assert min(block_m) > kernels.SMALL_M, (rows, block_m)


def test_weight_gradient_pruning_keeps_short_reductions_for_short_segments():
    """`_prune_by_segment`: the short-reduction candidates (BLOCK_K <= SMALL_K) are tuned below
    LARGE_T_ROWS pairs per expert and dropped from it; the TMA ones only with descriptors."""
    import triton

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, **(extra[0] if extra else {})}) for m, n, k, _, _, *extra in kernels._OUTER_HOPPER]
    for rows in (1, 16, 128, 512, 1024, 1 << 16):
        for tma in (False, True):
            kept = kernels._prune_by_segment(configs, {"ROWS_PER_EXPERT": rows, "TMA_OK": tma})
            short = {c.kwargs["BLOCK_K"] <= kernels.SMALL_K for c in kept}
            assert kept and short == ({True, False} if rows < kernels.LARGE_T_ROWS else {False}), (rows, tma)
            assert any(c.kwargs.get("USE_TMA", False) for c in kept) == tma, (rows, tma)


def test_activation_names():
    from transformers.activations import ACT2FN

    assert activation_name(F.silu) == activation_name(torch.nn.SiLU()) == activation_name(ACT2FN["silu"]) == "silu"
    assert activation_name(ACT2FN["gelu_pytorch_tanh"]) == activation_name(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    for unsupported in (F.gelu, torch.nn.GELU(), ACT2FN["relu"]):
        with pytest.raises(ValueError, match="implement the activations .* not this model's expert activation"):
            activation_name(unsupported)
    with pytest.raises(ValueError, match="not one of the Triton kernels' activations"):
        expert_mlp_triton(*_args(make_problem(*CASES["single_row"])), activation="relu")


def test_no_pairs_gives_zero_output_and_zero_gradients(interpreted):
    problem = make_problem(4, 16, 16, 2, [])
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, torch.ones(4, 16))
    assert torch.equal(out, torch.zeros(4, 16))
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_deterministic_mode_is_bitwise_repeatable(interpreted):
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=3)
    grad_out = torch.randn(rows, hidden)
    first = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out, deterministic=True)
    second = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out, deterministic=True)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_inference_forward_skips_saving_and_matches(interpreted):
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=5)
    with torch.no_grad():
        out = expert_mlp_triton(*_args(problem))
    assert rel_err(out, expert_mlp_reference(*_args(problem, torch.float64))) <= 1e-4


def _args(problem: Problem, dtype=torch.float32):
    x, weight, gate_up, down = problem.inputs(dtype, requires_grad=False)
    return x, problem.segments, weight, gate_up, down


class _UnwrittenTail(torch.autograd.Function):
    """`grouped_mm` as CUDA runs it: rows past the last offset of its output, and of its input's gradient, are left
    unwritten (here NaN; PyTorch's CPU fallback writes zeros, which would hide a `0 * garbage`)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = GROUPED_MM(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
            da, db = torch.autograd.grad(GROUPED_MM(a_, b_, offs=offs), (a_, b_), grad)
        da[int(offs[-1]):] = float("nan")
        return da, db, None


@pytest.mark.parametrize("padded", [False, True])
def test_grouped_mm_reference_matches_loop_reference(padded, monkeypatch):
    """The "torch" backend's grouped_mm path; `padded` adds a static dispatch's empty slots (pairs past the
    segments, row R), which it once indexed out of range and then let `grouped_mm`'s unwritten rows into the weight
    gradient: they must change neither the output nor a gradient, with those rows NaN."""
    rows, hidden, inter, experts, pairs = CASES["empty_experts"]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=2)
    if padded:
        problem = _padded(problem, extra=5)
        unwritten_tail = lambda a, b, offs: _UnwrittenTail.apply(a, b, offs)  # noqa: E731
        monkeypatch.setattr(expert_mlp_reference_module, "grouped_mm_op", lambda: unwritten_tail)
    grad_out = torch.randn(rows, hidden)
    out, grads = run_with_grads(expert_mlp_grouped_mm, problem, torch.float32, grad_out)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)
    assert rel_err(out, ref_out) <= 1e-5
    assert all(g is not None and rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))
    if padded:
        assert torch.count_nonzero(grads[1][len(pairs):]) == 0, "pairs past the segments get no weight gradient"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: {**a, "x_RH": a["x_RH"][:-1]}, "segments.num_rows is"),
        (lambda a: {**a, "down_proj_LHI": a["down_proj_LHI"][:, :, :-1]}, "down_proj must be"),
        (lambda a: {**a, "pair_weight_N": a["pair_weight_N"][:-1]}, "pair_weight_N must be"),
        (lambda a: {**a, "gate_up_proj_L2IH": a["gate_up_proj_L2IH"].double()}, "gate_up_proj dtype"),
        (lambda a: {**a, "gate_up_proj_L2IH": a["gate_up_proj_L2IH"][:1], "down_proj_LHI": a["down_proj_LHI"][:1]}, "local experts"),
    ],
)
def test_bad_inputs_name_the_problem(mutate, message):
    rows, hidden, inter, experts, pairs = CASES["single_row"]
    x, segments, weight, gate_up, down = _args(make_problem(rows, hidden, inter, experts, pairs))
    args = dict(x_RH=x, segments=segments, pair_weight_N=weight, gate_up_proj_L2IH=gate_up, down_proj_LHI=down)
    with pytest.raises(ValueError, match=message):
        expert_mlp_triton(**mutate(args))


def test_double_backward_is_an_error_not_a_silent_zero(interpreted):
    """The kernels' backward has no backward of its own: a gradient taken with `create_graph=True` (a gradient
    penalty) used to come back without a graph, so the penalty's term was silently missing from the weights'
    gradients; the second backward is refused instead."""
    x, segments, weight, gate_up, down = _args(make_problem(*CASES["single_row"]))
    x.requires_grad_(), gate_up.requires_grad_()
    (dx,) = torch.autograd.grad(expert_mlp_triton(x, segments, weight, gate_up, down).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.pow(2).sum().backward()


def test_float64_is_refused_naming_the_backend_that_runs_it(interpreted):
    x, segments, weight, gate_up, down = _args(make_problem(*CASES["single_row"]))
    with pytest.raises(ValueError, match="got torch.float64: use expert_backend='torch' for torch.float64"):
        expert_mlp_triton(x.double(), segments, weight.double(), gate_up.double(), down.double())


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows, hidden, inter, experts, pairs = CASES["single_row"]
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        expert_mlp_triton(*_args(make_problem(rows, hidden, inter, experts, pairs)))


def test_bfloat16_under_the_interpreter_is_refused(interpreted):
    """Triton's interpreter multiplies bf16 matrices wrongly (a 16 x 16 `tl.dot` is off by 1e9, measured with Triton
    3.9), so an interpreted bf16 call would return garbage silently: it is refused, naming the interpreter."""
    rows, hidden, inter, experts, pairs = CASES["single_row"]
    x, segments, weight, gate_up, down = _args(make_problem(rows, hidden, inter, experts, pairs))
    with pytest.raises(ValueError, match="interpreter .* bfloat16"):
        expert_mlp_triton(x.bfloat16(), segments, weight, gate_up.bfloat16(), down.bfloat16())


def test_bench_experts_harness_on_a_tiny_shape(interpreted, tmp_path, monkeypatch):
    """`occult bench experts` end to end on CPU (wall-clock timer, interpreted kernels): every
    implementation computes the same function, and the tables and plot come out. One timed call each and
    no `triton_atomic` row (its reduce mode is checked against the reference above): the interpreter
    takes seconds per call."""
    from occult_hf.benchmarks import experts as bench
    from occult_hf.benchmarks.expert_timing import wall_timer

    shape = bench.ExpertShape(hidden=32, intermediate=16, num_experts=4, top_k=2, family="olmoe")
    ours = [name for name in bench.IMPLEMENTATIONS if name not in bench.PEERS and name != "triton_atomic"]
    monkeypatch.setattr(bench, "INTERLEAVE_ROUNDS", 1)  # interpreted calls take seconds; the rounds: test_interleaved_*
    result = bench.run_benchmark(
        {"tiny": shape}, [24], [*ours, "sonic_moe"], device=torch.device("cpu"), dtype=torch.float32,
        timer=wall_timer(repeats=1, warmup=False), breakdown=("tiny", 24), dense_size=64, progress=False,
    )  # fmt: skip
    measured = {m.implementation: m for m in result["measurements"]}
    assert set(measured) == {*ours, "sonic_moe"}
    for name in ours:
        m = measured[name]
        assert m.fwd_rel_err <= 1e-5 and m.fwd_ms > 0 and m.fwd_bwd_ms > 0 and m.saved_bytes > 0, m
    # the kernels keep gu [N, 2I] (fp32 here); transformers' grouped_mm keeps several [N, *] tensors more
    pairs = 24 * shape.top_k
    # (+ what the bench's layout adds: the pair weights in segment order [N] fp32, and the int64 order the
    # weights' backward reads, a view of the Triton layout's one index buffer: 3N + E + T + 2 entries)
    index_bytes = (3 * pairs + shape.num_experts + 24 + 2) * 8
    assert measured["triton_rows_io"].saved_bytes == pairs * (2 * shape.intermediate + 1) * 4 + index_bytes
    assert measured["hf_grouped_mm"].saved_bytes > measured["triton_rows_io"].saved_bytes
    assert measured["grouped_mm_fused"].saved_bytes == measured["triton_rows_io"].saved_bytes  # gu alone too
    # a peer that cannot run here gets a row that says why (SonicMoE is not installable on CPU)
    assert measured["sonic_moe"].fwd_ms is None and "sonic-moe" in measured["sonic_moe"].note
    table = result["tables"]["results"]
    assert re.search(r"\| tiny \(32/16/4/2\) +\| 24 +\| triton_rows_fp32 +\|", table) and "- note 1: sonic_moe: " in table
    assert set(result["breakdowns"]) == {"rows_io", "rows_fp32"}
    assert "bwd: d down_proj" in result["tables"]["reduce=rows_io"]
    assert "row -> pairs index" in result["tables"]["reduce=rows_fp32"]
    bench.plot(result["measurements"], tmp_path / "experts.png")
    assert (tmp_path / "experts.png").stat().st_size > 0


def test_interleaved_timing_goes_round_by_round():
    """`expert_timing.interleaved_ms`: every implementation once per round, in order (A B C, A B C, ...), each
    round with its share of the timing budget; the median of the rounds; a failing one keeps its exception and
    leaves the later rounds."""
    from occult_hf.benchmarks.expert_timing import interleaved_ms

    order, fractions = [], set()
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def timer(fn, grad_to_none=None, fraction=1.0):
        fractions.add(fraction)
        return fn()

    def call(name):
        def fn():
            order.append(name)
            if name == "c":
                raise RuntimeError("no kernel")
            return next(times[name])

        return fn

    result = interleaved_ms({name: (call(name), None) for name in "abc"}, timer, rounds=3)
    assert order == ["a", "b", "c", "a", "b", "a", "b"] and fractions == {1 / 3}
    assert result["a"] == 2.0 and result["b"] == 5.0 and isinstance(result["c"], RuntimeError)


def test_bench_candidate_comparison_restores_the_tuners(interpreted, monkeypatch):
    """`--compare-candidates`: a candidate set times the forward, forward + backward and the stages of
    the kernels with TMA candidates; the kernels' candidates and tuning caches come back as they were.
    One set (the TMA one) to keep the interpreted test short."""
    from occult_hf.benchmarks import experts as bench
    from occult_hf.benchmarks.expert_timing import wall_timer

    monkeypatch.setattr(triton_expert_mlp, "TMA_MIN_ROWS", 0)
    monkeypatch.setattr(bench, "CANDIDATE_SETS", {"TMA loads only": bench.CANDIDATE_SETS["TMA loads only"]})
    shape = bench.ExpertShape(hidden=32, intermediate=16, num_experts=4, top_k=2, family="olmoe")
    module = bench.hf_experts_module(shape, "cpu", torch.float32)
    before = {name: (getattr(kernels, name).configs, getattr(kernels, name).cache) for name in TMA_KERNELS}
    rows = bench.candidate_comparison(shape, 8, module, wall_timer(repeats=1, warmup=False), seed=0)
    assert {label for label, _, _ in rows} == set(bench.CANDIDATE_SETS)
    assert {what for _, what, _ in rows} >= {"forward", "forward + backward", "bwd: d down_proj", "fwd: down GEMM + row reduce"}
    assert all(ms > 0 for _, _, ms in rows)
    for name, (configs, cache) in before.items():
        assert getattr(kernels, name).configs is configs and getattr(kernels, name).cache is cache
    table = bench.comparison_table(rows)
    assert [cell.strip() for cell in table.splitlines()[0].strip("|").split("|")] == ["ms", *bench.CANDIDATE_SETS]
    assert module.gate_up_proj.grad is None


def test_bench_cli_parses_and_refuses_without_cuda(monkeypatch):
    from occult_hf.cli import build_parser

    args = build_parser().parse_args(["bench", "experts", "--shapes", "olmoe-1b-7b", "--tokens", "4096", "--breakdown", "none"])
    assert args.shapes == ["olmoe-1b-7b"] and args.tokens == [4096]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="this run measures a GPU and this machine has no CUDA device"):
        args.func(args)


# --- compiled kernels on a GPU -------------------------------------------------------------------


def _routed_problem(tokens, hidden, inter, experts, top_k, device, seed=0) -> Problem:
    """Every token routed to top-k of the experts (the single-device layout: R = T, N = T * k)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator, device=device)
    weights_Tk, ids_Tk = logits.softmax(-1).topk(top_k, dim=-1)
    rows = torch.arange(tokens, device=device).repeat_interleave(top_k)
    segments, order = ExpertSegments.from_pairs(rows, ids_Tk.reshape(-1), tokens, experts)
    return Problem(
        x_RH=torch.randn(tokens, hidden, generator=generator, device=device),
        segments=segments,
        pair_weight_N=weights_Tk.reshape(-1)[order],
        gate_up_L2IH=torch.randn(experts, 2 * inter, hidden, generator=generator, device=device) / math.sqrt(hidden),
        down_LHI=torch.randn(experts, hidden, inter, generator=generator, device=device) / math.sqrt(inter),
    )


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA device and compiled kernels"
)


@gpu
@needs_cuda
@pytest.mark.parametrize("reduce", REDUCE_MODES)
@pytest.mark.parametrize("shape", [(2048, 1024, 64, 8), (2048, 1408, 60, 4)], ids=["olmoe", "qwen1.5"])
def test_bf16_real_shapes_match_fp32_reference(shape, reduce):
    hidden, inter, experts, top_k = shape
    problem = _routed_problem(4096, hidden, inter, experts, top_k, "cuda")
    grad_out = torch.randn(4096, hidden, device="cuda")
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.bfloat16, grad_out, reduce=reduce)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float32, grad_out)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref_out) <= 1e-2
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert not grad.isnan().any(), name
        assert rel_err(grad, ref) <= 1e-2, f"d {name}: rel. error {rel_err(grad, ref):.2e}"
    if reduce != "atomic":  # bitwise repeatable
        again = run_with_grads(expert_mlp_triton, problem, torch.bfloat16, grad_out, reduce=reduce)
        assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1]))


@gpu
@needs_cuda
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_bf16_tma_and_pointer_configs_match_fp32_reference(monkeypatch, use_tma):
    """Each kind of candidate compiled and run on its own (the tuner may pick either), OLMoE shape,
    T = 4096 (512 pairs per expert: descriptors are made); the row modes bitwise repeatable."""
    _only_configs(monkeypatch, use_tma=use_tma, interpreted=False)
    _bf16_matches_fp32_and_repeats(_routed_problem(4096, 2048, 1024, 64, 8, "cuda", seed=2))
    if use_tma:
        assert all(getattr(kernels, name).best_config.kwargs.get("USE_TMA") for name in TMA_KERNELS)


@gpu
@needs_cuda
def test_backward_with_descriptors_on_a_fresh_autograd_thread():
    """A fresh process tunes dgate_up on the main thread (`expert_mlp_triton_stages`), then runs a forward +
    backward at a size with tensor descriptors: the backward's first kernel, on autograd's own thread, is a
    direct launch with a descriptor, which failed on the H200 ("invalid device context") before
    `_bind_cuda_context`."""
    script = """
import torch
from occult_hf.kernels import ExpertSegments
from occult_hf.kernels.triton_expert_mlp import expert_mlp_triton, expert_mlp_triton_stages
torch.manual_seed(0)
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
ids = torch.randn(4096, 64, device="cuda").topk(8, dim=-1).indices
segments, order = ExpertSegments.from_topk_ids(ids, 64)
w = torch.rand(4096 * 8, device="cuda", dtype=torch.bfloat16)[order]
gate_up = (torch.randn(64, 2048, 2048, device="cuda") / 45).to(torch.bfloat16)
down = (torch.randn(64, 2048, 1024, device="cuda") / 32).to(torch.bfloat16)
stages = expert_mlp_triton_stages(x, segments, w, gate_up, down)
[fn() for name, (fn, _) in stages.items() if name.startswith("bwd")]
leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
expert_mlp_triton(x, segments, w, gate_up, down).backward(torch.randn_like(x))
assert all(t.grad is not None and t.grad.isfinite().all() for t in leaves)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def _bf16_matches_fp32_and_repeats(problem: Problem) -> None:
    """The default mode in bf16 against the fp32 reference: forward and all four gradients <= 1e-2,
    never NaN; a second call (the tuned configs launched directly) gives the same bits."""
    grad_out = torch.randn(problem.x_RH.shape, device=problem.x_RH.device)
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.bfloat16, grad_out)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float32, grad_out)
    assert rel_err(out, ref_out) <= 1e-2
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert not grad.isnan().any() and rel_err(grad, ref) <= 1e-2, f"d {name}: rel. error {rel_err(grad, ref):.2e}"
    again = run_with_grads(expert_mlp_triton, problem, torch.bfloat16, grad_out)
    assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1]))


def _torch_sort_layout(rows_N: torch.Tensor, ids_N: torch.Tensor, num_experts: int):
    """`(pair_row_N, expert_offsets, order_N)` of the pairs by torch's stable sort (`sort_by_group_torch`): the
    layout the Triton kernels must give."""
    from occult_hf.kernels.layout import sort_by_group_torch

    order_N, offsets, _ = sort_by_group_torch(ids_N, num_experts)
    return rows_N[order_N], offsets, order_N


@gpu
@needs_cuda
def test_bf16_small_t_matches_fp32_reference():
    """T = 128 at the OLMoE shape (16 pairs per expert: the small-T row tiles and the weight gradients'
    short-reduction candidates are tuned; the layout and the row index sorted by one Triton program),
    the default mode; the second call, which launches the tuned configs directly (`run_tuned`), gives
    the same bits."""
    rows_N = torch.arange(128, device="cuda").repeat_interleave(8)
    ids_N = torch.randint(0, 64, (1024,), device="cuda")
    segments, order_N = ExpertSegments.from_pairs(rows_N, ids_N, 128, 64)  # one Triton program at this size
    expected = _torch_sort_layout(rows_N, ids_N, 64)
    assert torch.equal(segments.pair_row, expected[0]) and torch.equal(segments.expert_offsets, expected[1])
    assert torch.equal(order_N, expected[2])
    _bf16_matches_fp32_and_repeats(_routed_problem(128, 2048, 1024, 64, 8, "cuda", seed=3))


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [128, 1024, 2048, 4099, 16384])
@pytest.mark.parametrize(
    "top_k, experts",
    [(8, 64), (6, 64), (4, 60), (8, 128), (8, 256)],
    ids=["olmoe", "deepseek", "qwen1.5", "qwen3", "deepseek-v3"],
)
def test_topk_layout_on_gpu_is_the_sort_layout(tokens, top_k, experts):
    """`ExpertSegments.from_topk`'s Triton layout (compiled; one launch for few pairs of few experts, else three:
    count, scan over up to 1024 programs in steps of 256, place; 4099 tokens make a ragged last step) gives
    torch's stable-sort layout, the row index torch's sort gives, and the weights in that order."""
    generator = torch.Generator(device="cuda").manual_seed(tokens + top_k)
    logits_TE = torch.randn(tokens, experts, generator=generator, device="cuda")
    weights_Tk, ids_Tk = logits_TE.softmax(dim=-1).topk(top_k, dim=-1)
    segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, experts)
    rows_N = torch.arange(tokens * top_k, device="cuda") // top_k
    pair_row_N, offsets, order_N = _torch_sort_layout(rows_N, ids_Tk.reshape(-1), experts)
    assert torch.equal(segments.pair_row, pair_row_N) and torch.equal(segments.expert_offsets, offsets)
    assert torch.equal(weight_N, weights_Tk.reshape(-1)[order_N])
    sorted_rows_N, row_pairs_N = torch.sort(pair_row_N, stable=True)
    assert torch.equal(segments.row_pairs, row_pairs_N)
    assert torch.equal(segments.row_offsets, torch.searchsorted(sorted_rows_N, torch.arange(tokens + 1, device="cuda")))


@gpu
@needs_cuda
def test_bf16_gelu_tanh_matches_fp32_reference():
    """The GELU-tanh kernels (compiled, bf16, OLMoE shape) against the fp32 reference with the same activation."""
    problem = _routed_problem(4096, 2048, 1024, 64, 8, "cuda", seed=1)
    grad_out = torch.randn(4096, 2048, device="cuda")
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.bfloat16, grad_out, activation="gelu_tanh")
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float32, grad_out, act_fn=_gelu_tanh)
    assert rel_err(out, ref_out) <= 1e-2
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert rel_err(grad, ref) <= 1e-2, f"d {name}: rel. error {rel_err(grad, ref):.2e}"


# --- the grouped_mm_fused backend: PyTorch's grouped GEMMs, Triton kernels around them ------------------


def _padded(problem: Problem, extra: int) -> Problem:
    """The static dispatch's layout: `extra` pairs past `expert_offsets[L]`, row R, random weights (their
    outputs must be ignored and their weight gradient zero)."""
    rows, device = problem.segments.num_rows, problem.x_RH.device
    pair_row = torch.cat([problem.segments.pair_row, torch.full((extra,), rows, device=device)])
    weight = torch.cat([problem.pair_weight_N, torch.rand(extra, generator=torch.Generator().manual_seed(5)).to(device)])
    segments = ExpertSegments(pair_row, problem.segments.expert_offsets, rows)
    return Problem(problem.x_RH, segments, weight, problem.gate_up_L2IH, problem.down_LHI)


def _grouped_mm_fused(*args, **kwargs):
    from occult_hf.kernels.grouped_mm_fused import expert_mlp_grouped_mm_fused

    return expert_mlp_grouped_mm_fused(*args, **kwargs)


def test_padded_layout_matches_reference(interpreted):
    """The static dispatch's layout (pairs past `expert_offsets[L]`, row R) through the Triton backend, which
    "auto" takes for training at short segments: the padding changes no output and no gradient, and the
    empty slots' weight gradient is 0 (their partial sums are never written: NaN-poisoned here)."""
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = _padded(make_problem(rows, hidden, inter, experts, pairs), extra=5)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))
    out, grads = run_with_grads(expert_mlp_triton, problem, torch.float32, grad_out)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)
    assert rel_err(out, ref_out) <= 1e-4
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert not grad.isnan().any() and rel_err(grad, ref) <= 1e-4, name
    assert torch.count_nonzero(grads[1][len(pairs) :]) == 0


@pytest.mark.parametrize("case", [*CASES, "padded"])
def test_grouped_mm_fused_matches_reference(interpreted, case):
    """fp32 on CPU (PyTorch's grouped_mm fallback, the Triton pieces interpreted) against the fp64 reference:
    forward and all four gradients; "padded" adds pairs past the segments, which must change nothing."""
    rows, hidden, inter, experts, pairs = CASES["odd_sizes" if case == "padded" else case]
    problem = make_problem(rows, hidden, inter, experts, pairs)
    if case == "padded":
        problem = _padded(problem, extra=5)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))
    out, grads = run_with_grads(_grouped_mm_fused, problem, torch.float32, grad_out)
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out)
    assert out.dtype == torch.float32 and rel_err(out, ref_out) <= 1e-4
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        assert grad is not None and not grad.isnan().any(), name
        assert rel_err(grad, ref) <= 1e-4, f"d {name}: rel. error {rel_err(grad, ref):.2e}"
    if case == "padded":
        assert torch.count_nonzero(grads[1][len(pairs):]) == 0, "pairs past the segments get no weight gradient"


def test_grouped_mm_fused_gelu_tanh_and_saved_tensors(interpreted):
    """GELU-tanh against the reference with torch's tanh-GELU; the forward keeps only gu [N, 2I] beyond its inputs."""
    rows, hidden, inter, experts, pairs = CASES["odd_sizes"]
    problem = make_problem(rows, hidden, inter, experts, pairs, seed=4)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(8))
    out, grads = run_with_grads(_grouped_mm_fused, problem, torch.float32, grad_out, activation="gelu_tanh")
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float64, grad_out, act_fn=_gelu_tanh)
    assert rel_err(out, ref_out) <= 1e-4
    assert all(rel_err(grad, ref) <= 1e-4 for grad, ref in zip(grads, ref_grads))
    x, weight, gate_up, down = problem.inputs(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _grouped_mm_fused(x, problem.segments, weight, gate_up, down)
    inputs = {t.data_ptr() for t in (x, weight, gate_up, down)}
    assert [tuple(t.shape) for t in saved if t.data_ptr() not in inputs] == [(len(pairs), 2 * inter)]


def test_grouped_mm_fused_backend_no_pairs_and_refusals(interpreted):
    """Through `local_experts(backend="grouped_mm_fused")`: equal to the direct call; no pairs gives zeros;
    an activation the kernels lack is refused by name."""
    from occult_hf.experts import local_experts

    problem = make_problem(*CASES["single_row"])
    args = _args(problem)
    assert torch.equal(local_experts(*args, backend="grouped_mm_fused"), _grouped_mm_fused(*args))
    with pytest.raises(ValueError, match="activation"):
        local_experts(*args, act_fn=torch.relu, backend="grouped_mm_fused")
    empty = make_problem(4, 16, 16, 2, [])
    out, grads = run_with_grads(_grouped_mm_fused, empty, torch.float32, torch.ones(4, 16))
    assert torch.equal(out, torch.zeros(4, 16)) and all(torch.count_nonzero(g) == 0 for g in grads)
    unaligned = _args(make_problem(4, 20, 13, 2, [(0, 0), (1, 1)]))  # torch's "strides should be multiple of 16 bytes"
    with pytest.raises(ValueError, match="16-byte rows: hidden and expert width multiples of 4 in torch.float32; got hidden 20, width 13"):
        local_experts(*unaligned, backend="grouped_mm_fused")


def test_auto_backend_rule(monkeypatch):
    """`expert_backend="auto"` on a (stand-in) CUDA device: triton over short segments (shorter ones when a
    gradient is needed), grouped_mm_fused over long ones, triton where grouped_mm has no kernel, torch for an
    activation the kernels lack and for fp64 rows."""
    from types import SimpleNamespace

    from occult_hf import experts

    monkeypatch.setattr(experts, "triton_importable", lambda: True)
    supported = {"value": True}
    monkeypatch.setattr(experts, "grouped_mm_supported", lambda *tensors: supported["value"])

    def pick(pairs_per_expert, needs_grad, act_fn=F.silu, dtype=torch.bfloat16):
        segments = ExpertSegments(torch.zeros(4 * pairs_per_expert, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), 1)
        return experts._auto_backend(SimpleNamespace(is_cuda=True, dtype=dtype), segments, None, None, act_fn, needs_grad)

    assert pick(experts.AUTO_TRITON_TRAIN_BELOW, needs_grad=True) == pick(4096, needs_grad=False) == "grouped_mm_fused"
    assert pick(16, needs_grad=False) == pick(experts.AUTO_TRITON_BELOW - 1, needs_grad=False) == "triton"
    assert pick(16, needs_grad=True) == pick(experts.AUTO_TRITON_TRAIN_BELOW - 1, needs_grad=True) == "triton"
    assert pick(experts.AUTO_TRITON_BELOW, needs_grad=False) == "grouped_mm_fused"
    assert pick(16, needs_grad=True, act_fn=torch.relu) == "torch"
    assert pick(16, needs_grad=True, dtype=torch.float64) == "torch"  # the reference sums fp64 in fp64, the kernels in fp32
    supported["value"] = False
    assert pick(4096, needs_grad=True) == "triton"


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [128, 4096])
@pytest.mark.parametrize("shape", [(2048, 1024, 64, 8), (2048, 1408, 60, 4)], ids=["olmoe", "qwen1.5"])
def test_grouped_mm_fused_bf16_matches_fp32_reference(shape, tokens):
    """bf16 on the GPU (CUTLASS grouped GEMMs, compiled Triton pieces) against the fp32 reference, forward
    and all gradients <= 1e-2, never NaN, bitwise repeatable; at T = 4096 also with pairs past the segments."""
    hidden, inter, experts, top_k = shape
    problem = _routed_problem(tokens, hidden, inter, experts, top_k, "cuda", seed=4)
    grad_out = torch.randn(tokens, hidden, device="cuda")
    ref_out, ref_grads = run_with_grads(expert_mlp_reference, problem, torch.float32, grad_out)
    if tokens == 4096:
        problem = _padded(problem, extra=300)
    out, grads = run_with_grads(_grouped_mm_fused, problem, torch.bfloat16, grad_out)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref_out) <= 1e-2
    num_valid = ref_grads[1].shape[0]
    for name, grad, ref in zip(("x", "pair_weight", "gate_up_proj", "down_proj"), grads, ref_grads):
        grad = grad[:num_valid] if name == "pair_weight" else grad
        assert not grad.isnan().any() and rel_err(grad, ref) <= 1e-2, f"d {name}: rel. error {rel_err(grad, ref):.2e}"
    again = run_with_grads(_grouped_mm_fused, problem, torch.bfloat16, grad_out)
    assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1]))
    from occult_hf.experts import AUTO_TRITON_BELOW, AUTO_TRITON_TRAIN_BELOW, _auto_backend

    x_RH, gate_up, down = [t.to(torch.bfloat16) for t in (problem.x_RH, problem.gate_up_L2IH, problem.down_LHI)]
    short = problem.segments.num_pairs < AUTO_TRITON_BELOW * problem.segments.num_local_experts  # every case here
    training = "triton" if problem.segments.num_pairs < AUTO_TRITON_TRAIN_BELOW * problem.segments.num_local_experts else "grouped_mm_fused"
    assert _auto_backend(x_RH, problem.segments, gate_up, down, F.silu, needs_grad=True) == training  # T = 128: triton
    assert _auto_backend(x_RH, problem.segments, gate_up, down, F.silu, needs_grad=False) == ("triton" if short else "grouped_mm_fused")
    assert _auto_backend(problem.x_RH, problem.segments, problem.gate_up_L2IH, problem.down_LHI, F.silu, True) == "triton"  # fp32


def _opcheck_problem():
    """A small routed problem (16 tokens, 4 experts, k = 2: ragged segments, several tiles) with its layout's tensors."""
    problem = _routed_problem(16, 24, 16, 4, 2, "cpu")
    segments = problem.segments
    row_pairs_N, row_offsets = triton_expert_mlp.row_index_of(segments, "rows_io")
    return problem, (segments.pair_row, segments.expert_offsets), (row_pairs_N, row_offsets)


@pytest.mark.parametrize("backend", ["triton", "grouped_mm_fused"])
def test_triton_ops_pass_opcheck(interpreted, backend):
    """opcheck of the expert computation's forward operator (with its registered autograd: every input needs a
    gradient) and of its backward operator (some gradients not needed), over the interpreted kernels."""
    importlib.import_module("occult_hf.kernels.grouped_mm_fused")  # defines its operators (imported on first use)
    problem, layout, row_index = _opcheck_problem()
    inputs = problem.inputs(torch.float32)
    dout_RH = torch.randn(problem.x_RH.shape, generator=torch.Generator().manual_seed(2))
    if backend == "triton":
        forward, backward = torch.ops.occult.expert_mlp_triton, torch.ops.occult.expert_mlp_triton_backward
        static, extra = ("rows_io", "silu"), ()
    else:
        forward, backward = torch.ops.occult.expert_mlp_grouped_mm_fused, torch.ops.occult.expert_mlp_grouped_mm_fused_backward
        static, extra = ("silu",), (layout[1][1:].to(torch.int32),)
    opcheck_args = (*inputs, *layout, *extra, *row_index, *static)
    torch.library.opcheck(forward, (*opcheck_args, True))
    gu_N2I = forward(*(t.detach() for t in inputs), *layout, *extra, *row_index, *static, True)[1]
    detached = [t.detach() for t in inputs]
    torch.library.opcheck(backward, (dout_RH, *detached, gu_N2I, *layout, *extra, *row_index, *static, [True, True, False, True]))


def test_layout_ops_pass_opcheck_over_the_kernels(interpreted):
    """opcheck of `occult::sort_by_group` (one Triton program: with and without minor keys) and `occult::topk_layout`
    (its kernels, with the weights' registered gradient)."""
    generator = torch.Generator().manual_seed(3)
    group_N = torch.randint(0, 6, (40,), generator=generator)
    minor_N = torch.randint(0, 9, (40,), generator=generator)
    torch.library.opcheck(torch.ops.occult.sort_by_group, (group_N, 5, minor_N, 9))
    torch.library.opcheck(torch.ops.occult.sort_by_group, (group_N, 5, None, 1))
    ids_Tk = torch.stack([torch.randperm(7, generator=generator)[:3] for _ in range(20)])
    weights_Tk = torch.rand(20, 3, generator=generator, requires_grad=True)
    torch.library.opcheck(torch.ops.occult.topk_layout, (ids_Tk, weights_Tk, 7))


@pytest.mark.parametrize("backend, layout", [("triton", "pairs"), ("grouped_mm_fused", "topk")])
def test_triton_backends_compiled_equal_eager(interpreted, backend, layout):
    """`local_experts` with a Triton backend compiled (aot_eager, fullgraph) behind the layout it is used with: the
    top-k layout's kernels (`occult::topk_layout`), or `from_pairs` and the row index by the one-program sort
    (`occult::sort_by_group`); the output and all four gradients equal eager, for two token counts (the first marked
    dynamic) and one compilation."""
    import torch._dynamo.testing

    from occult_hf.experts import local_experts

    generator = torch.Generator().manual_seed(4)
    hidden, inter, experts, top_k = 24, 16, 4, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / 5).requires_grad_()
    down = (torch.randn(experts, hidden, inter, generator=generator) / 4).requires_grad_()

    def step(x_TH, ids_Tk, weights_Tk):
        if layout == "topk":
            segments, weight_N = ExpertSegments.from_topk(ids_Tk, weights_Tk, experts)
        else:
            segments, order_N = ExpertSegments.from_topk_ids(ids_Tk, experts)  # no row index: the kernels sort
            weight_N = weights_Tk.reshape(-1)[order_N]
        return local_experts(x_TH, segments, weight_N, gate_up, down, F.silu, backend)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for tokens in (11, 18):
        ids_Tk = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
        results = []
        for fn in (compiled, step):
            x_TH = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).requires_grad_()
            weights_Tk = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(tokens)).requires_grad_()
            if fn is compiled and tokens == 11:
                for tensor in (x_TH, ids_Tk, weights_Tk):
                    torch._dynamo.mark_dynamic(tensor, 0)
            out = fn(x_TH, ids_Tk, weights_Tk)
            results.append((out.detach(), torch.autograd.grad(out, (x_TH, weights_Tk, gate_up, down), torch.ones_like(out))))
        (got, got_grads), (want, want_grads) = results
        assert rel_err(got, want) <= 1e-5 and all(rel_err(g, w) <= 1e-5 for g, w in zip(got_grads, want_grads)), tokens
    assert counter.frame_count == 1
    graph = counter.graphs[0].code
    assert f"occult.expert_mlp_{backend}" in graph
    assert ("occult.topk_layout" if layout == "topk" else "occult.sort_by_group") in graph
    torch._dynamo.reset()


# --- a decode step's experts straight from the top-k (`triton_topk_mlp`, `LocalExperts.forward_topk`) ------------


def _topk_problem(tokens, hidden, inter, experts, top_k, seed=0, device="cpu"):
    """`(x_TH, ids_Tk, weights_Tk, gate_up_L2IH, down_LHI)` in fp32, and the layout of that top-k."""
    generator = torch.Generator().manual_seed(seed)
    weights_Tk, ids_Tk = torch.randn(tokens, experts, generator=generator).softmax(-1).topk(top_k, dim=-1)
    x_TH = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / math.sqrt(hidden)
    down = torch.randn(experts, hidden, inter, generator=generator) / math.sqrt(inter)
    tensors = tuple(t.to(device) for t in (x_TH, ids_Tk, weights_Tk, gate_up, down))
    return tensors, ExpertSegments.from_topk(tensors[1], tensors[2], experts)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [(1, 40, 24, 3, 1), (1, 32, 16, 8, 8), (3, 40, 24, 8, 2), (5, 33, 17, 4, 3), (2, 16, 48, 16, 4)],
    ids=["one_pair", "every_expert", "odd_sizes", "shared_experts", "wide"],
)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_topk_kernels_match_reference(interpreted, tokens, hidden, inter, experts, top_k, activation):
    """H and I off the 16-wide blocks, several K steps, k = 1 to 8, and tokens sharing an expert (each pair reads it)."""
    from occult_hf.kernels.triton_topk_mlp import expert_mlp_topk

    (x_TH, ids_Tk, weights_Tk, gate_up, down), (segments, weight_N) = _topk_problem(tokens, hidden, inter, experts, top_k)
    out = expert_mlp_topk(x_TH, ids_Tk, weights_Tk, gate_up, down, activation)
    act_fn = F.silu if activation == "silu" else _gelu_tanh
    expected = expert_mlp_reference(x_TH.double(), segments, weight_N.double(), gate_up.double(), down.double(), act_fn)
    assert out.dtype == torch.float32 and rel_err(out, expected) <= 1e-5


def _local_experts(experts, inter, hidden, backend="triton", seed=0):
    from occult_hf.experts import LocalExperts

    (_, _, _, gate_up, down), _ = _topk_problem(1, hidden, inter, experts, 1, seed)
    return LocalExperts(torch.nn.Parameter(gate_up), torch.nn.Parameter(down), torch.arange(experts), F.silu, backend)


def test_only_eager_decode_sizes_without_gradient_take_the_topk_path(interpreted, monkeypatch):
    """At most 4 L pairs, no gradient, a Triton backend, fp32 under the interpreter; each condition broken alone refuses."""
    experts = _local_experts(8, 16, 24)
    x_TH = torch.randn(4, 24)
    ids_Tk = torch.randint(0, 8, (4, 2))
    weights_Tk = torch.rand(4, 2)
    with torch.no_grad():
        assert experts.computes_topk(x_TH, ids_Tk, weights_Tk)
        assert experts.computes_topk(torch.randn(16, 24), torch.randint(0, 8, (16, 2)), torch.rand(16, 2))  # 32 pairs = 4 L
        assert not experts.computes_topk(x_TH[:0], ids_Tk[:0], weights_Tk[:0])  # nothing to compute
        assert not experts.computes_topk(torch.randn(17, 24), torch.randint(0, 8, (17, 2)), torch.rand(17, 2))  # 34 > 4 L
        assert not experts.computes_topk(x_TH.bfloat16(), ids_Tk, weights_Tk)  # not the weights' dtype
        assert not experts.computes_topk(torch.randn(24, 4).t(), ids_Tk, weights_Tk)  # strided along H
        assert not _local_experts(8, 16, 24, backend="torch").computes_topk(x_TH, ids_Tk, weights_Tk)
        assert not _local_experts(8, 16, 24, backend="auto").computes_topk(x_TH, ids_Tk, weights_Tk)  # auto: CUDA only
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not experts.computes_topk(x_TH, ids_Tk, weights_Tk)
    monkeypatch.undo()
    assert not experts.computes_topk(x_TH, ids_Tk, weights_Tk)  # the expert weights need their gradient
    experts.requires_grad_(False)
    assert experts.computes_topk(x_TH, ids_Tk, weights_Tk)
    assert not experts.computes_topk(x_TH, ids_Tk, weights_Tk.requires_grad_())  # the router's gradient


def test_eager_generate_decodes_through_the_topk_path_with_stocks_tokens(interpreted, monkeypatch):
    """An occult model on one device with the Triton experts: `generate()` (eager, dynamic cache) gives stock's greedy
    tokens; its prefill (40 pairs of 8 experts) goes through the layout, each decoding step (2 pairs) straight from
    the top-k; the block's counters count every step."""
    from occult_hf import apply_occult
    from occult_hf.hf.apply import occult_modules
    from occult_hf.kernels import triton_topk_mlp
    from tiny_models import tiny_model

    stock = tiny_model("olmoe", seed=3)
    model = apply_occult(tiny_model("olmoe", seed=3), {"num_devices": 1, "expert_backend": "triton"})
    pairs = []
    topk_path = triton_topk_mlp.expert_mlp_topk
    monkeypatch.setattr(triton_topk_mlp, "expert_mlp_topk", lambda x, ids, *rest: pairs.append(ids.numel()) or topk_path(x, ids, *rest))
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), stock.generate(prompt, **kwargs))
    blocks = list(occult_modules(model).values())
    assert pairs == [2] * 3 * len(blocks)  # 3 decoding steps after the prefill's first token, every layer
    assert all(int(block.stats.forwards) == 4 for block in blocks)
    assert all(block.stats.pairs_sent.tolist() == [20 * 2 + 3 * 2] for block in blocks)


def test_lora_on_the_experts_keeps_the_layout_path(interpreted, monkeypatch):
    """peft's LoRA on the fused expert weights wraps `experts` in modules that apply the adapters in their forward: a
    decode-size forward of that model never goes straight from the top-k, and equals stock's with the same LoRA."""
    peft = pytest.importorskip("peft")
    from occult_hf import apply_occult
    from occult_hf.hf.peft_support import get_peft_model
    from occult_hf.kernels import triton_topk_mlp
    from tiny_models import tiny_model

    monkeypatch.setattr(triton_topk_mlp, "expert_mlp_topk", lambda *args: pytest.fail("the top-k path skipped the adapters"))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    occult = get_peft_model(apply_occult(tiny_model("olmoe", seed=4), {"num_devices": 1, "expert_backend": "triton"}), config)
    stock = peft.get_peft_model(tiny_model("olmoe", seed=4), config)
    for model in (occult, stock):  # the same adapters, non-zero (peft starts B at zero), in both
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    input_ids = torch.tensor([[5, 9]])  # 4 pairs of 8 experts: decode size
    with torch.no_grad():
        assert rel_err(occult(input_ids=input_ids).logits, stock(input_ids=input_ids).logits) <= 1e-5


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("shape", [(2048, 1024, 64, 8), (2048, 1408, 60, 4)], ids=["olmoe", "qwen1.5"])
def test_bf16_topk_kernels_match_fp32_reference_and_the_grouped_kernels(shape, tokens):
    """Compiled, bf16, at the real shapes and decode sizes: within bf16 rounding of the fp32 reference and of the
    grouped kernels' result, and the same bits on a second call."""
    from occult_hf.kernels.triton_topk_mlp import expert_mlp_topk

    hidden, inter, experts, top_k = shape
    tensors, (segments, weight_N) = _topk_problem(tokens, hidden, inter, experts, top_k, device="cuda")
    x_TH, ids_Tk, weights_Tk, gate_up, down = (t.bfloat16() if t.is_floating_point() else t for t in tensors)
    out = expert_mlp_topk(x_TH, ids_Tk, weights_Tk, gate_up, down)
    assert torch.equal(out, expert_mlp_topk(x_TH, ids_Tk, weights_Tk, gate_up, down))
    expected = expert_mlp_reference(tensors[0], segments, weight_N, tensors[3], tensors[4])
    assert rel_err(out, expected) <= 1e-2
    grouped = expert_mlp_triton(x_TH, segments, weight_N.bfloat16(), gate_up, down)
    assert rel_err(out, grouped) <= 1e-2
