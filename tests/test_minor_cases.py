"""The minor half of issue 33's probe that the input tables (test_strict_inputs.py, test_bad_inputs.py) do not hold:
errors that named neither the field nor the way out, a default that failed on itself, a misleading message."""

from __future__ import annotations

import re

import pytest
import torch

from tiny_models import tiny_batch, tiny_model


def test_the_triton_backend_on_cpu_names_the_setting_and_the_way_out(monkeypatch):
    from occult_hf import OccultConfig, apply_occult

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2, expert_backend="triton"))
    with pytest.raises(ValueError, match=re.escape("OccultConfig.expert_backend='triton' runs on CUDA, but the experts are on cpu: use expert_backend='auto'")):
        model(tiny_batch())


def test_a_dispatcher_that_cannot_serve_suggests_only_those_that_can():
    from occult_hf import OccultConfig, apply_occult

    with pytest.raises(ValueError) as error:
        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2, dispatcher="all_to_all"))(tiny_batch())
    assert "use 'auto' or one of ['local']" in str(error.value) and "'padded'" not in str(error.value)


def test_the_finetune_script_runs_at_its_defaults_in_one_process(tmp_path, monkeypatch):
    """Its default N_d (2) used to exceed the one device of a one-process run: `--max_devices_per_token` now
    defaults to 2, or the device count when fewer."""
    import datasets
    from transformers import AutoConfig

    from occult_hf.hf.finetune import main as finetune
    from tiny_models import save_tiny_tokenizer, tiny_checkpoint, tiny_sentences

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model_dir = save_tiny_tokenizer(tiny_checkpoint("olmoe", tmp_path / "model", seed=4, output_router_logits=False))
    datasets.Dataset.from_dict({"text": tiny_sentences(20, seed=1)}).to_json(tmp_path / "train.jsonl")
    out = tmp_path / "out"
    assert finetune(["--model_name_or_path", str(model_dir), "--train_file", str(tmp_path / "train.jsonl"), "--seq_len", "16",
                     "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "1",
                     "--output_dir", str(out)]) == 0  # fmt: skip
    saved = AutoConfig.from_pretrained(out).occult_config
    assert saved["prune"] == "router" and saved["max_devices_per_token"] == 1 and saved["num_devices"] == 1


def test_a_rank_file_missing_from_a_partial_checkpoint_is_not_called_another_layout(tmp_path, monkeypatch):
    import occult_hf.hf.trainer as trainer

    (tmp_path / "occult_rank0-of-2.pt").write_bytes(b"")
    monkeypatch.setattr(trainer, "_ep_rank_world", lambda model: (1, 2))
    monkeypatch.setattr(trainer, "_rank_file", lambda directory, model: str(tmp_path / "occult_rank1-of-2.pt"))
    with pytest.raises(FileNotFoundError) as error:
        trainer._read_rank_file(str(tmp_path), model=None)
    assert "holds ['occult_rank0-of-2.pt']: rank 1's save of it did not finish" in str(error.value), str(error.value)
    (tmp_path / "occult_rank0-of-2.pt").rename(tmp_path / "occult_rank0-of-4.pt")
    with pytest.raises(FileNotFoundError, match=re.escape("holds ['occult_rank0-of-4.pt'] (written by another EP layout)")):
        trainer._read_rank_file(str(tmp_path), model=None)
