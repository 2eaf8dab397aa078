"""Property tests of dispatch/combine and the local expert computation (STYLE.md guideline 12).

Single process (logical devices): round trip, counts, one device equals no EP, one expert equals a
dense MLP, E not divisible by D, k = E, no tokens; outputs and gradients against a naive per-(token,
expert) loop. A 4-rank gloo world: the same against the naive loop with uneven token counts (one
rank with none), an uneven placement of E=7 experts, gradients of inputs, routing weights and
expert weights, and the real Qwen1.5-MoE routing trace replayed through the dispatcher (rows sent
equal the CT count; dedup sends fewer rows than per_expert). The send layout against a loop (packed
and padded, both modes) and the fp32 per-token row sum. Also the test harness itself.

Shape legend: T tokens, H hidden, E experts, k experts per token, D devices, I expert width.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distributed import WorldError, run_world
from host_reads import no_host_reads
from operator_counts import NOT_LAUNCHES, copies, under_aten
from occult_hf.dispatch import DispatchSettings, ExchangeError, ExpertParallelGroup, TokenRouting, build_dispatcher
from occult_hf.experts import LocalExperts, expert_mlp_grouped_mm, local_experts
from occult_hf.kernels.expert_mlp_reference import expert_mlp_reference
from occult_hf.placement import Placement

HIDDEN, WIDTH = 8, 4
QWEN_TRACE = Path(__file__).resolve().parents[1].parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


# ----- helpers ---------------------------------------------------------------------------------
def make_routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    """`x [T, H]`, distinct `ids [T, k]`, positive `weights [T, k]`, all float32, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(num_tokens, HIDDEN, generator=generator)
    rows = [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)]
    ids_Tk = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    weights_Tk = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    return x_TH, ids_Tk, weights_Tk


