"""`OccultCallback` with the real HF `Trainer` on a tiny OLMoE (E=16, k=4, D=4 logical devices).

- The N_d schedule: its values step by step, its validation.
- Under 2-rank gloo EP the logged numbers (reduced over ranks) and the drift check (profiles merged
  over ranks) equal one process on the concatenated batch with the same 2 logical devices.
- A short Trainer run on a learnable toy task (next token = current token + 1) with router pruning
  eased from no pruning (N_d=4) to N_d=1, MoE-only training and a drift check every 3 steps: the loss
  falls, the routers (and only MoE parameters) change, every logged CT is at most the logged N_d and
  ends at exactly 1, the removed router weight is 0 before pruning starts and positive after, drift
  numbers are logged and the recent profile and re-planned placement are written at each save.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import TrainerControl
from distributed import run_world
from tiny_models import tiny_batch, tiny_model

import occult_hf  # noqa: F401
from occult_hf.hf.callback import (
    RECENT_PROFILE_FILENAME,
    REPLANNED_PLACEMENT_FILENAME,
    DeviceLimitSchedule,
    OccultCallback,
)
from occult_hf.config import OccultConfig
from occult_hf.hf.apply import apply_occult, track_routing
from occult_hf.moe import OccultMoE
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile

SIZES = dict(num_experts=16, top_k=4)


def test_schedule_eases_from_start_to_target():
    schedule = DeviceLimitSchedule(start=4, target=1, steps=6)
    assert [schedule.at(step) for step in range(9)] == [4, 4, 3, 3, 2, 2, 1, 1, 1]
    assert [DeviceLimitSchedule(start=3, target=3, steps=4).at(s) for s in range(5)] == [3] * 5
    assert DeviceLimitSchedule(start=4, target=2, steps=0).at(0) == 2


def test_schedule_fraction_spans_the_runs_steps_epochs_included():
    """`python -m occult_hf.hf.finetune --num_train_epochs N` had no schedule: it took a fraction of `max_steps`
    (-1 there), and N_d dropped to its target at the first step. The fraction is now taken of the Trainer's
    `state.max_steps` when training begins."""
    pruned = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1))
    callback = OccultCallback(schedule_fraction=0.5)
    state = _State()
    state.max_steps = 12
    callback.on_train_begin(None, state, None, model=pruned)
    assert callback.schedule == DeviceLimitSchedule(start=4, target=1, steps=6)
    with pytest.raises(ValueError, match="schedule_steps or schedule_fraction, not both"):
        OccultCallback(schedule_steps=3, schedule_fraction=0.5)
    with pytest.raises(ValueError, match=r"schedule_fraction must be a number in \[0, 1\] or None, got 2"):
        OccultCallback(schedule_fraction=2)


def test_schedule_and_callback_validation():
    with pytest.raises(ValueError, match=r"start \(1\) must be >= target \(2\)"):
        DeviceLimitSchedule(start=1, target=2, steps=3)
    with pytest.raises(ValueError, match="N_d schedule target must be an integer >= 1, got 0"):
        DeviceLimitSchedule(start=2, target=0, steps=3)
    with pytest.raises(ValueError, match="steps must be an integer >= 0, got -1"):
        OccultCallback(schedule_steps=-1)
    with pytest.raises(ValueError, match="check_every must be an integer >= 0"):
        OccultCallback(check_every=1.5)
    with pytest.raises(ValueError, match=r"the placement method must be one of \[.*'refined'\], got 'best'"):
        OccultCallback(planner="best")
    # the drift check measures CT on the recent profile's top-k sample: without one it used to fail at the
    # first check with numpy's "unsupported operand type(s) for +: 'NoneType'"
    with pytest.raises(ValueError, match="OccultCallback sample_size must be an integer >= 1, got 0"):
        OccultCallback(sample_size=0)
    # the limits now, not at train() (a str was Python's "'>' not supported between instances of 'str' and 'int'")
    with pytest.raises(ValueError, match="OccultCallback target_devices_per_token must be an integer >= 1, got '2'"):
        OccultCallback(target_devices_per_token="2")
    with pytest.raises(ValueError, match="OccultCallback start_nodes_per_token must be an integer >= 1, got 0"):
        OccultCallback(start_nodes_per_token=0)
    with pytest.raises(ValueError, match=r"start_devices_per_token \(1\) must be >= target_devices_per_token \(2\)"):
        OccultCallback(start_devices_per_token=1, target_devices_per_token=2)
    with pytest.raises(ValueError, match=r"no option\(s\) \['max_load_ration'\]"):  # now, not at the first check
        OccultCallback(planner_options={"max_load_ration": 1.1})
    exact = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=4))
    callback = OccultCallback(target_devices_per_token=1)
    with pytest.raises(ValueError, match="got an N_d schedule but the model has no pruners"):
        callback.on_train_begin(None, _State(), None, model=exact)
    with pytest.raises(ValueError, match="found no OccultMoE blocks"):
        OccultCallback().on_train_begin(None, _State(), None, model=tiny_model("olmoe"))
    pruned = apply_occult(tiny_model("olmoe", **SIZES), OccultConfig(num_devices=4, prune="router", max_devices_per_token=2))
    with pytest.raises(ValueError, match=r"exceeds num_devices=4"):
        OccultCallback(start_devices_per_token=5).on_train_begin(None, _State(), None, model=pruned)
    track_routing(exact, False)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] do not keep it: call occult_hf.track_routing\(model\)"):
        OccultCallback().on_train_begin(None, _State(), None, model=exact)
    # LoRA on attention only with train_moe_only: nothing left to train (was torch's error at the first backward)
    peft = pytest.importorskip("peft")
    attention_only = peft.get_peft_model(pruned, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"train_moe_only=True\) left no parameter to train"):
        OccultCallback(train_moe_only=True).on_init_end(None, _State(), None, model=attention_only)


class _State:
    """The parts of `TrainerState` the callback reads."""

    def __init__(self, global_step: int = 0) -> None:
        self.global_step = global_step
        self.log_history = []
        self.is_world_process_zero = True


class NextTokenData(torch.utils.data.Dataset):
    """Sequences counting up from a random start: each token is the previous one plus one."""

    def __init__(self, size: int, seq: int = 16, vocab: int = 128) -> None:
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(3, vocab - seq, (size,), generator=generator)
        self.input_ids = starts[:, None] + torch.arange(seq)[None, :]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


def test_trainer_run_with_schedule_drift_and_moe_only_training(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = apply_occult(
        tiny_model("olmoe", **SIZES).train(), OccultConfig(num_devices=4, prune="router", max_devices_per_token=1)
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moe_names = {f"{path}.{name}" for path, m in model.named_modules() if isinstance(m, OccultMoE) for name, _ in m.named_parameters()}
    callback = OccultCallback(schedule_steps=6, train_moe_only=True, check_every=3, per_layer=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=2e-2,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_steps=6,
        save_only_model=True,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(96))
    callback.attach(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, 13))
    losses = [entry["loss"] for entry in logs]
    assert max(losses[-3:]) < 0.8 * losses[0], losses

    limits = [entry["occult/max_devices_per_token"] for entry in logs]
    assert limits == [4.0, 4.0, 3.0, 3.0, 2.0, 2.0] + [1.0] * 6
    for entry in logs:
        assert entry["occult/ct"] <= entry["occult/max_devices_per_token"] + 1e-9, entry
        for layer in (0, 1):
            assert entry[f"occult/ct/layer_{layer}"] <= entry["occult/max_devices_per_token"] + 1e-9
        assert entry["occult/ct/max"] == max(entry[f"occult/ct/layer_{layer}"] for layer in (0, 1))
        assert entry["occult/load_balance"] >= 1.0
        assert 0.0 <= entry["occult/remote_copies"] < entry["occult/ct"]
    assert logs[0]["occult/ct"] > 2.0 and logs[0]["occult/removed_weight"] == 0.0
    assert logs[-1]["occult/ct"] == 1.0 and logs[-1]["occult/removed_weight"] > 0.2

    drift_steps = [entry["step"] for entry in logs if "occult/drift/ct_current" in entry]
    assert drift_steps == [3, 6, 9, 12]
    for entry in logs:
        if "occult/drift/ct_current" in entry:
            assert 1.0 <= entry["occult/drift/ct_replanned"] <= 4.0 and 1.0 <= entry["occult/drift/ct_current"] <= 4.0

    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed and changed <= moe_names, sorted(changed - moe_names)
    assert any(name.endswith("mlp.gate.weight") for name in changed), "the routers must receive gradients"

    for step, limit in ((6, 2), (12, 1)):  # step 6 ran at N_d = 2 (logged above)
        checkpoint = tmp_path / f"checkpoint-{step}"
        profile = RoutingProfile.load(checkpoint / RECENT_PROFILE_FILENAME)
        assert profile.num_experts == 16 and sorted(profile.layers) == [0, 1]
        assert profile.layer(0).token_count == 3 * 8 * 16  # one window: 3 steps of 8 sequences x 16 tokens
        placement = Placement.load(checkpoint / REPLANNED_PLACEMENT_FILENAME)
        assert placement.num_devices == 4 and sorted(placement.layers) == [0, 1]
        assert os.path.isfile(checkpoint / "occult_placement.json")
        # the checkpoint records the N_d its step ran at, not the model's starting config
        assert json.loads((checkpoint / "config.json").read_text())["occult_config"]["max_devices_per_token"] == limit
    from transformers import AutoModelForCausalLM

    ids = NextTokenData(4).input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-12")
    assert torch.allclose(reloaded.eval()(ids).logits, model.eval()(ids).logits, atol=1e-5)


def test_drift_checks_at_every_save_by_default(tmp_path):
    """`check_every=0`: each save checks the window since the previous save and writes that window's profile."""
    from transformers import Trainer, TrainingArguments

    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(num_devices=4))
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=1, save_steps=2,
        save_only_model=True, report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(16))
    OccultCallback(sample_size=1024).attach(trainer)
    trainer.train()
    assert sum("occult/drift/ct_current" in entry for entry in trainer.state.log_history) == 2
    windows = [RoutingProfile.load(tmp_path / f"checkpoint-{step}" / RECENT_PROFILE_FILENAME).layer(0) for step in (2, 4)]
    assert [window.token_count for window in windows] == [2 * 4 * 16] * 2  # each: the 2 steps since the previous save
    assert not np.array_equal(windows[0].coactivation, windows[1].coactivation)  # two windows, not one saved twice


