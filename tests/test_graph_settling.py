"""`occult bench decode` times a static-cache step only after CUDA-graph trees stopped recording
(`benchmarks.graph_settling`): recordings are counted from torch's own callbacks, untimed pairs of calls run until one
records nothing (all ranks agreeing under EP), and the rows say what was recorded. The two GPU tests (`-m gpu`) check the
count against real CUDA-graph trees."""

import pytest
import torch
from torch._dynamo.callback import CallbackTrigger, callback_handler

from distributed import run_world
from occult_hf.benchmarks import decode
from occult_hf.benchmarks.graph_settling import MAX_SETTLING_PAIRS, counting_graph_recordings, settle

CPU = torch.device("cpu")


def _announce(trigger: CallbackTrigger) -> None:
    """What torch does around a CUDA-graph recording (or a compile): run the start callbacks."""
    with callback_handler.install_callbacks(trigger, "0/0"):
        pass


def test_recordings_are_counted_from_torchs_callbacks_and_only_inside():
    callbacks_before = len(callback_handler.start_callbacks)
    with counting_graph_recordings() as recorded:
        _announce(CallbackTrigger.CUDAGRAPH_RECORDING)
        _announce(CallbackTrigger.DYNAMO)  # a compile is not a recording
        _announce(CallbackTrigger.CUDAGRAPH_RECORDING)
    _announce(CallbackTrigger.CUDAGRAPH_RECORDING)
    assert recorded == [2]
    assert len(callback_handler.start_callbacks) == callbacks_before


@pytest.mark.parametrize("recording_calls, expected", [(0, (1, 0)), (3, (4, 3)), (100, (MAX_SETTLING_PAIRS, MAX_SETTLING_PAIRS))])
def test_settle_runs_pairs_until_one_records_nothing(recording_calls, expected):
    calls = []

    def pair():
        calls.append(1)
        if len(calls) <= recording_calls:
            _announce(CallbackTrigger.CUDAGRAPH_RECORDING)

    with counting_graph_recordings() as recorded:
        assert settle(pair, recorded, CPU) == expected
    assert len(calls) == expected[0]


def test_time_step_times_only_after_the_graphs_settled(monkeypatch):
    """A model whose 64-token calls record a graph in its first four calls (the compiling one and three more): three
    untimed pairs record, the fourth does not, and the timed pairs, in the same order, come after them."""
    calls = []

    def fake_generate(model, prompt_BS, tokens, cache):
        calls.append(tokens)
        if tokens == 64 and calls.count(64) <= 4:
            _announce(CallbackTrigger.CUDAGRAPH_RECORDING)

    monkeypatch.setattr(decode, "generate_greedy", fake_generate)
    timing = decode.time_step(None, torch.zeros(1, 4), 64, "static", repeats=2)
    assert (timing.settling_calls, timing.graphs_settling, timing.graphs_timed) == (4, 3, 0)
    assert calls == [64] + [1, 64] * 4 + [1, 64] * 2
    row = decode.DecodeRow("m", 1, "occult", "static", timing.ms_per_step, timing.first_call_s, None, 4, 3, 0)
    assert row.settling_note() == "m B=1 occult static: 3 CUDA graphs recorded in 4 untimed generate() pairs after the compiling call"
    assert decode.DecodeRow("m", 1, "stock", "static", 1.0, 1.0).settling_note() is None


def _ranks_settle(rank, world_size):
    """Rank 0 records in its first two pairs, rank 1 never: both make three calls, as lockstep decoding needs."""
    calls = []

    def pair():
        calls.append(1)
        if rank == 0 and len(calls) <= 2:
            _announce(CallbackTrigger.CUDAGRAPH_RECORDING)

    with counting_graph_recordings() as recorded:
        return settle(pair, recorded, CPU)


@pytest.mark.world_size(2)
def test_ranks_settle_together():
    assert run_world(_ranks_settle, 2, timeout_s=120) == [(3, 2), (3, 0)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_a_real_graph_trees_recordings_are_counted():
    """torch's CUDA-graph trees (`mode="reduce-overhead"`) announce each recording through the callback counted here:
    the first call warms up, the second records, the third replays; a parameter moved to new memory records again."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(16, 16).cuda()
    compiled = torch.compile(layer, mode="reduce-overhead")
    x = torch.randn(4, 16, device="cuda")
    with counting_graph_recordings() as recorded:
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            assert recorded == [1]
            layer.weight.data = layer.weight.data.clone()
            for _ in range(2):
                compiled(x)
    assert recorded == [2]


@pytest.mark.gpu
@needs_cuda
def test_a_static_step_is_timed_after_the_graphs_settled():
    """`time_step` on a tiny occult model's static-cache `generate()` (CUDA graphs): no graph recorded while timed."""
    from tiny_models import tiny_batch, tiny_model

    from occult_hf import OccultConfig, apply_occult

    torch._dynamo.reset()
    model = apply_occult(tiny_model("olmoe").cuda().eval(), OccultConfig(num_devices=1))
    timing = decode.time_step(model, tiny_batch(batch=1, seq=8, seed=0).cuda(), 8, "static", repeats=2)
    assert timing.graphs_timed == 0, timing
    assert timing.settling_calls < MAX_SETTLING_PAIRS and timing.ms_per_step > 0, timing