def make_experts(num_experts: int, seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    gate_up_E2IH = torch.randn(num_experts, 2 * WIDTH, HIDDEN, generator=generator) / HIDDEN**0.5
    down_EHI = torch.randn(num_experts, HIDDEN, WIDTH, generator=generator) / WIDTH**0.5
    return gate_up_E2IH, down_EHI


def naive_moe(x_TH, ids_Tk, weights_Tk, gate_up_E2IH, down_EHI):
    """The definition: sum over a token's k experts of weight * down(silu(gate) * up)."""
    gate_up_Tk2I = torch.einsum("th,tkih->tki", x_TH, gate_up_E2IH[ids_Tk])
    gate_TkI, up_TkI = gate_up_Tk2I.chunk(2, dim=-1)
    y_TkH = torch.einsum("tki,tkhi->tkh", F.silu(gate_TkI) * up_TkI, down_EHI[ids_Tk])
    return (y_TkH * weights_Tk[..., None]).sum(1)


def ct_count(ids_Tk: np.ndarray, device_of_E: np.ndarray) -> int:
    """Sum over tokens of the number of distinct devices holding the token's experts (by sets)."""
    return sum(len({int(device_of_E[e]) for e in row}) for row in ids_Tk)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not expected.numel():
        return 0.0
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def one_process_dispatcher(device_of_E, num_experts: int, num_devices: int, mode: str):
    ep = ExpertParallelGroup(num_devices=num_devices)
    layout = Placement(num_experts, num_devices, {0: [int(d) for d in device_of_E]}).layout(0)
    return build_dispatcher(DispatchSettings(mode=mode), ep, layout)


def one_process_moe(x_TH, ids_Tk, weights_Tk, gate_up_E2IH, down_EHI, device_of_E, num_devices, mode):
    dispatcher = one_process_dispatcher(device_of_E, gate_up_E2IH.shape[0], num_devices, mode)
    assert dispatcher.name == "local"
    sent = dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
    out_RH = local_experts(sent.x_RH, sent.segments, sent.pair_weight_N, gate_up_E2IH, down_EHI, F.silu, backend="torch")
    return dispatcher.combine(out_RH, sent.plan), sent


# ----- single process -----------------------------------------------------------------------------
# (E, k, D, T): what each stresses
CASES = [
    (8, 2, 1, 5),  # one device: no EP
    (8, 2, 3, 17),  # D does not divide E
    (7, 3, 3, 16),  # prime E, k = 3
    (6, 6, 4, 9),  # k = E: every token on every device
    (1, 1, 1, 4),  # one expert: a dense MLP
    (5, 2, 5, 0),  # no tokens
    (9, 1, 3, 11),  # k = 1: dedup and per_expert send the same rows
]


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
@pytest.mark.parametrize("num_experts, top_k, num_devices, num_tokens", CASES)
def test_dispatch_one_process(num_experts, top_k, num_devices, num_tokens, mode):
    x_TH, ids_Tk, weights_Tk = make_routing(num_tokens, num_experts, top_k, seed=num_experts * 31 + top_k)
    gate_up_E2IH, down_EHI = make_experts(num_experts)
    device_of_E = np.random.default_rng(num_experts).permutation(np.arange(num_experts) * num_devices // num_experts)
    leaves = [t.clone().requires_grad_() for t in (x_TH, weights_Tk, gate_up_E2IH, down_EHI)]
    out_TH, sent = one_process_moe(leaves[0], ids_Tk, leaves[1], leaves[2], leaves[3], device_of_E, num_devices, mode)
    plan = sent.plan

    # counts (per logical device): pairs sum to T*k; rows are the CT count (dedup) or T*k (per_expert);
    # in one process the rows computed are the tokens (dedup) or one per pair (per_expert): static sizes
    expected_rows = ct_count(ids_Tk.numpy(), device_of_E) if mode == "dedup" else num_tokens * top_k
    send_pairs = plan.counts_D2[:, 1].tolist()
    assert sum(send_pairs) == num_tokens * top_k
    assert sum(plan.send_rows) == expected_rows
    assert sent.x_RH.shape[0] == (num_tokens if mode == "dedup" else num_tokens * top_k)
    hits_TD = np.zeros((num_tokens, num_devices), dtype=int)
    np.add.at(hits_TD, (np.repeat(np.arange(num_tokens), top_k), device_of_E[ids_Tk.numpy().reshape(-1)]), 1)
    per_device = (hits_TD > 0).sum(0) if mode == "dedup" else hits_TD.sum(0)
    assert list(plan.send_rows) == per_device.tolist()
    assert send_pairs == hits_TD.sum(0).tolist()
    # layout: pairs grouped by expert, rows increasing inside each expert
    offsets = sent.segments.expert_offsets.tolist()
    assert offsets[0] == 0 and offsets[-1] == num_tokens * top_k and offsets == sorted(offsets)
    for start, end in zip(offsets, offsets[1:]):
        rows = sent.segments.pair_row[start:end]
        assert torch.all(rows[1:] > rows[:-1])
    if mode == "dedup":  # one process: the tokens themselves are the rows
        assert torch.equal(sent.x_RH, x_TH)

    # output and gradients against the naive loop
    reference_leaves = [t.clone().requires_grad_() for t in (x_TH, weights_Tk, gate_up_E2IH, down_EHI)]
    reference_TH = naive_moe(reference_leaves[0], ids_Tk, *reference_leaves[1:])
    assert rel_err(out_TH, reference_TH) <= 1e-5
    if num_tokens:
        probe_TH = torch.randn_like(out_TH)
        (out_TH * probe_TH).sum().backward()
        (reference_TH * probe_TH).sum().backward()
        for name, leaf, ref in zip(("x", "weights", "gate_up", "down"), leaves, reference_leaves):
            assert rel_err(leaf.grad, ref.grad) <= 1e-5, name
    if num_experts == 1:  # one expert: a dense MLP scaled by the weight
        gate, up = F.linear(x_TH, gate_up_E2IH[0]).chunk(2, dim=-1)
        dense_TH = F.linear(F.silu(gate) * up, down_EHI[0]) * weights_Tk
        assert rel_err(out_TH.detach(), dense_TH) <= 1e-5


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
def test_round_trip_returns_input_times_rows_per_token(mode):
    """combine(dispatch(x)) with identity experts gives x times the rows per token: one in one process
    (dedup), k (per_expert). Over real ranks the fan-out is CT (the 4-rank world checks that)."""
    num_experts, top_k, num_devices = 10, 4, 4
    x_TH, ids_Tk, weights_Tk = make_routing(23, num_experts, top_k, seed=3)
    device_of_E = np.arange(num_experts) * num_devices // num_experts
    dispatcher = one_process_dispatcher(device_of_E, num_experts, num_devices, mode)
    sent = dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
    fan_out = 1 if mode == "dedup" else top_k
    torch.testing.assert_close(dispatcher.combine(sent.x_RH, sent.plan), x_TH * fan_out, rtol=1e-6, atol=0)


def test_dedup_equals_per_expert_and_sends_fewer_rows():
    num_experts, top_k, num_devices = 12, 4, 3
    x_TH, ids_Tk, weights_Tk = make_routing(40, num_experts, top_k, seed=5)
    gate_up_E2IH, down_EHI = make_experts(num_experts)
    device_of_E = np.arange(num_experts) * num_devices // num_experts
    outs, rows = {}, {}
    for mode in ("dedup", "per_expert"):
        outs[mode], sent = one_process_moe(x_TH, ids_Tk, weights_Tk, gate_up_E2IH, down_EHI, device_of_E, num_devices, mode)
        rows[mode] = sum(sent.plan.send_rows)
    assert rel_err(outs["dedup"], outs["per_expert"]) <= 1e-6
    assert rows["dedup"] < rows["per_expert"] == 40 * top_k


def test_bad_mode_and_backend_are_rejected():
    with pytest.raises(ValueError, match="dispatch mode must be one of"):
        DispatchSettings(mode="broadcast")
    gate_up_E2IH, down_EHI = make_experts(4)
    with pytest.raises(ValueError, match=r"OccultConfig.expert_backend must be one of \[.auto., .grouped_mm_fused., .torch., .triton.\], got .cuda."):
        LocalExperts(torch.nn.Parameter(gate_up_E2IH), torch.nn.Parameter(down_EHI), torch.arange(4), F.silu, backend="cuda")
    with pytest.raises(ValueError, match="not this model.s expert activation gelu"):
        LocalExperts(torch.nn.Parameter(gate_up_E2IH), torch.nn.Parameter(down_EHI), torch.arange(4), F.gelu, backend="triton")


def _expert_inputs(rows=5, hidden=8, width=4, experts=3, pairs=((0, 0), (1, 0), (2, 1), (4, 2))):
    """`local_experts`' arguments: `pairs` (row, local expert) in expert order, random fp32 tensors."""
    from occult_hf.kernels.layout import ExpertSegments

    generator = torch.Generator().manual_seed(5)
    pair_row = torch.tensor([row for row, _ in pairs], dtype=torch.int64)
    counts = torch.bincount(torch.tensor([e for _, e in pairs], dtype=torch.int64), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return [
        torch.randn(rows, hidden, generator=generator), ExpertSegments(pair_row, offsets, rows),
        torch.rand(len(pairs), generator=generator), torch.randn(experts, 2 * width, hidden, generator=generator),
        torch.randn(experts, hidden, width, generator=generator),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda a: a.__setitem__(0, a[0][None]), r"x_RH must be \[R, H\], got shape \(1, 5, 8\)"),
        (lambda a: a.__setitem__(0, torch.randn(7, 8)), "x_RH has 7 rows but segments.num_rows is 5"),
        (lambda a: (a.__setitem__(3, torch.randn(4, 8, 8)), a.__setitem__(4, torch.randn(4, 8, 4))),
         "segments.expert_offsets describes 3 local experts but the weights hold 4"),
        (lambda a: a.__setitem__(4, torch.randn(3, 8, 3)), r"down_proj must be \[L, H, I\] = \[3, 8, 4\]"),
        (lambda a: a.__setitem__(2, torch.rand(5)), r"pair_weight_N must be \[N=4\], got shape \(5,\)"),
        (lambda a: a.__setitem__(3, a[3].double()), "gate_up_proj dtype torch.float64 differs from x_RH dtype torch.float32"),
    ],
    ids=["x-3d", "x-more-rows", "weights-one-more-expert", "down-width", "pair-weights-too-long", "weights-dtype"],
)
def test_the_torch_backend_names_inputs_of_the_wrong_shape(spoil, message):
    """What the Triton backends refuse, the portable one refuses too, naming the input (it had run some of these
    without an error: rows past num_rows dropped, a fourth expert or extra pair weights ignored)."""
    args = _expert_inputs()
    spoil(args)
    with pytest.raises(ValueError, match=message):
        local_experts(*args, backend="torch")


@pytest.mark.parametrize("rows", [0, 3])
def test_an_expert_computation_with_no_pair_still_has_a_gradient(rows):
    """No (row, expert) pair: the output is zeros connected to every input, whose gradients are zeros, as the Triton
    kernels give. Under EP the exchanges' backward must run on the rank whose experts got nothing."""
    x_RH, segments, pair_weight_N, gate_up, down = _expert_inputs(rows=rows, pairs=())
    inputs = [t.requires_grad_() for t in (x_RH, pair_weight_N, gate_up, down)]
    out_RH = local_experts(x_RH, segments, pair_weight_N, gate_up, down, backend="torch")
    assert out_RH.shape == (rows, 8) and not out_RH.any() and out_RH.requires_grad
    out_RH.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in inputs)


