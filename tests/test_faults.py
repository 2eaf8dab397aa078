"""Fault injection: ranks that disagree, peers that stall or die, saves that are interrupted.

One 2-rank gloo world (every wait on a peer bounded by a 3 s `OCCULT_SAVE_TIMEOUT_S`,
`OCCULT_JOIN_TIMEOUT_S` and `OCCULT_EXCHANGE_TIMEOUT_S`, the world by `run_world`'s timeout) and an
in-process save test:

- a placement, dispatch mode, pruning setting, dtype or model config that differs between the ranks: a
  clear error on both ranks at `apply_occult` naming the field (the layers whose placement differs, the
  model-config keys that differ); a rank that fails its own checks there: its error, and on the other
  rank an error naming it, at once;
- ranks that cast the model to different dtypes after `apply_occult`: an `ExchangeError` on both at the first
  layer's count exchange, naming the two row formats;
- a peer that raises and stays alive while the other saves, and a peer that stops after the
  configuration check of a save and goes on to a barrier: an error naming the operation and the
  layer within the timeout, not after the process group's 30 minutes; a peer that stops after the
  first layer's gather of `unapply_occult` or its copies of `apply_replicas`: the same error, the other rank's
  model left as it was; the same two faults while the
  other rank is in a forward: the EP exchange's `ExchangeError` naming the layer; a peer that skips the backward
  under "padded": the same, from the padded row exchange;
- ranks at different collective operations (`save_pretrained` and `unapply_occult`), and a rank whose own checks
  fail at `apply_replicas`: an error on both at once, naming the operations or the failed rank's error;
- a peer killed in the middle of a forward: the other rank fails within seconds;
- a save interrupted while writing each of its files, or killed outright: the previous checkpoint is
  byte-for-byte unchanged, loads, and equals the original model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from distributed import WorldError, run_world
from tiny_models import tiny_batch, tiny_model

TIMEOUT_ENV = {"OCCULT_SAVE_TIMEOUT_S": "3", "OCCULT_EXCHANGE_TIMEOUT_S": "3", "OCCULT_JOIN_TIMEOUT_S": "3"}


def _shuffled(num_experts=8, num_devices=2, layers=(0, 1), seed=0):
    import numpy as np

    from occult_hf import Placement

    base = (np.arange(num_experts) * num_devices // num_experts).tolist()
    maps = {layer: np.random.default_rng(seed + layer).permutation(base).tolist() for layer in layers}
    return Placement(num_experts, num_devices, maps, {"method": "shuffled"})


# ----- one 2-rank world: disagreement, stalled peers, a dead peer -------------------------------------


def _expect_mismatch(rank, config_of_rank, model_of_rank, *words):
    from occult_hf.distributed.agreement import EPConfigMismatchError
    from occult_hf.hf.apply import apply_occult

    with pytest.raises(EPConfigMismatchError) as error:
        apply_occult(model_of_rank(rank), config_of_rank(rank))
    message = str(error.value)
    for word in words:
        assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def _mismatch_cases(rank):
    from occult_hf import OccultConfig, Placement

    olmoe = lambda r: tiny_model("olmoe", seed=1)  # noqa: E731
    placements = [Placement.contiguous(8, 2, [0, 1]), _shuffled()]
    _expect_mismatch(rank, lambda r: OccultConfig(placement=placements[r]), olmoe,
                     "disagree at apply_occult on placement (expert -> device maps differ at layers [0, 1])")
    slack = [Placement(8, 2, placements[0].layers, replicas={0: {0: [1]}}, pin_slack={0: s}) for s in (0.5, 0.0)]
    _expect_mismatch(rank, lambda r: OccultConfig(placement=slack[r], replica_choice="load_aware"), olmoe,
                     "disagree at apply_occult on placement (pin_slack differ)")  # was "replicas or slots differ"
    _expect_mismatch(rank, lambda r: OccultConfig(dispatch=("dedup", "per_expert")[r]), olmoe,
                     "dispatch (rank 0 'dedup', rank 1 'per_expert')")
    _expect_mismatch(rank, lambda r: OccultConfig(prune=(None, "router")[r], max_devices_per_token=(None, 1)[r]), olmoe,
                     "max_devices_per_token (rank 0 None, rank 1 1)", "prune (rank 0 None, rank 1 'router')")
    _expect_mismatch(rank, lambda r: OccultConfig(), lambda r: olmoe(r).to((torch.float32, torch.float64)[r]),
                     "dtype (rank 0 'torch.float32', rank 1 'torch.float64')")
    # model configs that differ: another intermediate size or norm_topk_prob gave silently different logits,
    # another k a timeout in the first forward, another hidden size an abort inside gloo
    other = lambda **kw: lambda r: tiny_model("olmoe", seed=1, **(kw if r == 1 else {}))  # noqa: E731
    _expect_mismatch(rank, lambda r: OccultConfig(), other(intermediate_size=48, norm_topk_prob=True),
                     "the model config (intermediate_size: rank 0 64, rank 1 48; norm_topk_prob: rank 0 False, rank 1 True)")
    _expect_mismatch(rank, lambda r: OccultConfig(), other(top_k=3), "num_experts_per_tok: rank 0 2, rank 1 3")
    _expect_mismatch(rank, lambda r: OccultConfig(), other(hidden_size=48), "hidden_size: rank 0 32, rank 1 48")

    # one rank fails its own checks (a placement for 4 devices, a misspelt config key): it raises its error, and
    # the other, instead of waiting for it at the agreement for the process group's timeout (30 min), names it
    from occult_hf.distributed.agreement import EPConfigMismatchError
    from occult_hf.hf.apply import apply_occult

    for bad_config, error in (
        (OccultConfig(placement=Placement.contiguous(8, 4, [0, 1])), "placement is for num_devices=4 but the expert-parallel group has 2"),
        ({"dispatch_mode": "dedup"}, "OccultConfig got unknown keys ['dispatch_mode']"),
    ):
        start = time.monotonic()
        expected = (EPConfigMismatchError, "rank 1 of the expert-parallel group failed at apply_occult") if rank == 0 else (ValueError, "")
        with pytest.raises(expected[0], match=expected[1]) as raised:
            apply_occult(olmoe(rank), (OccultConfig(), bad_config)[rank])
        assert error in str(raised.value) and time.monotonic() - start < 30, (rank, str(raised.value))


def _stalled_peer_cases(rank, directory):
    import torch.distributed as dist

    from occult_hf import OccultConfig
    from occult_hf.distributed.agreement import EPPeerError
    from occult_hf.hf.state import state_of
    from occult_hf.hf.checkpointing import check_model_ranks_agree
    from occult_hf.hf.apply import apply_occult

    def rank0_saves(seed, name, error_pattern, rank1_does):
        model = apply_occult(tiny_model("olmoe", seed=seed), OccultConfig(placement=_shuffled(seed=seed)))
        start = time.monotonic()
        if rank == 0:
            with pytest.raises(EPPeerError, match=error_pattern):
                model.save_pretrained(Path(directory) / name)
            assert time.monotonic() - start < 30, name
        else:
            rank1_does(model)
        dist.barrier()

    def raise_and_carry_on(model):
        try:
            raise RuntimeError("rank 1: bad batch")  # the user's code catches it and carries on
        except RuntimeError:
            pass

    # a peer that raises, catches it and stays alive: the saving rank fails within the timeout
    rank0_saves(2, "raised", r"save_pretrained on rank 0: EP ranks \[1\] did not reach it within 3 s \(OCCULT_JOIN_TIMEOUT_S\)",
                raise_and_carry_on)
    # a peer that stops early (after the save's configuration check) and calls a barrier
    rank0_saves(3, "stopped", r"gathering the experts \(save_pretrained/unapply_occult\) of layer 0 failed on rank 0",
                lambda model: check_model_ranks_agree(model, state_of(model), "save_pretrained"))
    assert not (Path(directory) / "stopped" / "config.json").exists()

    # a peer that stops after the first layer's gather of `unapply_occult`: the other rank's model stays whole (it
    # restored layer 0's block before it found that layer 1's gather failed)
    from occult_hf.hf.apply import occult_config_of, unapply_occult
    from occult_hf.hf.checkpointing import gather_full_experts

    model = apply_occult(tiny_model("olmoe", seed=6), OccultConfig(placement=_shuffled(seed=6)))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if rank == 0:
        with pytest.raises(EPPeerError, match=r"gathering the experts \(save_pretrained/unapply_occult\) of layer 1 failed"):
            unapply_occult(model)
        blocks = {path: type(model.get_submodule(path)).__name__ for path in ("model.layers.0.mlp", "model.layers.1.mlp")}
        assert blocks == dict.fromkeys(blocks, "OccultMoE"), blocks
        held_aside = model.get_submodule("model.layers.0.mlp").original_block.experts  # filled by the gather, emptied again
        assert all(param.numel() == 0 for param in held_aside.parameters())
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    else:
        check_model_ranks_agree(model, state_of(model), "unapply_occult")
        gather_full_experts(model.get_submodule("model.layers.0.mlp"), state_of(model), to_all=True)
    dist.barrier()

    # the same at `apply_replicas`, after the first layer's copies: an error naming it (not the process group's 30
    # minutes), and the other rank's model as it was (it had rebuilt layer 0 before layer 1's copies hung). On an EP
    # group of its own: the copies travel on it, and a timed-out one leaves it unusable
    from dataclasses import replace

    from occult_hf.hf.rehome import apply_replicas, new_homes

    deployed = _shuffled(seed=7)
    replanned = replace(deployed, replicas={layer: {5: [1 - deployed.device_of(layer)[5]]} for layer in (0, 1)})
    model = apply_occult(tiny_model("olmoe", seed=7), OccultConfig(placement=deployed), group=dist.new_group([0, 1]))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if rank == 0:
        with pytest.raises(EPPeerError, match=r"copying the replicated experts .*\(apply_replicas\) of layer 1 failed"):
            apply_replicas(model, replanned)
        assert occult_config_of(model).placement == deployed
        assert model.get_submodule("model.layers.0.mlp").layout.num_replicated == 0
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    else:
        new_state = replace(state_of(model), occult_config=replace(state_of(model).occult_config, placement=replanned))
        check_model_ranks_agree(model, new_state, "apply_replicas")
        new_homes(model.get_submodule("model.layers.0.mlp"), replanned)
    dist.barrier()

    # the shared padded gather (PEFT adapters, saves) is bounded the same way
    from occult_hf.distributed.collectives import gather_rows

    group = dist.new_group([0, 1])
    if rank == 0:
        with pytest.raises(EPPeerError, match="expert adapters of layer 3 failed on rank 0: an EP peer did not join"):
            gather_rows(torch.ones(2, 3), 0, [2, 1], group, to_all=True, what="gathering the expert adapters of layer 3")
    dist.barrier()


def _stalled_exchange_cases(rank):
    """The same two faults in the middle of a forward: the EP exchange's own bound (OCCULT_EXCHANGE_TIMEOUT_S).

    Each case runs on a fresh EP group: a timed-out exchange leaves its group unusable.
    """
    import torch.distributed as dist

    from occult_hf import OccultConfig
    from occult_hf.dispatch.all_to_all import ExchangeError
    from occult_hf.hf.apply import apply_occult

    for case in ("raises and stays alive", "stops early and calls a barrier"):
        model = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(placement=_shuffled()), group=dist.new_group([0, 1]))
        start = time.monotonic()
        if rank == 0:
            with pytest.raises(ExchangeError, match=r"layer 0: the .* did not finish within 3 s"):
                model(tiny_batch(seed=0))
            assert time.monotonic() - start < 30, case
        elif case == "raises and stays alive":
            try:
                raise RuntimeError("rank 1: bad batch")
            except RuntimeError:
                time.sleep(6)  # alive, busy elsewhere, never joins the forward
        dist.barrier()  # "stops early": rank 1 is here while rank 0 is in its forward
    # "padded" on CPU: its row exchanges wait with the same bound; rank 1 runs the forward and skips the backward
    model = apply_occult(
        tiny_model("olmoe", seed=4), OccultConfig(placement=_shuffled(), dispatcher="padded"), group=dist.new_group([0, 1])
    )
    loss = model(tiny_batch(seed=rank), labels=tiny_batch(seed=rank)).loss
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(ExchangeError, match=r"layer 1: the padded exchange failed or did not finish within 3 s"):
            loss.backward()
        assert time.monotonic() - start < 30
    else:
        time.sleep(6)  # alive, never joins the backward
    dist.barrier()


def _cast_apart_cases(rank):
    """Ranks that cast the model apart after `apply_occult`: both raise at the first layer's count exchange, naming
    the two row formats, before any row moves (the same row size, bfloat16 against float16, read the other's rows
    in the wrong dtype before; different row sizes crashed gloo); cast alike again, the same group runs on. In the
    flat exchange with one chunk and with two (another count message), and in "padded" (its agreement on the
    static capacities carries the formats)."""
    import torch.distributed as dist

    from occult_hf import OccultConfig
    from occult_hf.dispatch.all_to_all import ExchangeError
    from occult_hf.hf.apply import apply_occult

    hidden = tiny_model("olmoe").config.hidden_size
    group = dist.new_group([0, 1])
    for settings in ({"dispatch_chunks": 1}, {"dispatch_chunks": 2}, {"dispatcher": "padded"}):
        model = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(placement=_shuffled(), **settings), group=group)
        for dtypes in ((torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)):
            model.to(dtypes[rank])
            mine, other = (str(dtype).removeprefix("torch.") for dtype in (dtypes[rank], dtypes[1 - rank]))
            with pytest.raises(ExchangeError, match=(
                rf"layer 0: EP rank {1 - rank} sends rows of format \[{other} x {hidden}, int32 x \d+, {other} x \d+\] .* "
                rf"and this rank \[{mine} x {hidden}, .*different dtypes"
            )):  # fmt: skip
                model(tiny_batch(seed=rank))
        model.to(torch.bfloat16)
        assert model(tiny_batch(seed=rank)).logits.dtype == torch.bfloat16, settings


def _different_operation_cases(rank):
    """Ranks at different collective operations, or one that fails its own checks before the agreement of
    `apply_replicas`: both raise at once, naming the operations or the failed rank's error. Before, the first
    paired up their gathers wrongly and both waited out the save timeout with an error naming neither
    operation; in the second the healthy rank waited out the join timeout and said its peer "did not reach" it."""
    from occult_hf import OccultConfig, Placement
    from occult_hf.distributed.agreement import EPConfigMismatchError
    from occult_hf.hf.apply import apply_occult, unapply_occult
    from occult_hf.hf.rehome import apply_replicas

    model = apply_occult(tiny_model("olmoe", seed=5), OccultConfig(placement=_shuffled()))
    operations = ("save_pretrained", "unapply_occult")
    with pytest.raises(EPConfigMismatchError, match=(
        f"rank {rank} is at {operations[rank]} while EP rank {1 - rank} is at {operations[1 - rank]}: every rank"
    )):  # fmt: skip
        model.save_pretrained("/nonexistent/never-written") if rank == 0 else unapply_occult(model)
    placement = _shuffled()
    other_primaries = Placement(8, 2, {layer: [1 - d for d in placement.device_of(layer)] for layer in (0, 1)})
    if rank == 1:
        with pytest.raises(ValueError, match=r"the primary homes of layers \[0, 1\] differ"):
            apply_replicas(model, other_primaries)
    else:
        with pytest.raises(EPConfigMismatchError, match=r"rank 1 of the expert-parallel group failed at apply_replicas \(ValueError: apply_replicas: the primary homes"):
            apply_replicas(model, placement)
    assert model(tiny_batch(seed=rank)).logits.isfinite().all()  # both ranks go on with the same model


def _killed_peer_case(rank, report_file):
    """Last: rank 1 dies (exit code 17) between two MoE layers of a forward; rank 0 must fail fast."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(placement=_shuffled()))
    ids = tiny_batch(seed=rank)
    model(ids)  # one good forward on both ranks
    if rank == 1:
        block = model.get_submodule("model.layers.1.mlp")
        block.register_forward_pre_hook(lambda *_: os._exit(17))  # dies between layer 0 and layer 1
    start = time.monotonic()
    try:
        model(ids)
    except Exception as error:  # noqa: BLE001 - what the surviving rank sees is the point
        Path(report_file).write_text(f"{time.monotonic() - start:.1f}s {type(error).__name__}: {error}")
        raise
    raise AssertionError(f"rank {rank}: the forward with a dead peer returned")


