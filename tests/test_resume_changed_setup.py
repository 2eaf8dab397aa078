"""`Trainer.train(resume_from_checkpoint=...)` when the occult setup of the resuming run differs from the saving one.

A checkpoint holds each rank's experts and Adam moments slot by slot (`occult_rank{r}-of-{D}.pt`). A resume whose
slots hold other experts than the save's would apply the moments of expert A to expert B, silently. So for each
change (placement, replicas, `num_devices`, pruning on/off or N_d, `dispatch`) the resume must either carry every
expert's weights and moments to that expert (checked per original expert id, right before the first resumed step,
against the saving run's state after its last step) and continue as an uninterrupted run under the new setup would,
or fail with an error naming the difference.

In one process (logical devices) the experts sit in id order whatever the setup, so every change resumes. On 2 gloo
ranks each rank holds its placement's experts: the same setup resumes exactly (losses, weights, moments), and so do
dispatch and pruning changes for each expert; a placement that moves experts is refused on every rank, replicas added
on one rank are refused on every rank, naming the rank whose slots changed.
"""

from __future__ import annotations

import pytest
import torch

from distributed import free_port, run_world
from tiny_models import tiny_batch, tiny_model

STEPS, SAVE_STEPS = 4, 2
ALTERNATING = {0: [0, 1, 0, 1, 0, 1, 0, 1], 1: [1, 0, 1, 0, 1, 0, 1, 0]}
SWAPPED = {0: [1, 0, 1, 0, 1, 0, 1, 0], 1: [0, 1, 0, 1, 0, 1, 0, 1]}


def _config(setup: str):
    """The named occult setup; "saved" is the one every checkpoint here is written with."""
    from occult_hf import OccultConfig, Placement

    alternating = Placement(8, 2, ALTERNATING)
    return {
        "saved": OccultConfig(placement=alternating),
        "saved with replicas": OccultConfig(placement=Placement(8, 2, ALTERNATING, {}, replicas={0: {0: [1]}})),
        "swapped placement": OccultConfig(placement=Placement(8, 2, SWAPPED)),
        "replicas added": OccultConfig(placement=Placement(8, 2, ALTERNATING, {}, replicas={0: {0: [1]}, 1: {3: [1]}})),
        "4 devices": OccultConfig(num_devices=4),
        "router pruning, N_d=1": OccultConfig(placement=alternating, prune="router", max_devices_per_token=1),
        "per_expert dispatch": OccultConfig(placement=alternating, dispatch="per_expert"),
    }[setup]


def _recorder(after_step: int | None = None):
    """A `TrainerCallback` recording this rank's experts (`_expert_moments`): after step `after_step` ends (what a
    checkpoint there saves) or, without one, before the first step (what a resume loaded); read it as `.state`."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        state = None

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            if after_step is not None and state.global_step == after_step:
                self.state = _expert_moments(model, optimizer)

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if after_step is None and self.state is None:
                self.state = _expert_moments(model, optimizer)

    return Recorder()


def _expert_moments(model, optimizer) -> dict[tuple, dict[str, torch.Tensor]]:
    """`{(layer, parameter, expert id): {"weight", "exp_avg", "exp_avg_sq"}}` of this rank's primary slots."""
    from occult_hf.moe import OccultMoE

    recorded = {}
    for path, module in model.named_modules():
        if not isinstance(module, OccultMoE):
            continue
        experts = module.local_experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            moments = optimizer.state[param]
            for slot, expert in enumerate(experts.expert_ids.tolist()):
                recorded.setdefault((path, name, expert), {  # a replica slot after its primary is the same expert
                    "weight": param[slot].detach().clone(),
                    "exp_avg": moments["exp_avg"][slot].clone(),
                    "exp_avg_sq": moments["exp_avg_sq"][slot].clone(),
                })  # fmt: skip
    return recorded


def _trainer(output_dir: str, setup: str, world_size: int = 1, recorder=None, port: int | None = None):
    """The Trainer of a run under `setup`: in one process, or on this rank of `run_world`'s `world_size` ranks."""
    import os

    from transformers import Trainer, TrainingArguments

    from occult_hf import apply_occult

    if world_size > 1:
        rank = os.environ["OCCULT_TEST_RANK"]
        os.environ.update(
            RANK=rank, WORLD_SIZE=str(world_size), LOCAL_RANK=rank, LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=0.01, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_STEPS, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), _config(setup))
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=2 * world_size * STEPS, seq=16, seed=5)]
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[recorder] if recorder else None)


def _losses(trainer) -> dict[int, float]:
    """The losses of the steps after the save (a resumed run's history begins with the checkpoint's)."""
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > SAVE_STEPS}


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in trainer.model.named_parameters()}


