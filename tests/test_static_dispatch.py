"""The static-capacity dispatchers (`occult_hf.dispatch.static`): no host read, same function as one process.

Two gloo ranks run "padded" (the real transport) and the packed layout that "symm_mem" uses, through
a stand-in for `all_to_all_vdev` that has its semantics (splits read from device memory, rows packed
by source, stale bytes past what peers sent), and compare the output, the input and routing-weight
gradients and the expert-weight gradients in fp32 with one process computing every expert on the
concatenation of both ranks' tokens. Cases stress: dedup and per_expert, E not divisible by D, a
token whose experts all sit on one device, a rank whose tokens never leave it, k = E.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_world

HIDDEN, WIDTH = 8, 6


def _reference(x_TH, ids_Tk, w_Tk, gate_up_E2IH, down_EHI):
    """out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t]), plain autograd."""
    gate, up = (torch.einsum("th,eih->tei", x_TH, gate_up_E2IH)).chunk(2, dim=-1)
    mlp_TEH = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down_EHI)
    picked_TkH = mlp_TEH.gather(1, ids_Tk[:, :, None].expand(-1, -1, x_TH.shape[1]))
    return (w_Tk[:, :, None] * picked_TkH).sum(1)


def _case(seed, num_tokens, num_experts, top_k, world):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, num_tokens, HIDDEN, generator=g)
    scores = torch.randn(world, num_tokens, num_experts, generator=g)
    ids = scores.topk(top_k, dim=-1).indices
    if num_tokens > 2:  # rank 0's first token: the lowest experts (device 0); rank 1's last: the highest
        ids[0, 0] = torch.arange(top_k)
        ids[1, -1] = num_experts - 1 - torch.arange(top_k)
    w = torch.rand(world, num_tokens, top_k, generator=g)
    gate_up = torch.randn(num_experts, 2 * WIDTH, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(num_experts, HIDDEN, WIDTH, generator=g) / WIDTH**0.5
    upstream = torch.randn(world, num_tokens, HIDDEN, generator=g)
    return x, ids, w, gate_up, down, upstream


def _vdev_like(dispatcher, block, counts_D, out_rows, agree=None):
    """What `all_to_all_vdev` does, over gloo: split sizes from device memory, rows packed by source,
    the rest of the receive buffer stale (NaN bytes)."""
    recv_counts = torch.empty_like(counts_D)
    dist.all_to_all_single(recv_counts, counts_D, group=dispatcher.ep.group)
    send, recv = counts_D.tolist(), recv_counts.tolist()
    out = torch.full((out_rows, block.shape[1]), 0xFF, dtype=torch.uint8, device=block.device)
    received = torch.empty(sum(recv), block.shape[1], dtype=torch.uint8, device=block.device)
    dist.all_to_all_single(received, block[: sum(send)].contiguous(), recv, send, group=dispatcher.ep.group)
    out[: sum(recv)] = received
    return out, recv_counts


def _world(rank, world, cases, device="cpu"):
    from occult_hf.dispatch import DispatchSettings, ExpertParallelGroup, TokenRouting, build_dispatcher
    from occult_hf.dispatch import static
    from occult_hf.kernels import expert_mlp_reference
    from occult_hf.placement import Placement

    class PackedStandIn(static.StaticDispatcher):  # "symm_mem"'s layout, testable on gloo
        name = ""
        row_layout = "packed"
        exchange = _vdev_like

    ep = ExpertParallelGroup.resolve(num_devices=world)
    errors = []
    for name, mode, seed, num_tokens, num_experts, top_k in cases:
        x, ids, w, gate_up, down, upstream = (t.to(device) for t in _case(seed, num_tokens, num_experts, top_k, world))
        placement = Placement.contiguous(num_experts, world, [0])
        mine = torch.tensor(placement.experts_on(0, rank), device=x.device)
        if name == "packed":
            dispatcher = PackedStandIn(ep, placement.layout(0, rank), DispatchSettings(mode=mode))
        else:
            dispatcher = build_dispatcher(DispatchSettings(name, mode=mode), ep, placement.layout(0, rank), device=x.device)
        gate_up_L = gate_up[mine].clone().requires_grad_()
        down_L = down[mine].clone().requires_grad_()
        x_r = x[rank].clone().requires_grad_()
        w_r = w[rank].clone().requires_grad_()

        def experts(x_RH, segments, pair_weight_N):
            return expert_mlp_reference(x_RH, segments, pair_weight_N, gate_up_L, down_L)

        out, _ = dispatcher.run(x_r, TokenRouting(ids[rank], w_r), experts)
        out.backward(upstream[rank])

        x_all = x.reshape(-1, HIDDEN).clone().requires_grad_()
        w_all = w.reshape(-1, top_k).clone().requires_grad_()
        gate_up_ref, down_ref = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
        ref = _reference(x_all, ids.reshape(-1, top_k), w_all, gate_up_ref, down_ref)
        ref.backward(upstream.reshape(-1, HIDDEN))
        span = slice(rank * num_tokens, (rank + 1) * num_tokens)
        checks = {
            "out": (out, ref[span]),
            "grad x": (x_r.grad, x_all.grad[span]),
            "grad w": (w_r.grad, w_all.grad[span]),
            "grad gate_up": (gate_up_L.grad, gate_up_ref.grad[mine]),
            "grad down": (down_L.grad, down_ref.grad[mine]),
        }
        for what, (got, want) in checks.items():
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                errors.append(f"{name}/{mode}/seed {seed}: {what} differs by {(got - want).abs().max().item():.3g}")
    return errors


CASES = [
    # dispatcher, mode, seed, T, E, k
    ("padded", "dedup", 0, 7, 6, 2),
    ("padded", "per_expert", 1, 5, 5, 3),  # E not divisible by D
    ("packed", "dedup", 2, 7, 6, 2),
    ("packed", "per_expert", 3, 6, 5, 3),
    ("packed", "dedup", 4, 4, 4, 4),  # k = E: every token reaches every device
    ("padded", "dedup", 5, 1, 8, 2),  # decode: one token per rank
    ("packed", "dedup", 6, 1, 8, 2),
]


@pytest.mark.world_size(2)
def test_static_dispatchers_match_one_process():
    errors = run_world(_world, 2, CASES)
    assert errors == [[], []]


def test_static_pairs_put_invalid_entries_past_the_last_segment():
    from occult_hf.dispatch.static import _static_pairs

    slot_RW = torch.tensor([[1, -1], [-1, -1], [0, 1]], dtype=torch.int32)
    segments, pick_N = _static_pairs(slot_RW, num_local_experts=2)
    assert segments.expert_offsets.tolist() == [0, 1, 3]
    assert segments.pair_row[:3].tolist() == [2, 0, 2]
    assert (segments.pair_row[3:] == 3).all()  # rows of invalid entries: R, outside every row's range
    assert pick_N[:3].tolist() == [4, 0, 5]


def test_symm_mem_is_registered_but_not_offered_without_nvshmem():
    from occult_hf.dispatch import ExpertParallelGroup, dispatcher_names
    from occult_hf.dispatch.static import SymmMemDispatcher

    assert {"symm_mem", "padded"} <= set(dispatcher_names())
    if not torch.cuda.is_available():
        assert not SymmMemDispatcher.supports(ExpertParallelGroup(num_devices=2, group=object(), rank=0), "cpu")


def test_auto_takes_padded_where_its_padding_is_cheap():
    """`dispatcher="auto"` under torch.distributed: "padded" where the padding estimated from the placement (uniform
    routing) is at most 25% and nothing else rules it out, else "all_to_all"; the estimate of CT is exact."""
    from itertools import combinations

    from occult_hf.dispatch import PADDED_MAX_OVERHEAD, AutoHints, ExpertParallelGroup, dispatcher_class
    from occult_hf.dispatch.auto import expected_devices_per_token

    held = [3, 2, 1]  # E=6 on 3 devices, unevenly: CT against every 2-expert choice counted
    device_of_E = [d for d, n in enumerate(held) for _ in range(n)]
    choices = list(combinations(range(6), 2))
    counted = sum(len({device_of_E[e] for e in pair}) for pair in choices) / len(choices)
    assert expected_devices_per_token(held, 2) == pytest.approx(counted)

    olmoe = lambda devices, **kw: AutoHints(tuple(e * devices // 64 for e in range(64)), 8, "dedup", **kw)  # noqa: E731
    assert olmoe(2).padding_overhead(2) == pytest.approx(2 / 1.9952 - 1, abs=1e-4)  # 0.2%
    assert olmoe(8).padding_overhead(8) > PADDED_MAX_OVERHEAD  # 47%
    ep = lambda devices, host=object(): ExpertParallelGroup(num_devices=devices, group=object(), host_group=host)  # noqa: E731
    assert dispatcher_class("auto", ep(2), "cpu", olmoe(2)).name == "padded"
    assert dispatcher_class("auto", ep(4), "cuda", olmoe(4)).name == "padded"  # 9%
    ruled_out = [
        (8, olmoe(8)),  # too much padding
        (2, AutoHints(olmoe(2).device_of_E, 8, "per_expert")),  # a slot of T * k rows per device
        (2, olmoe(2, chunks=3)),  # the overlap of chunks is "all_to_all"'s
        (2, olmoe(2, pruned=True)),  # pruning sends fewer rows, a fixed slot would not
        (2, olmoe(2, expert_backend="torch")),  # its grouped GEMM path on CUDA reads the empty pairs
        (2, None),  # no hints: by priority
    ]
    for devices, hints in ruled_out:
        assert dispatcher_class("auto", ep(devices), "cuda", hints).name == "all_to_all", hints
    assert dispatcher_class("auto", ep(2, host=None), "cuda", olmoe(2)).name == "all_to_all"  # T could not be agreed
    assert dispatcher_class("auto", ep(2), "cpu", olmoe(2, expert_backend="torch")).name == "padded"  # the CPU reference
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and the number of experts"):
        expected_devices_per_token([4, 4], 9)


def _training_block_world(rank, world):
    """An EP block of a model with top-4 of 8 experts (padding 1.4% at D=2), the ranks holding different token
    counts: "auto" takes "padded", whose forward and backward read nothing on the host and equal "all_to_all"'s;
    "all_to_all" reads its counts (so the guard can fail)."""
    from host_reads import no_host_reads
    from tiny_models import tiny_model

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    results, computed = {}, {}
    for dispatcher in ("auto", "all_to_all"):
        model = apply_occult(tiny_model("olmoe", seed=4, top_k=4).train(), OccultConfig(dispatcher=dispatcher))
        block = next(iter(occult_modules(model).values()))
        generator = torch.Generator().manual_seed(rank)
        hidden = torch.randn(2, 7 + 3 * rank, model.config.hidden_size, generator=generator, requires_grad=True)
        out = block(hidden)
        out.square().sum().backward()
        computed[dispatcher] = (out.detach(), hidden.grad.clone(), block.experts.gate_up_proj.grad.clone())
        try:
            with no_host_reads(f"the {block.dispatcher.name} block"):
                block(hidden).square().sum().backward()
            read = None
        except AssertionError as error:
            read = str(error)
            torch.distributed.barrier()  # the peer may still be inside its exchange: both end the step alike
        results[dispatcher] = (block.dispatcher.name, read)
    results["equal"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(computed["auto"], computed["all_to_all"]))
    return results


@pytest.mark.world_size(2)
def test_auto_training_step_under_ep_reads_nothing_on_the_host():
    for results in run_world(_training_block_world, 2):
        assert results["auto"] == ("padded", None) and results["equal"]
        name, read = results["all_to_all"]
        assert name == "all_to_all" and read is not None and "read a tensor on the host" in read


@pytest.mark.gpu
@pytest.mark.world_size(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a 2-rank NCCL world")
def test_static_dispatchers_under_nccl_match_one_process():
    """The cases above on 2 GPUs under NCCL, fp32, within 1e-5: "symm_mem" (NVSHMEM `all_to_all_vdev`, where this
    torch build has it), "padded" and the packed stand-in."""
    cases = list(CASES) + [(c[0].replace("packed", "padded"), *c[1:]) for c in CASES if c[0] == "packed"]
    from occult_hf.dispatch.static import nvshmem_usable

    if nvshmem_usable():
        cases += [("symm_mem", *c[1:]) for c in CASES]
    errors = run_world(_world, 2, cases, "cuda", backend="nccl")
    assert errors == [[], []]