def test_grouped_mm_path_matches_reference_forward():
    """The grouped-GEMM path (used on CUDA/bf16) computes the reference function (CPU forward, fp32)."""
    if getattr(torch.nn.functional, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped_mm")
    num_experts, top_k = 5, 2
    x_TH, ids_Tk, weights_Tk = make_routing(19, num_experts, top_k, seed=11)
    gate_up_E2IH, down_EHI = make_experts(num_experts)
    sent = one_process_dispatcher([0, 0, 1, 1, 1], num_experts, 2, "dedup").dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
    args = (sent.x_RH, sent.segments, sent.pair_weight_N, gate_up_E2IH, down_EHI, F.silu)
    try:
        grouped = expert_mlp_grouped_mm(*args)
    except RuntimeError as error:  # CPU grouped_mm kernels are not in every build
        pytest.skip(f"grouped_mm has no CPU kernel here: {error}")
    assert rel_err(grouped, expert_mlp_reference(*args)) <= 1e-5


def test_expert_parallel_group_resolution():
    assert ExpertParallelGroup.resolve(None, None) == ExpertParallelGroup(num_devices=1)
    assert ExpertParallelGroup.resolve(None, 4).num_devices == 4 and not ExpertParallelGroup.resolve(None, 4).is_distributed


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
def test_one_process_block_reads_nothing_on_the_host(mode):
    """Route, dispatch, experts (layout), combine and the counters of an `OccultMoE` with 3 logical devices,
    forward and backward, without one data-dependent host read: the CPU stand-in for the GPU test that
    runs under `torch.cuda.set_sync_debug_mode("error")` (tests/test_gpu_dispatch.py)."""
    from tiny_models import tiny_model

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = apply_occult(tiny_model("olmoe", seed=2), OccultConfig(num_devices=3, dispatch=mode, expert_backend="torch"))
    block = next(iter(occult_modules(model).values()))
    hidden = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    expected = block(hidden)
    with no_host_reads("the one-process forward"):
        out = block(hidden)
        out.square().sum().backward()
    assert torch.equal(out, expected) and hidden.grad is not None


def test_dispatcher_registry_and_config_errors():
    from occult_hf import OccultConfig
    from occult_hf.dispatch import TokenDispatcher, dispatcher_class, dispatcher_names, register_dispatcher

    assert {"local", "all_to_all"} <= set(dispatcher_names())
    assert dispatcher_class("auto", ExpertParallelGroup(num_devices=4)).name == "local"
    with pytest.raises(ValueError, match=r"OccultConfig.dispatcher must be one of \['auto', 'all_to_all', 'hierarchical', 'local', 'padded', 'symm_mem'\], got"):
        OccultConfig(dispatcher="nvshmem")
    with pytest.raises(ValueError, match="cannot serve 2 devices in one process"):
        dispatcher_class("all_to_all", ExpertParallelGroup(num_devices=2))
    with pytest.raises(ValueError, match="dispatch_chunks must be an integer >= 1 or None, got 0"):
        OccultConfig(dispatch_chunks=0)
    with pytest.raises(ValueError, match=r"OccultConfig.exchange_timeout_s=-1 must be a number of seconds in \(0, 86400\]"):
        OccultConfig(exchange_timeout_s=-1)

    class Duplicate(TokenDispatcher):
        name = "local"

    with pytest.raises(ValueError, match="dispatcher 'local' is already registered"):
        register_dispatcher(Duplicate)
    Duplicate.name = "Local"
    with pytest.raises(ValueError, match="lowercase"):
        register_dispatcher(Duplicate)


def test_chunks_cover_the_tokens():
    from occult_hf.dispatch.plan import chunk_bounds

    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2)]  # never an empty chunk of its own (the group pads with empty ones)
    assert chunk_bounds(0, 4) == [(0, 0)]


