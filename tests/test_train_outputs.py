"""`occult train`'s outputs and inputs on disk: a finished run in `--out` is kept unless `--overwrite` says otherwise,
the final files are published so that a crash never leaves a new model beside an old log, and prepared token streams
(`data/*.npy`, `data.json`) that are damaged or not integer ids in the vocabulary are refused, naming the file."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from corpus_files import write_corpus
from occult_hf.training import PreparedData, get_recipe, prepare_data, train
from occult_hf.training.data import RECORD_SEPARATOR

#: a smaller run than the tiny recipe's, for `train` called from Python
TINY = dict(max_steps=1, batch_size=2, seq_len=32, warmup_steps=1)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Data prepared with the tiny recipe's settings, so that `occult train --data-dir` reuses it."""
    root = tmp_path_factory.mktemp("train_outputs")
    recipe = get_recipe("tiny")
    corpus = write_corpus(root / "corpus", docs=40, lines=(20, 30))  # 2 held-out documents: > 128 tokens
    return prepare_data(corpus, root / "data", vocab_size=recipe.vocab_size, heldout_fraction=recipe.heldout_fraction,
                        max_chars_per_domain=recipe.max_chars_per_domain, separator=RECORD_SEPARATOR,
                        cache_dir=root / "hf_cache")  # fmt: skip


def _finished_run(out: Path, steps: int = 3, final_loss: float = 7.593) -> Path:
    """A directory holding what a finished `occult train` leaves (its weights stand in as bytes)."""
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"the earlier model")
    (out / "train_log.json").write_text(json.dumps({"steps": steps, "final_loss": final_loss}))
    return out


def _exit_message(argv: list[str], capsys) -> str:
    from occult_hf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ----- a finished run in --out ------------------------------------------------------------------------------------
def test_occult_train_refuses_an_out_that_holds_a_finished_run(tmp_path, capsys, monkeypatch):
    import occult_hf.training

    out = _finished_run(tmp_path / "run")
    monkeypatch.setattr(occult_hf.training, "train", lambda *a, **k: pytest.fail("trained over a finished run"))
    err = _exit_message(["train", "--out", str(out), "--max-steps", "1"], capsys)
    assert err == (f"occult train: --out {str(out)!r} holds a finished run (train_log.json: steps 3, final loss 7.593); "
                   f"give --overwrite to replace it, or another --out")  # fmt: skip
    assert (out / "model.safetensors").read_bytes() == b"the earlier model"


def test_occult_train_names_a_finished_run_whose_log_cannot_be_read(tmp_path, capsys):
    out = _finished_run(tmp_path / "run")
    (out / "train_log.json").write_text('{"steps": 3, "final')
    err = _exit_message(["train", "--out", str(out)], capsys)
    assert f"--out {str(out)!r} holds a finished run (train_log.json, not readable:" in err and "give --overwrite" in err


def test_occult_train_prepare_only_and_overwrite_go_past_a_finished_run(prepared, tmp_path, monkeypatch):
    """`--prepare-only` leaves the model alone, so a finished run does not stop it; `--overwrite` trains anew."""
    import occult_hf.training
    from occult_hf.cli import main

    out = _finished_run(tmp_path / "run")
    shutil.copytree(prepared, out / "data")
    assert main(["train", "--out", str(out), "--prepare-only"]) == 0
    trained = []
    log = dict.fromkeys(("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity", "parameters"))
    monkeypatch.setattr(occult_hf.training, "train", lambda recipe, data_dir, out: trained.append(out) or log)
    assert main(["train", "--out", str(out), "--overwrite"]) == 0
    assert trained == [str(out)]


def test_occult_train_replaces_a_finished_run_with_overwrite(prepared, tmp_path, capsys):
    from occult_hf.cli import main

    torch.set_num_threads(1)
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(prepared), "--out", str(out), "--max-steps", "1", "--no-progress"]
    assert main([*argv, "--seed", "1"]) == 0
    first = (out / "model.safetensors").read_bytes()
    err = _exit_message([*argv, "--seed", "2"], capsys)
    assert "holds a finished run (train_log.json: steps 1, final loss" in err
    assert main([*argv, "--seed", "2", "--overwrite"]) == 0
    assert json.loads((out / "train_log.json").read_text())["recipe"]["seed"] == 2
    assert (out / "model.safetensors").read_bytes() != first


@pytest.mark.parametrize("crash_in", ["save_pretrained", "plot_loss_curve"])
def test_a_crash_while_publishing_leaves_no_train_log(prepared, tmp_path, monkeypatch, crash_in):
    """`train_log.json` marks a finished run: the earlier run's goes before the new model is written and the new one
    comes last, so a crash part-way never leaves a new model (or none) beside a log."""
    from transformers import OlmoeForCausalLM

    train_module = importlib.import_module("occult_hf.training.train")  # the package's `train` is the function

    def crash(*args, **kwargs):
        raise RuntimeError("crashed")

    if crash_in == "save_pretrained":
        monkeypatch.setattr(OlmoeForCausalLM, "save_pretrained", crash)
    else:
        monkeypatch.setattr(train_module, "plot_loss_curve", crash)
    out = _finished_run(tmp_path / "run")
    with pytest.raises(RuntimeError, match="crashed"):
        train(get_recipe("tiny", **TINY), prepared, out, eval_tokens=64, progress=False)
    assert not (out / "train_log.json").exists()


