"""The paths a Hugging Face user takes, end to end (issue 13).

- `OccultConfig` serialises like transformers' own configs and sits on the HF config as JSON-native
  data: `from_pretrained(saved_dir, occult_config=OccultConfig(...))` through the Auto class works
  with transformers' info logging on (it used to fail JSON-dumping the object in the "Model config"
  log line), and the loaded model's config dumps and saves.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tiny_models import tiny_batch, tiny_model


@pytest.fixture
def info_logging():
    """transformers' verbosity at INFO for the test (its config loading logs the whole config)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    yield
    hf_logging.set_verbosity(before)


def test_occult_config_serialises_like_hf_configs():
    from occult_hf import OccultConfig, Placement

    placement = Placement.contiguous(num_experts=8, num_devices=2, layers=range(16))
    config = OccultConfig(placement=placement, prune="router", max_devices_per_token=1)
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data  # JSON-native
    assert data["placement"]["layers"]["15"] == placement.device_of(15)
    assert OccultConfig.from_dict(data) == config and dict(config) == data
    assert json.loads(config.to_json_string()) == data
    assert json.loads(config.to_json_string(use_diff=True)) == {
        "placement": placement.to_dict(), "prune": "router", "max_devices_per_token": 1,
    }  # fmt: skip
    text = repr(config)
    assert text.startswith("OccultConfig {") and "num_experts=8 num_devices=2 layers=16 [0..15]" in text
    assert len(text) < 400  # a summary, not 16 x 8 device ids


def test_from_pretrained_with_an_occult_config_object_and_info_logging(tmp_path, info_logging):
    from transformers import AutoConfig, AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult, occult_config_of

    saved = tmp_path / "saved"
    apply_occult(tiny_model("olmoe", seed=2), OccultConfig(num_devices=2)).save_pretrained(saved)
    wanted = OccultConfig(num_devices=4, prune="router", max_devices_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(saved, occult_config=wanted)
    assert occult_config_of(model).num_devices == 4 and occult_config_of(model).max_devices_per_token == 2
    assert isinstance(model.config.occult_config, dict)
    assert json.loads(model.config.to_json_string())["occult_config"]["num_devices"] == 4
    model.save_pretrained(tmp_path / "again")
    assert AutoConfig.from_pretrained(tmp_path / "again").occult_config["prune"] == "router"
    with torch.no_grad():
        assert torch.isfinite(model(tiny_batch()).logits).all()


# ----- Trainer under expert parallelism: checkpoints in any callback order, resume ---------------------
RESUME_STEPS, SAVE_STEPS = 4, 2


def _trainer_args(output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=RESUME_STEPS, learning_rate=0.01,
        lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="steps", save_steps=SAVE_STEPS,
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip  (AdamW and a linear schedule: resuming must restore both)


def _ep_model(world_size: int, contiguous: bool = False):
    from occult_hf import OccultConfig, Placement, apply_occult

    layers = {0: [1, 0, 0, 1, 1, 0, 1, 0], 1: [0, 1, 1, 0, 0, 1, 0, 1]}  # not contiguous: slots != expert ids
    placement = Placement.contiguous(8, world_size, [0, 1]) if contiguous else Placement(8, world_size, layers)
    return apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), OccultConfig(placement=placement))