def _naive_layout(dest_Tk, local_Tk, weights_Tk, num_devices, mode, base_D, capacity):
    """The send layout by loops: rows by device, then token (then slot in "per_expert")."""
    num_tokens, top_k = dest_Tk.shape
    width = top_k if mode == "dedup" else 1
    token_O = [num_tokens] * capacity
    slot_OW = [[-1] * width for _ in range(capacity)]
    weight_OW = [[0.0] * width for _ in range(capacity)]
    row_TJ = [[capacity] * (min(num_devices, top_k) if mode == "dedup" else top_k) for _ in range(num_tokens)]
    counts = [[0, 0] for _ in range(num_devices)]
    for d in range(num_devices):
        position = base_D[d]
        for t in range(num_tokens):
            slots = [j for j in range(top_k) if dest_Tk[t, j] == d]
            counts[d][1] += len(slots)
            rows = [slots] if mode == "dedup" and slots else [[j] for j in slots] if mode == "per_expert" else []
            for served in rows:
                token_O[position] = t
                for j in served:
                    column = j if mode == "dedup" else 0
                    slot_OW[position][column] = int(local_Tk[t, j])
                    weight_OW[position][column] = float(weights_Tk[t, j])
                    if mode == "per_expert":
                        row_TJ[t][j] = position
                if mode == "dedup":
                    row_TJ[t][sum(1 for e in range(d) if (dest_Tk[t] == e).any())] = position
                counts[d][0] += 1
                position += 1
    return token_O, slot_OW, weight_OW, row_TJ, counts


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
@pytest.mark.parametrize("num_devices,top_k", [(3, 2), (4, 4), (2, 1), (5, 3)])
def test_send_layout_matches_a_naive_layout(mode, num_devices, top_k):
    """`plan.send_layout` (scans and scatters, no loops) equals the loop: positions, slots, weights, each
    token's row positions and the counts; several experts of a token may share a device."""
    from occult_hf.dispatch.plan import device_match, send_capacity, send_layout
    from occult_hf.metrics import ct_and_remote_T, device_hits_TD

    num_tokens = 9
    generator = torch.Generator().manual_seed(num_devices * 10 + top_k)
    dest_Tk = torch.randint(0, num_devices, (num_tokens, top_k), generator=generator)
    local_Tk = torch.randint(0, 6, (num_tokens, top_k), generator=generator)
    weights_Tk = torch.rand(num_tokens, top_k, generator=generator)
    capacity = send_capacity(num_tokens, top_k, num_devices, mode)
    rows_D = [int(((dest_Tk == d).any(1) if mode == "dedup" else (dest_Tk == d)).sum()) for d in range(num_devices)]
    base_D = [sum(rows_D[:d]) for d in range(num_devices)]
    layout = send_layout(dest_Tk, local_Tk, weights_Tk, num_devices, mode)
    token_O, slot_OW, weight_OW, row_TJ, counts = _naive_layout(dest_Tk, local_Tk, weights_Tk, num_devices, mode, base_D, capacity)
    assert layout.capacity == capacity
    assert layout.token_O.tolist() == token_O
    assert layout.slot_OW.tolist() == slot_OW and layout.slot_OW.dtype == torch.int32
    torch.testing.assert_close(layout.weight_OW, torch.tensor(weight_OW))
    assert layout.row_TJ.tolist() == row_TJ
    assert layout.counts_D2.tolist() == counts
    # the layout counts its rows from its own mask; device_match (the count exchange's and the local
    # dispatcher's) from its [D, T, k] match; the CT metrics from the per-token count (metrics.device_hits_TD):
    # all three agree, per chunk too
    assert device_match(dest_Tk, num_devices, mode).counts_D2.tolist() == counts
    chunked = device_match(dest_Tk[:4], num_devices, mode).counts_D2 + device_match(dest_Tk[4:], num_devices, mode).counts_D2
    assert chunked.tolist() == counts
    hits_TD = device_hits_TD(dest_Tk, num_devices)
    assert hits_TD.sum(0).tolist() == [pairs for _, pairs in counts]
    if mode == "dedup":
        ct_T, _ = ct_and_remote_T(hits_TD, torch.zeros(num_tokens, dtype=torch.int64))
        assert int(ct_T.sum()) == sum(rows for rows, _ in counts)
    # the torch.distributed dispatcher's layout, the row count known: the same O rows
    _check_packed_rows(dest_Tk, local_Tk, weights_Tk, num_devices, mode, layout, counts)