def test_a_crash_while_training_keeps_the_finished_run(prepared, tmp_path):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("crashed")

    out = _finished_run(tmp_path / "run")
    with pytest.raises(RuntimeError, match="crashed"):
        train(get_recipe("tiny", **TINY), prepared, out, eval_tokens=64, progress=False, trainer_callbacks=[Crash()])
    assert json.loads((out / "train_log.json").read_text())["steps"] == 3
    assert (out / "model.safetensors").read_bytes() == b"the earlier model"


# ----- damaged prepared data ------------------------------------------------------------------------------------
def _damaged(prepared: Path, tmp_path: Path, damage) -> tuple[Path, Path]:
    """A copy of the prepared data with `damage(path of train_python_docs.npy)` done to it; (the copy, that path)."""
    data = Path(shutil.copytree(prepared, tmp_path / "data"))
    stream = data / "train_python_docs.npy"
    damage(stream)
    return data, stream


def _rewrite(transform):
    return lambda path: np.save(path, transform(np.load(path)))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _set(index: int, value: int):
    def change(ids):
        ids = ids.astype(np.int64)
        ids[index] = value
        return ids

    return _rewrite(change)


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (_rewrite(lambda ids: ids.astype(np.float32) + 0.9), ValueError, "holds float32 values, not integer token ids"),
        (_rewrite(lambda ids: ids.astype(bool)), ValueError, "holds bool values, not integer token ids"),
        (_set(5, -3), ValueError, "holds token id -3, outside [0, {vocab}) (the vocabulary in data.json)"),
        (_set(7, 10**6), ValueError, "holds token id 1000000, outside [0, {vocab}) (the vocabulary in data.json)"),
        (_rewrite(lambda ids: ids[: len(ids) // 2 * 2].reshape(-1, 2)), ValueError, "is a 2-D array of shape"),
        (_rewrite(lambda ids: ids[:-5]), ValueError, "holds {short} token ids; data.json records {tokens}"),
        (_truncate, ValueError, "is not a readable .npy file"),
        (Path.unlink, FileNotFoundError, "does not exist"),
    ],
    ids=["float", "bool", "negative", "above_vocab", "2d", "short", "truncated", "missing"],
)
def test_a_damaged_token_stream_is_refused_naming_the_file(prepared, tmp_path, damage, error, message):
    data_dir, stream = _damaged(prepared, tmp_path, damage)
    data = PreparedData(data_dir)
    tokens = data.meta["domains"]["python_docs"]["train"]["tokens"]
    expected = message.format(vocab=data.meta["vocab_size"], tokens=tokens, short=tokens - 5)
    with pytest.raises(error, match=re.escape(f"prepared token stream {str(stream)!r} ") + ".*" + re.escape(expected)):
        data.stream("train", "python_docs")


def test_occult_train_names_a_token_stream_of_floats(prepared, tmp_path, capsys):
    """Floats were truncated to ids and trained on to exit code 0."""
    data_dir, stream = _damaged(prepared, tmp_path, _rewrite(lambda ids: ids.astype(np.float64) + 0.9))
    err = _exit_message(["train", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"), "--max-steps", "1"], capsys)
    assert f"prepared token stream {str(stream)!r} holds float64 values, not integer token ids" in err


@pytest.mark.parametrize(
    "meta, message",
    [
        ([1], " is not a JSON object (it holds a list)"),
        ({"format": "occult_hf.training_data/1", "vocab_size": "300", "domains": {}}, ": vocab_size '300' is not a positive integer"),
        ({"format": "occult_hf.training_data/1", "vocab_size": 300, "domains": ["a"]}, ": domains is not a JSON object"),
    ],
    ids=["list", "vocab_size", "domains"],
)
def test_a_data_json_of_another_shape_is_refused_naming_it(tmp_path, meta, message):
    (tmp_path / "data.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(f"prepared data {str(tmp_path / 'data.json')!r}{message}")):
        PreparedData(tmp_path)


def test_a_data_json_without_a_token_count_is_named(prepared, tmp_path):
    data_dir, stream = _damaged(prepared, tmp_path, lambda path: None)
    meta = json.loads((data_dir / "data.json").read_text())
    del meta["domains"]["python_docs"]["train"]["tokens"]
    (data_dir / "data.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(f"prepared data {str(data_dir / 'data.json')!r} records no token count "
                                                   f"for the train split of python_docs")):  # fmt: skip
        PreparedData(data_dir).stream("train", "python_docs")