def _run_with_evaluations(tmp_path, eval_steps: int | None):
    """Four steps of router pruning (N_d=2) logged at step 4, evaluating 256 tokens every `eval_steps` (None: never):
    the Trainer's log history and the callback's last drift window."""
    from transformers import Trainer, TrainingArguments

    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(num_devices=4, prune="router", max_devices_per_token=2))
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=8, logging_steps=4,
        eval_strategy="no" if eval_steps is None else "steps", eval_steps=eval_steps, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callback = OccultCallback(check_every=4)
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(8), eval_dataset=NextTokenData(16))
    callback.attach(trainer)
    trainer.train()
    return trainer.state.log_history, callback.recent_profile


def test_evaluations_between_logs_change_no_training_number(tmp_path):
    """The routing numbers of a training log line are those of the training forwards since the previous one, whether
    or not the Trainer evaluated in between; an evaluation's log line carries none, and the drift window holds the
    training tokens only. An evaluation's line used to take the training numbers (leaving the next training line a
    part of them), the pruners counted the evaluation's tokens in `removed_weight`, and the drift profile held them."""
    plain, plain_window = _run_with_evaluations(tmp_path / "plain", None)
    evaluated, window = _run_with_evaluations(tmp_path / "evaluated", 1)
    occult = lambda entry: {k: v for k, v in entry.items() if k.startswith("occult/")}  # noqa: E731
    (expected,) = [occult(entry) for entry in plain if "loss" in entry]
    (logged,) = [occult(entry) for entry in evaluated if "loss" in entry]
    assert expected.keys() >= {"occult/ct", "occult/removed_weight", "occult/drift/ct_current"} and expected["occult/removed_weight"] > 0
    assert logged == pytest.approx(expected, rel=1e-12)
    evaluations = [entry for entry in evaluated if "eval_loss" in entry]
    assert len(evaluations) == 4 and not any(occult(entry) for entry in evaluations)
    assert window.meta["tokens"] == plain_window.meta["tokens"] == 4 * 2 * 16