def _assert_same_experts(loaded: dict, saved: dict) -> None:
    """Every expert's weight and moments after the resume are that same expert's at the save, bit for bit."""
    assert loaded.keys() == saved.keys()
    mixed = [key for key in saved if any(not torch.equal(loaded[key][k], saved[key][k]) for k in saved[key])]
    assert not mixed, f"experts whose weight or Adam moments are not their own after the resume: {mixed[:4]}"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The uninterrupted run of the saved setup (checkpoint-2 beside it) and its experts' state after step 2."""
    from occult_hf.hf.apply import install

    install()
    output_dir = tmp_path_factory.mktemp("resume") / "saved"
    recorder = _recorder(after_step=SAVE_STEPS)
    trainer = _trainer(str(output_dir), "saved", recorder=recorder)
    trainer.train()
    return {"checkpoint": str(output_dir / f"checkpoint-{SAVE_STEPS}"), "trainer": trainer, "at_save": recorder.state}


def _resume(tmp_path, setup: str, checkpoint: str, world_size: int = 1, port: int | None = None):
    recorder = _recorder()
    trainer = _trainer(str(tmp_path / "resumed"), setup, world_size, recorder, port)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer, recorder.state


def test_same_setup_resumes_as_the_uninterrupted_run(saved_run, tmp_path):
    resumed, loaded = _resume(tmp_path, "saved", saved_run["checkpoint"])
    _assert_same_experts(loaded, saved_run["at_save"])
    uninterrupted = saved_run["trainer"]
    assert _losses(resumed) == _losses(uninterrupted)
    final, expected = _weights(resumed), _weights(uninterrupted)
    assert all(torch.equal(final[name], expected[name]) for name in expected)


@pytest.mark.parametrize("setup", ["swapped placement", "replicas added", "4 devices", "per_expert dispatch"])
def test_an_exact_setup_changed_in_one_process_resumes_as_its_uninterrupted_run(saved_run, tmp_path, setup):
    """Exact setups compute the same function; in one process the experts keep their id order under any of them, so
    the resume under the new setup continues as the new setup's uninterrupted run (to float summation order)."""
    resumed, loaded = _resume(tmp_path, setup, saved_run["checkpoint"])
    _assert_same_experts(loaded, saved_run["at_save"])
    uninterrupted = _trainer(str(tmp_path / "uninterrupted"), setup)
    uninterrupted.train()
    expected_losses = _losses(uninterrupted)
    assert _losses(resumed) == pytest.approx(expected_losses, rel=1e-5)
    final, expected = _weights(resumed), _weights(uninterrupted)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_pruning_turned_on_resumes_every_expert_with_its_own_moments(saved_run, tmp_path):
    """Pruning changes the function, so there is no uninterrupted run to equal: each expert must still resume its own
    weight and moments, and the steps after the resume are the pruned setup's (not the exact run's)."""
    resumed, loaded = _resume(tmp_path, "router pruning, N_d=1", saved_run["checkpoint"])
    _assert_same_experts(loaded, saved_run["at_save"])
    exact = _losses(saved_run["trainer"])
    assert _losses(resumed).keys() == exact.keys() and _losses(resumed) != exact


def test_pruning_turned_off_resumes_every_expert_with_its_own_moments(tmp_path):
    from occult_hf.hf.apply import install

    install()
    recorder = _recorder(after_step=SAVE_STEPS)
    _trainer(str(tmp_path / "pruned"), "router pruning, N_d=1", recorder=recorder).train()
    _, loaded = _resume(tmp_path, "saved", str(tmp_path / "pruned" / f"checkpoint-{SAVE_STEPS}"))
    _assert_same_experts(loaded, recorder.state)


@pytest.mark.world_size(2)
def test_a_one_process_resume_of_a_checkpoint_of_2_ep_ranks_names_the_layout(tmp_path):
    """2 logical devices in one process are not the 2 EP ranks that wrote the checkpoint: each rank file holds half
    the experts."""
    run_world(_saved_on_ranks, 2, str(tmp_path), "saved", free_port(), env=ENV, timeout_s=200)
    with pytest.raises(FileNotFoundError, match=r"no occult_rank0-of-1.pt for EP rank 0 of 1; the checkpoint holds "
                       r"\['occult_rank0-of-2.pt', 'occult_rank1-of-2.pt'\] \(written by another EP layout\)"):
        _resume(tmp_path, "saved", str(tmp_path / "saved" / f"checkpoint-{SAVE_STEPS}"))


# ----- 2 gloo ranks ---------------------------------------------------------------------------------------

ENV = {"OCCULT_SAVE_TIMEOUT_S": "20", "OCCULT_EXCHANGE_TIMEOUT_S": "20"}