@pytest.mark.parametrize("mode", ["dedup", "per_expert"])
@pytest.mark.parametrize("num_devices,top_k,group_tokens", [(3, 2, 9), (2, 4, 12), (5, 3, 10)])
def test_padded_layout_matches_a_naive_layout(mode, num_devices, top_k, group_tokens):
    """`plan.padded_layout`: device d's slot holds row i for token i ("per_expert": entry i = t * k + j), a phantom
    (slots -1, weight 0) where the token sends nothing there, token T past this rank's T; each token's rows; the counts."""
    from occult_hf.dispatch.plan import device_match, padded_layout

    num_tokens = 9
    generator = torch.Generator().manual_seed(num_devices * 10 + top_k)
    dest_Tk = torch.randint(0, num_devices, (num_tokens, top_k), generator=generator)
    local_Tk = torch.randint(0, 6, (num_tokens, top_k), generator=generator)
    weights_Tk = torch.rand(num_tokens, top_k, generator=generator)
    layout = padded_layout(dest_Tk, local_Tk, weights_Tk, num_devices, mode, group_tokens)
    dedup, per_peer = mode == "dedup", group_tokens * (1 if mode == "dedup" else top_k)
    token_O, slot_OW, weight_OW = [], [], []
    for d in range(num_devices):
        for i in range(per_peer):
            t, own = (i, range(top_k)) if dedup else (i // top_k, [i % top_k])
            token_O.append(min(t, num_tokens))
            served = [t < num_tokens and int(dest_Tk[t, j]) == d for j in own]
            slot_OW.append([int(local_Tk[t, j]) if hit else -1 for j, hit in zip(own, served)])
            weight_OW.append([float(weights_Tk[t, j]) if hit else 0.0 for j, hit in zip(own, served)])
    capacity = num_devices * per_peer
    if dedup:
        row_TJ = [[d * group_tokens + t if (dest_Tk[t] == d).any() else capacity for d in range(num_devices)] for t in range(num_tokens)]
    else:
        row_TJ = [[(int(dest_Tk[t, j]) * group_tokens + t) * top_k + j for j in range(top_k)] for t in range(num_tokens)]
    assert layout.capacity == capacity and layout.token_O.tolist() == token_O
    assert layout.slot_OW.tolist() == slot_OW and layout.slot_OW.dtype == torch.int32
    torch.testing.assert_close(layout.weight_OW, torch.tensor(weight_OW))
    assert layout.row_TJ.tolist() == row_TJ
    assert layout.counts_D2.tolist() == device_match(dest_Tk, num_devices, mode).counts_D2.tolist()


def _check_packed_rows(dest_Tk, local_Tk, weights_Tk, num_devices, mode, layout, counts):
    """`plan.device_match` + `plan.packed_rows` give `send_layout`'s first O rows and counts, and each token's
    rows (counted from one, 0 absent) sum to what `send_layout`'s row positions sum to."""
    from occult_hf.dispatch.plan import device_match, packed_rows

    match = device_match(dest_Tk, num_devices, mode)
    assert match.counts_D2.tolist() == counts
    rows = sum(r for r, _ in counts)
    packed = packed_rows(match, local_Tk, weights_Tk, rows)
    assert packed.token_O.tolist() == layout.token_O[:rows].tolist()
    assert packed.slot_OW.tolist() == layout.slot_OW[:rows].tolist()
    torch.testing.assert_close(packed.weight_OW, layout.weight_OW[:rows])
    values_O = torch.randn(rows, 2, dtype=torch.float64)
    top_k = dest_Tk.shape[1]
    width = min(num_devices, top_k) if mode == "dedup" else top_k
    assert packed.row_TJ.shape == (dest_Tk.shape[0], num_devices if mode == "dedup" and num_devices <= top_k else width)
    padded_O = torch.cat([values_O, torch.zeros(layout.capacity + 1 - rows, 2, dtype=torch.float64)])
    expected = padded_O[layout.row_TJ].sum(1)
    torch.testing.assert_close(torch.cat([torch.zeros(1, 2, dtype=torch.float64), values_O])[packed.row_TJ].sum(1), expected)
    # each row is referenced exactly once
    assert sorted(v for v in packed.row_TJ.reshape(-1).tolist() if v) == list(range(1, rows + 1))


def test_sum_token_rows_sums_each_tokens_rows_in_fp32_through_a_zero_row():
    from occult_hf.dispatch.base import sum_token_rows

    rows_pad_OH = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0]], dtype=torch.bfloat16)
    row_TJ = torch.tensor([[0, 2], [1, 3], [3, 3]])  # token 2 has no rows: the zero row
    out_TH = sum_token_rows(rows_pad_OH, row_TJ)
    assert out_TH.dtype == torch.bfloat16 and out_TH.tolist() == [[6.0, 8.0], [3.0, 4.0], [0.0, 0.0]]
    big = torch.tensor([[256.0], [1.0], [1.0], [0.0]], dtype=torch.bfloat16)  # 256 + 1 + 1 = 258 exactly in fp32
    assert sum_token_rows(big, torch.tensor([[0, 1, 2]])).item() == 258.0  # bf16 pairwise would give 256