def _logs_after_one_step(model, batches, check_every: int = 1) -> dict[str, float]:
    callback = OccultCallback(check_every=check_every, sample_size=1024)
    state, control = _State(), TrainerControl()
    callback.on_train_begin(None, state, control, model=model)
    for batch in batches:
        model(input_ids=batch, labels=batch).loss.backward()
    state.global_step = 1
    callback.on_step_end(None, state, control, model=model)
    logs = {}
    callback.on_log(None, state, control, logs=logs)
    callback.on_train_end(None, state, control, model=model)
    return logs


def _callback_under_ep(rank, world_size):
    import torch.distributed as dist

    config = OccultConfig(num_devices=world_size, prune="router", max_devices_per_token=1)
    batches = [tiny_batch(batch=2, seq=8, seed=30 + r) for r in range(world_size)]
    one_process = [dist.new_group([r]) for r in range(world_size)]
    reference = apply_occult(tiny_model("olmoe", **SIZES).train(), config, group=one_process[rank])
    # one forward of the concatenated batch: its token chunks are the ranks' tokens (metrics.token_ranks)
    expected = _logs_after_one_step(reference, [torch.cat(batches)])
    model = apply_occult(tiny_model("olmoe", **SIZES).train(), config)
    return expected, _logs_after_one_step(model, [batches[rank]])