def _losses(trainer) -> dict[int, float]:
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def _resume_world(rank, world_size, root):
    """Run 1: OccultCallback put first with `attach` (it used to skip the expert snapshot, so rank 0's save
    waited for a gather no rank joined), 4 steps, checkpoint at step 2. Run 2: no callback, resumed from
    that checkpoint. Returns run 2's losses and weights against run 1's."""
    import os

    from transformers import Trainer

    from occult_hf import OccultCallback

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29517",
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=2 * world_size * RESUME_STEPS, seq=16, seed=5)]
    full_model = _ep_model(world_size)
    callback = OccultCallback()
    trainer = Trainer(model=full_model, args=_trainer_args(f"{root}/full"), train_dataset=data, callbacks=[callback])
    callback.attach(trainer)
    trainer.train()
    resumed_model = _ep_model(world_size)
    resumed = Trainer(model=resumed_model, args=_trainer_args(f"{root}/resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{root}/full/checkpoint-{SAVE_STEPS}")
    other = Trainer(model=_ep_model(world_size, contiguous=True), args=_trainer_args(f"{root}/other"), train_dataset=data)
    try:  # another placement: its experts' weights and optimizer state would load into other experts' slots
        other.train(resume_from_checkpoint=f"{root}/full/checkpoint-{SAVE_STEPS}")
        other_placement = "no error"
    except ValueError as error:
        other_placement = str(error)
    full_weights = dict(full_model.named_parameters())
    weight_errors = {  # (the grad-norm carriers' values are never read: only their gradients are)
        name: float((param.detach() - full_weights[name].detach()).abs().max())
        for name, param in resumed_model.named_parameters() if not name.endswith("ep_grad_norm_carrier")
    }
    return {"full": _losses(trainer), "resumed": _losses(resumed), "weight_errors": weight_errors, "other_placement": other_placement}


@pytest.mark.world_size(2)
def test_trainer_checkpoints_with_attach_and_resume_equals_uninterrupted_run(tmp_path):
    from transformers import AutoModelForCausalLM

    from distributed import run_world

    reports = run_world(_resume_world, 2, str(tmp_path), env={"OCCULT_SAVE_TIMEOUT_S": "30"}, timeout_s=400)
    for rank, report in enumerate(reports):
        full, resumed = report["full"], report["resumed"]
        assert sorted(full) == sorted(resumed) == list(range(1, RESUME_STEPS + 1)), (rank, report)  # 1-2 restored
        for step in (3, 4):
            assert resumed[step] == pytest.approx(full[step], rel=1e-6), (rank, step, full, resumed)
        worst = max(report["weight_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-6, (rank, worst)
        assert "was written with another placement: at model.layers.0.mlp this rank held experts" in report["other_placement"], report
    # the checkpoints are vanilla: plain transformers loads all 8 experts of every layer
    for directory in (tmp_path / "full" / f"checkpoint-{SAVE_STEPS}", tmp_path / "resumed" / f"checkpoint-{RESUME_STEPS}"):
        model = AutoModelForCausalLM.from_pretrained(directory, occult_config=None)
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8


def test_a_model_whose_saved_keys_transformers_renames_resumes(tmp_path):
    """Mixtral's checkpoints name its routers `block_sparse_moe.gate` (transformers reverts its renaming on save): the
    resume hook reads them under the model's own names (it had refused the checkpoint, naming `mlp.gate` as missing)
    and the resumed steps and weights equal the uninterrupted run's (one process, 2 logical devices)."""
    from transformers import Trainer

    from occult_hf import OccultConfig, apply_occult

    def model():
        return apply_occult(tiny_model("mixtral", seed=11, output_router_logits=False), OccultConfig(num_devices=2))

    data = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=2 * RESUME_STEPS, seq=16, seed=5)]
    full_model, resumed_model = model(), model()
    full = Trainer(model=full_model, args=_trainer_args(f"{tmp_path}/full"), train_dataset=data)
    full.train()
    resumed = Trainer(model=resumed_model, args=_trainer_args(f"{tmp_path}/resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{tmp_path}/full/checkpoint-{SAVE_STEPS}")
    for step in (3, 4):
        assert _losses(resumed)[step] == pytest.approx(_losses(full)[step], rel=1e-6), step
    full_weights = dict(full_model.named_parameters())
    for name, param in resumed_model.named_parameters():
        assert torch.equal(param, full_weights[name]), name


def test_load_best_model_at_end_restores_the_best_checkpoint_experts_included(tmp_path):
    """`load_best_model_at_end`: the model ends with the best checkpoint's weights, experts included (transformers
    reads the saved, per-expert expert keys under their saved names and leaves the experts at their last values)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from occult_hf import OccultConfig, apply_occult

    model = apply_occult(tiny_model("olmoe", seed=11, output_router_logits=False), OccultConfig(num_devices=2))
    rows = [{"input_ids": row, "labels": row} for row in tiny_batch(batch=8, seq=16, seed=5)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=0.3, optim="sgd",
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=False, report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip  (a large step: the later weights differ from the best's)
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=[rows[0]])
    trainer.train()
    best = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint, occult_config=OccultConfig(num_devices=2))
    assert trainer.state.best_model_checkpoint != f"{tmp_path}/checkpoint-4"
    best_weights = dict(best.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, best_weights[name]), name


# ----- the fine-tune entry point (HfArgumentParser, datasets, launcher checks) ---------------------------


def test_finetune_entry_point_parses_trainer_flags_and_checks_data_and_launch(tmp_path, monkeypatch, capsys):
    import datasets
    from transformers import AutoConfig

    from occult_hf.hf.finetune import main as finetune
    from tiny_models import save_tiny_tokenizer, tiny_checkpoint, tiny_sentences

    model_dir = save_tiny_tokenizer(tiny_checkpoint("olmoe", tmp_path / "model", seed=4, output_router_logits=False))
    datasets.Dataset.from_dict({"body": tiny_sentences(40, seed=1)}).to_parquet(tmp_path / "train.parquet")
    common = ["--model_name_or_path", str(model_dir), "--train_file", str(tmp_path / "train.parquet"),
              "--text_column", "body", "--seq_len", "16", "--per_device_train_batch_size", "2", "--use_cpu",
              "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "2", "--save_steps", "1",
              "--learning-rate", "1e-3", "--check_every", "0"]  # fmt: skip
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    refusals = [  # one line each, exit code 2 (they were tracebacks of 12-78 lines)
        (["--num_devices", "2"], r"num_devices=2 but this launch runs 1 process.*--logical_devices"),
        (["--num_devices", "2", "--logical_devices", "--seq_len", "100000"], r"holds \d+ tokens, shorter than one sequence of --seq_len 100000"),
        (["--max_devices_per_token", "0"], r"--max_devices_per_token must be an integer >= 1, got 0"),  # was taken as 2
        (["--seq_len", "0"], r"--seq_len must be an integer >= 1, got 0"),  # was "range\(\) arg 3 must not be zero"
    ]  # fmt: skip
    capsys.readouterr()
    for flags, message in refusals:
        assert finetune([*common, "--output_dir", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("occult_hf.hf.finetune: error: "), err
        assert re.search(message, err[0]), err
    missing = ["--model_name_or_path", str(tmp_path / "no_model"), *common[2:], "--output_dir", str(tmp_path / "x")]
    assert finetune(missing) == 2 and "model directory does not exist" in capsys.readouterr().err  # not the Hub's retries
    out = tmp_path / "out"
    assert finetune([*common, "--output_dir", str(out), "--num_devices", "2", "--logical_devices",
                     "--max_devices_per_token", "1"]) == 0  # fmt: skip
    saved = AutoConfig.from_pretrained(out).occult_config
    assert saved["num_devices"] == 2 and saved["prune"] == "router" and saved["max_devices_per_token"] == 1
    assert (out / "checkpoint-2" / "occult_rank0-of-1.pt").is_file() and (out / "tokenizer.json").is_file()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher started 2 processes, but no process group exists
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2: .*torch.distributed is not initialised"):
        from occult_hf import OccultConfig, apply_occult

        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