def test_row_format_packs_fields_aligned_and_round_trips():
    from occult_hf.dispatch import RowFormat

    row_format = RowFormat([(torch.bfloat16, 3), (torch.int32, 2), (torch.float32, 2)])
    assert row_format.offsets == (0, 8, 16) and row_format.row_bytes == 24  # bf16 x 3 = 6 bytes, padded to 8
    x, slots, weights = torch.randn(5, 3).bfloat16(), torch.arange(10, dtype=torch.int32).reshape(5, 2), torch.rand(5, 2)
    block = row_format.pack(x, slots, weights)
    assert block.dtype == torch.uint8 and block.shape == (5, 24)
    for unpacked, original in zip(row_format.unpack(block), (x, slots, weights)):
        assert torch.equal(unpacked, original)
    assert all(t.shape[0] == 0 for t in row_format.unpack(row_format.pack(x[:0], slots[:0], weights[:0])))


# ----- a 4-rank world ----------------------------------------------------------------------------------
WORLD_EXPERTS = 7
WORLD_DEVICE_OF_E = [2, 0, 3, 1, 0, 2, 1]  # capacities [2, 2, 2, 1]: uneven, not contiguous
WORLD_TOKENS = [6, 11, 4, 0]  # a rank with no tokens still joins every collective


def _world_inputs(rank: int, top_k: int):
    return make_routing(WORLD_TOKENS[rank], WORLD_EXPERTS, top_k, seed=1000 + rank)