def _fault_world(rank, world_size, directory):
    from occult_hf.hf.apply import install

    install()
    _mismatch_cases(rank)
    _cast_apart_cases(rank)
    _stalled_peer_cases(rank, directory)
    _stalled_exchange_cases(rank)
    _different_operation_cases(rank)
    _killed_peer_case(rank, os.path.join(directory, "rank0.txt"))


@pytest.mark.world_size(2)
def test_disagreeing_stalled_and_dead_peers_fail_clearly(tmp_path):
    """One world for every case (a world start costs more than all the checks); it ends with rank 1's death,
    so every earlier check passed on rank 1 if it exited with code 17 and on rank 0 if it wrote its report."""
    with pytest.raises(WorldError) as error:
        run_world(_fault_world, 2, str(tmp_path), env=TIMEOUT_ENV, timeout_s=300)
    message = str(error.value)
    assert "--- rank 1 ---\nprocess exited with code 17" in message, message[-4000:]
    report = (tmp_path / "rank0.txt").read_text()  # what rank 0 saw when its peer died mid-forward
    assert float(report.split("s ", 1)[0]) < 30, report


# ----- interrupted saves (one process: the writing rank) ------------------------------------------


def _tree_digest(directory: Path) -> dict[str, str]:
    """File name -> content digest; a directory (a staging directory left behind) as "directory"."""
    return {p.name: "directory" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _fail_on(monkeypatch, target: str):
    """Make the writer of one file of a save raise, as a full disk or a killed writer would."""
    import transformers
    from transformers import modeling_utils

    from occult_hf.placement import Placement

    def boom(*args, **kwargs):
        raise OSError(f"injected failure writing {target}")

    if target == "model.safetensors":
        monkeypatch.setattr(modeling_utils, "safe_save_file", boom)
    elif target == "config.json":
        monkeypatch.setattr(transformers.PretrainedConfig, "save_pretrained", boom)
    elif target == "generation_config.json":
        monkeypatch.setattr(transformers.GenerationConfig, "save_pretrained", boom)
    elif target == "occult_placement.json":
        monkeypatch.setattr(Placement, "save", boom)
    elif target == "rename of config.json":
        import occult_hf.hf.checkpointing as checkpointing

        real = os.replace

        def replace(source, destination):
            if os.path.basename(destination) == "config.json":
                raise OSError("injected failure renaming config.json")
            return real(source, destination)

        monkeypatch.setattr(checkpointing.os, "replace", replace)


def _killed_while_saving(rank, world_size, directory):
    """A one-rank world whose save is killed outright (os._exit) half way through writing the weights."""
    from transformers import modeling_utils

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, install

    def die(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"half a file")
        os._exit(9)

    install()
    model = apply_occult(tiny_model("olmoe", seed=6), OccultConfig(placement=_shuffled(num_devices=4, seed=9)))
    modeling_utils.safe_save_file = die
    model.save_pretrained(directory)


def test_interrupted_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, install, occult_config_of

    install()
    ids = tiny_batch(seed=1)
    original = apply_occult(tiny_model("olmoe", seed=5), OccultConfig(placement=_shuffled(num_devices=2)))
    original.save_pretrained(tmp_path)
    before, expected = _tree_digest(tmp_path), original(ids).logits

    changed = apply_occult(tiny_model("olmoe", seed=6), OccultConfig(placement=_shuffled(num_devices=4, seed=9)))
    for target in ("occult_placement.json", "model.safetensors", "config.json", "generation_config.json"):
        with monkeypatch.context() as patch:
            _fail_on(patch, target)
            with pytest.raises(OSError, match=f"injected failure writing {target}"):
                changed.save_pretrained(tmp_path)
        assert _tree_digest(tmp_path) == before, target  # not one byte changed, no staging directory left
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert occult_config_of(reloaded).placement == occult_config_of(original).placement
    assert torch.allclose(reloaded(ids).logits, expected, rtol=1e-6, atol=1e-7)

    # Killed outright while writing: the previous checkpoint is unchanged, and the staging directory is left
    with pytest.raises(WorldError, match="process exited with code 9"):
        run_world(_killed_while_saving, 1, str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in before)
    assert len(left) == 1 and left[0].startswith(".occult_save-"), left
    assert {name: digest for name, digest in _tree_digest(tmp_path).items() if name != left[0]} == before
    shutil.rmtree(tmp_path / left[0])

    # Interrupted among the renames (placement and weights new, config old): every file is whole, but they come
    # from two saves, and the load is refused (`occult_publishing.json`) until a save completes.
    with monkeypatch.context() as patch:
        _fail_on(patch, "rename of config.json")
        with pytest.raises(OSError, match="injected failure renaming config.json"):
            changed.save_pretrained(tmp_path)
    assert set(_tree_digest(tmp_path)) == set(before) | {"occult_publishing.json"}
    with pytest.raises(RuntimeError, match="stopped while it replaced the files of the earlier save"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    changed.save_pretrained(tmp_path)
    assert occult_config_of(AutoModelForCausalLM.from_pretrained(tmp_path)).placement == occult_config_of(changed).placement