def _saved_on_ranks(rank, world_size, directory, setup, port):
    """The uninterrupted run of `setup` on this rank (checkpoint-2 beside it): its losses and experts after step 2."""
    from occult_hf.hf.apply import install

    install()
    recorder = _recorder(after_step=SAVE_STEPS)
    trainer = _trainer(f"{directory}/saved", setup, world_size, recorder, port)
    trainer.train()
    return _by_file({"losses": _losses(trainer), "weights": _weights(trainer), "at_save": recorder.state}, directory)


def _resumed_on_ranks(rank, world_size, directory, setups, port):
    """This rank's resume of the saved checkpoint-2 under each setup in turn: its losses, weights and the experts it
    loaded, or the error it raised."""
    import pathlib

    from occult_hf.hf.apply import install

    install()
    checkpoint = f"{directory}/saved/checkpoint-{SAVE_STEPS}"
    reports = {}
    for setup in setups:
        try:
            trainer, loaded = _resume(pathlib.Path(directory) / setup, setup, checkpoint, world_size, port)
        except Exception as error:  # noqa: BLE001 - the error each rank raises is the point
            reports[setup] = {"error": f"{type(error).__name__}: {error}"}
        else:
            reports[setup] = {"losses": _losses(trainer), "weights": _weights(trainer), "loaded": loaded}
    return _by_file(reports, directory)


def _by_file(report: dict, directory: str) -> str:
    """`report` saved to a file of this rank, whose path travels back: tensors through `run_world`'s queue travel
    as file descriptors, which a rank that has exited no longer serves."""
    import os
    import uuid

    path = f"{directory}/report-rank{os.environ['OCCULT_TEST_RANK']}-{uuid.uuid4().hex}.pt"
    torch.save(report, path)
    return path


def _reports(paths: list[str]) -> list[dict]:
    return [torch.load(path, weights_only=True) for path in paths]


@pytest.mark.world_size(2)
def test_on_2_ranks_the_same_setup_resumes_exactly_and_moved_experts_are_refused(tmp_path):
    saved = _reports(run_world(_saved_on_ranks, 2, str(tmp_path), "saved", free_port(), env=ENV, timeout_s=200))
    setups = ["saved", "per_expert dispatch", "router pruning, N_d=1", "swapped placement"]
    resumed = _reports(run_world(_resumed_on_ranks, 2, str(tmp_path), setups, free_port(), env=ENV, timeout_s=400))
    for rank in range(2):
        same, at_save = resumed[rank]["saved"], saved[rank]["at_save"]
        assert "error" not in same, same
        _assert_same_experts(same["loaded"], at_save)
        assert same["losses"] == saved[rank]["losses"]
        carriers = "ep_grad_norm_carrier"  # runtime state: an identity tap, its value reaches no output
        assert all(torch.equal(same["weights"][n], w) for n, w in saved[rank]["weights"].items() if carriers not in n)
        for setup in ("per_expert dispatch", "router pruning, N_d=1"):  # the same experts in the same slots
            assert "error" not in resumed[rank][setup], resumed[rank][setup]
            _assert_same_experts(resumed[rank][setup]["loaded"], at_save)
        swapped = resumed[rank]["swapped placement"]
        assert "ValueError" in swapped.get("error", "") and "was written with another placement" in swapped["error"]
        assert f"this rank held experts {[0, 2, 4, 6] if rank == 0 else [1, 3, 5, 7]}" in swapped["error"], swapped


@pytest.fixture(scope="module")
def replicas_added_on_ranks(tmp_path_factory):
    """Each rank's resume, under replicas of rank 0's experts on rank 1, of a checkpoint saved without replicas: rank
    1's slots change, rank 0's experts stay where they were."""
    directory = str(tmp_path_factory.mktemp("replicas"))
    run_world(_saved_on_ranks, 2, directory, "saved", free_port(), env=ENV, timeout_s=200)
    resumed = run_world(_resumed_on_ranks, 2, directory, ["replicas added"], free_port(), env=ENV, timeout_s=200)
    return [report["replicas added"] for report in _reports(resumed)]


@pytest.mark.world_size(2)
def test_on_2_ranks_replicas_added_are_refused_by_the_rank_whose_slots_changed(replicas_added_on_ranks):
    error = replicas_added_on_ranks[1].get("error", "")
    assert "was written with another placement: at model.layers.0.mlp this rank held experts [1, 3, 5, 7] and now " \
        "holds [0, 1, 3, 5, 7]" in error, error


@pytest.mark.world_size(2)
def test_on_2_ranks_replicas_added_are_refused_on_every_rank(replicas_added_on_ranks):
    """Rank 0, whose slots did not change, went on into training and died at the first exchange on gloo's
    "Connection closed by peer", naming neither the placement nor rank 1: the ranks now meet after their checks."""
    error = replicas_added_on_ranks[0].get("error", "")
    assert "rank 1 of the expert-parallel group failed at resume_from_checkpoint" in error, error
    assert "was written with another placement" in error, error