def _check_ep_against_naive(rank, world_size, mode, top_k, chunks):
    """`chunks` None: `dispatch()`, the experts, `combine()`; else `run()` with that many chunks (the
    pipelined path the model uses; the ranks' token counts differ, so they must agree on the chunk count)."""
    placement = Placement(WORLD_EXPERTS, world_size, {0: WORLD_DEVICE_OF_E})
    ep = ExpertParallelGroup.resolve(None, world_size)
    assert ep.is_distributed and ep.rank == rank
    gate_up_E2IH, down_EHI = make_experts(WORLD_EXPERTS)
    local_ids = placement.experts_on(0, rank)
    experts = LocalExperts(
        torch.nn.Parameter(gate_up_E2IH[local_ids].clone()), torch.nn.Parameter(down_EHI[local_ids].clone()),
        torch.tensor(local_ids), F.silu, backend="torch",
    )  # fmt: skip
    local_gate_up, local_down = experts.gate_up_proj, experts.down_proj
    x_TH, ids_Tk, weights_Tk = _world_inputs(rank, top_k)
    x_TH.requires_grad_()
    weights_Tk.requires_grad_()

    dispatcher = build_dispatcher(DispatchSettings(mode=mode, chunks=chunks), ep, placement.layout(0, rank))
    assert dispatcher.name == "all_to_all"
    if chunks is None:
        sent = dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
        out_RH = experts(sent.x_RH, sent.segments, sent.pair_weight_N)
        out_TH, plan = dispatcher.combine(out_RH, sent.plan), sent.plan
        assert sent.x_RH.shape[0] == sum(plan.recv_splits)
    else:
        started = []  # the count exchanges started; `concurrent` must run after it starts, before the host reads it
        start_counts = dispatcher._exchange_counts
        dispatcher._exchange_counts = lambda message: started.append(start_counts(message)) or started[-1]
        issued = []
        concurrent = lambda: issued.append(len(started) == 1 and started[0]._result is None)  # noqa: E731
        out_TH, plan = dispatcher.run(x_TH, TokenRouting(ids_Tk, weights_Tk), experts, concurrent=concurrent)
        assert issued == [True], issued
    # rows received are what the others sent here
    received = torch.tensor(plan.send_rows)
    torch.distributed.all_reduce(received)
    assert sum(plan.recv_splits) == int(received[rank]) and plan.send_rows == plan.send_splits
    probe_TH = torch.randn(out_TH.shape, generator=torch.Generator().manual_seed(rank))
    (out_TH * probe_TH).sum().backward()

    # reference: every rank's tokens through the naive loop in this process
    full_gate_up, full_down = gate_up_E2IH.clone().requires_grad_(), down_EHI.clone().requires_grad_()
    for source in range(world_size):
        xs, ids, ws = _world_inputs(source, top_k)
        xs.requires_grad_(), ws.requires_grad_()
        reference_TH = naive_moe(xs, ids, ws, full_gate_up, full_down)
        (reference_TH * torch.randn(reference_TH.shape, generator=torch.Generator().manual_seed(source))).sum().backward()
        if source == rank:
            assert rel_err(out_TH.detach(), reference_TH.detach()) <= 1e-5
            if xs.shape[0]:
                assert rel_err(x_TH.grad, xs.grad) <= 1e-5 and rel_err(weights_Tk.grad, ws.grad) <= 1e-5
    # expert weights: gradient summed over every rank's tokens
    assert rel_err(local_gate_up.grad, full_gate_up.grad[local_ids]) <= 1e-5
    assert rel_err(local_down.grad, full_down.grad[local_ids]) <= 1e-5