@pytest.mark.world_size(2)
def test_logs_under_expert_parallelism_equal_one_process():
    for expected, logs in run_world(_callback_under_ep, 2):
        assert "occult/drift/ct_replanned" in expected and "occult/remote_copies" in expected
        assert sorted(logs) == sorted(expected)
        for key, value in expected.items():
            assert logs[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def _scheduled_training_under_ep(rank, world_size, output_dir, port):
    from transformers import Trainer, TrainingArguments

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(prune="router", max_devices_per_token=1))
    args = TrainingArguments(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=2, save_steps=1, save_only_model=True,
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(16))
    OccultCallback(start_devices_per_token=2, target_devices_per_token=1, schedule_steps=2).attach(trainer)
    trainer.train()


@pytest.mark.world_size(2)
def test_checkpoints_under_expert_parallelism_record_the_scheduled_limit(tmp_path):
    """Under EP the Trainer's rank 0 alone writes each checkpoint: the N_d it records must be recorded on every rank
    alike, or the next save's agreement check sees ranks that differ."""
    from distributed import free_port

    run_world(_scheduled_training_under_ep, 2, str(tmp_path), free_port())
    recorded = [
        json.loads((tmp_path / f"checkpoint-{step}" / "config.json").read_text())["occult_config"]["max_devices_per_token"]
        for step in (1, 2, 3, 4)
    ]
    assert recorded == [2, 2, 1, 1]


def test_logged_ct_is_the_ct_the_dispatch_served_under_load_aware_replicas():
    """With `replica_choice="load_aware"` a replicated expert's pairs go where the batch's counts send them, not
    where the static rule would: the logged CT must be the one the dispatch served (its rows, in dedup mode)."""
    num_experts, num_devices = SIZES["num_experts"], 4
    device_of_E = [e * num_devices // num_experts for e in range(num_experts)]
    replicas = {e: [(device_of_E[e] + 1) % num_devices, (device_of_E[e] + 2) % num_devices] for e in range(0, num_experts, 2)}
    placement = Placement(num_experts, num_devices, {0: device_of_E, 1: device_of_E}, {"method": "test"}, replicas={0: replicas, 1: replicas})
    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(placement=placement, replica_choice="load_aware"))
    batch = tiny_batch(batch=4, seq=16, seed=7)
    logs = _logs_after_one_step(model, [batch])
    blocks = [m for m in model.modules() if isinstance(m, OccultMoE)]
    served_ct = [float(block.stats.rows_sent.sum()) / batch.numel() for block in blocks]
    assert logs["occult/ct"] == pytest.approx(sum(served_ct) / len(served_ct), rel=1e-9)
    assert logs["occult/ct/max"] == pytest.approx(max(served_ct), rel=1e-9)


def test_drift_check_compares_the_placement_the_model_runs_copies_included(tmp_path):
    """The drift check's current CT and balance are those of the model's placement, its copies included: read
    from the primary homes alone they were another placement's (here a worse CT than the one the model serves)."""
    from transformers import Trainer, TrainingArguments

    from occult_hf.metrics import evaluate_placement

    num_experts, num_devices = SIZES["num_experts"], 4
    device_of_E = [e * num_devices // num_experts for e in range(num_experts)]
    replicas = {e: [(device_of_E[e] + 1) % num_devices, (device_of_E[e] + 2) % num_devices] for e in range(0, num_experts, 2)}
    placement = Placement(num_experts, num_devices, {0: device_of_E, 1: device_of_E}, {"method": "test"}, replicas={0: replicas, 1: replicas})
    model = apply_occult(tiny_model("olmoe", **SIZES).train(), OccultConfig(placement=placement))
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=2, save_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callback = OccultCallback(check_every=2)
    trainer = Trainer(model=model, args=args, train_dataset=NextTokenData(8))
    callback.attach(trainer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "occult/drift/ct_current" in entry][-1]
    metrics = evaluate_placement(callback.recent_profile, placement).values()
    assert logged["occult/drift/ct_current"] == pytest.approx(np.mean([m.ct for m in metrics]), rel=1e-9)
    assert logged["occult/drift/balance_current"] == pytest.approx(np.mean([m.balance for m in metrics]), rel=1e-9)