def _replay_trace(rank, world_size, trace_ids_Nk, trace_weights_Nk):
    """The Qwen1.5-MoE layer-0 routing, sharded over the ranks as EP shards a batch, through the dispatcher."""
    from occult_hf.metrics import communication_volume, token_ranks

    num_experts = 60
    source_N = token_ranks(trace_ids_Nk.shape[0], world_size)
    mine = source_N == rank
    ids_Tk = torch.from_numpy(trace_ids_Nk[mine]).long()
    weights_Tk = torch.from_numpy(trace_weights_Nk[mine])
    x_TH = torch.randn(ids_Tk.shape[0], HIDDEN, generator=torch.Generator().manual_seed(rank))
    ep = ExpertParallelGroup.resolve(None, world_size)
    layouts = {
        "contiguous": Placement.contiguous(num_experts, world_size, [0]),
        "shuffled": Placement(num_experts, world_size, {0: np.random.default_rng(0).permutation(np.arange(60) * world_size // 60).tolist()}),
    }
    report = {}
    for name, placement in layouts.items():
        device_of_E = np.array(placement.device_of(0))
        rows = {}
        for mode in ("dedup", "per_expert"):
            dispatcher = build_dispatcher(DispatchSettings("all_to_all", mode=mode), ep, placement.layout(0, rank))
            sent = dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
            rows[mode] = sum(sent.plan.send_rows)
            remote = rows[mode] - sent.plan.send_rows[rank]
            # identity experts: the round trip returns each token times its fan-out
            fan_out_T = torch.tensor([len({int(device_of_E[e]) for e in row}) if mode == "dedup" else 4 for row in ids_Tk.tolist()])
            torch.testing.assert_close(dispatcher.combine(sent.x_RH, sent.plan), x_TH * fan_out_T[:, None].float(), rtol=1e-6, atol=0)
            if mode == "dedup":
                assert rows[mode] == ct_count(ids_Tk.numpy(), device_of_E)  # independent CT count
                volume = communication_volume(trace_ids_Nk.astype(np.int64), device_of_E, world_size, source_N)
                assert remote == int(volume.sent_rows_D[rank])  # the metrics module's remote copies
        assert rows["per_expert"] == ids_Tk.shape[0] * 4
        assert rows["dedup"] < rows["per_expert"]
        report[name] = rows
    return report


#: aten calls (views and allocations excluded, unless they copy) of one "all_to_all" run() with trivial experts,
#: T=128, E=64, k=8, at most: (forward, forward+backward) per mode. Before the layout moved after the count
#: exchange (session 4) the same count was dedup 68 / 89, per_expert 55 / 75 (D=2); then 32 / 50 and 28 / 45; with
#: the pair weights by `torch.take` and no materialised zero gradients, 31 / 47 and 28 / 43; with the routing
#: weights' gradient gathered per pair (D <= k), 31 / 46 and 28 / 42.
OPERATOR_BUDGET = {"dedup": (34, 49), "per_expert": (31, 45)}


def _count_operators(rank, world_size) -> dict:
    """Top-level aten calls that launch work (views and allocations excluded) of one `run()` per mode, forward and
    forward+backward, after a warm-up: what each costs in launches and host time on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    num_experts, top_k = 64, 8
    ep = ExpertParallelGroup.resolve(None, world_size)
    generator = torch.Generator().manual_seed(rank)
    ids_Tk = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(128)])
    counts = {}
    for mode in ("dedup", "per_expert"):
        layout = Placement.contiguous(num_experts, world_size, [0]).layout(0, rank)
        dispatcher = build_dispatcher(DispatchSettings("all_to_all", mode=mode), ep, layout)
        for backward in (False, True):
            x_TH = torch.randn(128, HIDDEN, generator=generator, requires_grad=backward)
            weights_Tk = torch.rand(128, top_k, generator=generator, requires_grad=backward)

            def step():
                out_TH, _ = dispatcher.run(x_TH, TokenRouting(ids_Tk, weights_Tk), lambda x_RH, segments, weight_N: x_RH * 2)
                if backward:
                    out_TH.sum().backward()

            step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            top = [e for e in prof.events() if e.name.startswith("aten::") and not under_aten(e)]
            counts[(mode, backward)] = sum(e.name not in NOT_LAUNCHES or copies(e) for e in top)
    return counts


def _dispatch_world(rank, world_size, trace):
    for mode in ("dedup", "per_expert"):
        for top_k in (1, 3):
            for chunks in (None, 1, 3):
                _check_ep_against_naive(rank, world_size, mode, top_k, chunks)
    report = _replay_trace(rank, world_size, *trace) if trace is not None else None
    return report, _count_operators(rank, world_size)


def _load_qwen_trace():
    if not QWEN_TRACE.is_file():
        return None
    data = np.load(QWEN_TRACE)
    keep = ~data["is_warmup_dummy"]
    return data["topk_ids"][keep].astype(np.int64), data["topk_weights"][keep].astype(np.float32)


@pytest.mark.world_size(4)
def test_dispatch_in_a_4_rank_world():
    """4 gloo ranks: exact against the naive loop (values and gradients), the operator calls of one run() within
    `OPERATOR_BUDGET`, then the real Qwen trace replayed."""
    trace = _load_qwen_trace()
    results = run_world(_dispatch_world, 4, trace)
    reports = [report for report, _ in results]
    for _, counts in results:
        for (mode, backward), calls in counts.items():
            assert 10 < calls <= OPERATOR_BUDGET[mode][int(backward)], (mode, backward, calls)
    if trace is None:
        pytest.skip(f"EP exactness passed; real-trace replay skipped: {QWEN_TRACE} is absent")
    assert trace[0].shape[0] == 4384
    for name in ("contiguous", "shuffled"):
        dedup = sum(r[name]["dedup"] for r in reports)
        per_expert = sum(r[name]["per_expert"] for r in reports)
        assert dedup < per_expert == 4384 * 4


def _stalled_peer_world(rank, world_size):
    """Rank 1 never reaches the layer: rank 0's count exchange must fail within the timeout, naming the layer."""
    import time

    if rank == 1:
        time.sleep(6)
        return None
    ep = ExpertParallelGroup.resolve(None, world_size)
    layout = Placement(2, 2, {7: [0, 1]}).layout(7, rank)
    dispatcher = build_dispatcher(DispatchSettings("all_to_all", timeout_s=1.5), ep, layout)
    x_TH, ids_Tk, weights_Tk = make_routing(4, 2, 1, seed=0)
    started = time.monotonic()
    try:
        dispatcher.dispatch(x_TH, TokenRouting(ids_Tk, weights_Tk))
    except ExchangeError as error:
        return str(error), time.monotonic() - started
    raise AssertionError("the exchange with a stalled peer returned")


@pytest.mark.world_size(2)
def test_a_stalled_peer_fails_the_exchange_within_the_timeout():
    message, waited = run_world(_stalled_peer_world, 2, timeout_s=120)[0]
    assert "layer 7: the count exchange failed or did not finish within 1.5 s" in message
    assert "OCCULT_EXCHANGE_TIMEOUT_S" in message and waited < 5


# ----- the harness itself ------------------------------------------------------------------------------
def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    torch.distributed.barrier()


def _sleep_on_rank_one(rank, world_size):
    if rank == 1:
        import time

        time.sleep(60)


@pytest.mark.world_size(2)
def test_harness_reports_child_exceptions():
    with pytest.raises(WorldError, match="(?s)rank 1 ---.*ValueError: rank one refuses"):
        run_world(_fail_on_rank_one, 2)


@pytest.mark.world_size(2)
def test_harness_times_out_instead_of_hanging():
    with pytest.raises(WorldError, match="still running after 8s"):
        run_world(_sleep_on_rank_one, 2, timeout_s=8)
