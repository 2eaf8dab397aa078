"""`occult train` and the learned-routing studies on CPU: a generated three-domain corpus, a few steps.

The always-on tests use text generated here (three domains with different vocabularies, documents
separated by U+001E lines, gzip-compressed like ../shared/data/corpus; and a directory of a user's own
`.txt` and `.jsonl` files); the shipped tiny checkpoint is checked as it is in the package.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from corpus_files import VOCABS, write_corpus
from occult_hf.training import PreparedData, get_recipe, prepare_data, tiny_checkpoint_path, train
from occult_hf.training.data import RECORD_SEPARATOR, split_documents
from occult_hf.training.evaluate import capture_routing, load_entropy, perplexity, random_topk, removed_weight, routing_structure

TINY = dict(max_steps=3, batch_size=2, seq_len=32, vocab_size=300, warmup_steps=1, max_chars_per_domain=None)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("training")
    corpus = write_corpus(root / "corpus")
    recipe = get_recipe("tiny", **TINY)
    return prepare_data(corpus, root / "data", vocab_size=recipe.vocab_size, heldout_fraction=0.25, separator=RECORD_SEPARATOR,
                        cache_dir=root / "hf_cache")  # fmt: skip


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> tuple[Path, dict]:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tiny_ckpt")
    log = train(get_recipe("tiny", **TINY), prepared, out, eval_tokens=256, progress=False)
    return out, log


def test_documents_are_blank_line_blocks_or_split_on_the_separator():
    assert split_documents("a\nb\n\n\nc\n  \t\nd x\n\n") == ["a\nb", "c", "d x"]  # the default: blank lines
    assert split_documents(f"a\nb\n{RECORD_SEPARATOR}\nc\n{RECORD_SEPARATOR}\n\n{RECORD_SEPARATOR}\nd x\n", RECORD_SEPARATOR) == ["a\nb", "c", "d x"]
    # a bare U+001E, not on a line of its own (issue 32: this was one document, "cannot be split")
    assert split_documents("a\n\nb\x1ec d\x1e\x1ee", RECORD_SEPARATOR) == ["a\n\nb", "c d", "e"]


@pytest.mark.parametrize("make_dir, message", [(False, "does not exist"), (True, "holds no corpus file")])
def test_prepare_data_says_whether_the_corpus_directory_is_missing_or_empty(tmp_path, make_dir, message):
    corpus = tmp_path / "corpus"
    if make_dir:
        corpus.mkdir()
        (corpus / "README.md").write_text("not a corpus file\n")
    with pytest.raises(FileNotFoundError, match=re.escape(f"corpus directory '{corpus}' {message}")):
        prepare_data(corpus, tmp_path / "data", vocab_size=64, heldout_fraction=0.25)


def _own_corpus(directory: Path) -> Path:
    """A user's corpus: prose in blank-line blocks (`notes.txt`), JSON lines (`chat.jsonl.gz`, text in `body`), a README."""
    directory.mkdir()
    notes = [f"note {d}\n" + "\n".join(f"line {i} of note {d} about kernels and drivers" for i in range(3)) for d in range(8)]
    (directory / "notes.txt").write_text("\n\n".join(notes) + "\n\n\n")
    with gzip.open(directory / "chat.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in range(8):
            f.write(json.dumps({"id": d, "body": f"message {d}: what does the function return when called twice?"}) + "\n")
    (directory / "README.md").write_text("# my corpus\n\nnot read\n")
    return directory


def test_any_directory_of_text_and_jsonl_files_is_a_corpus(tmp_path, capsys):
    """One domain per file, named by it; `.txt` in blank-line blocks, `.jsonl` one record a document (issue 32)."""
    from occult_hf.cli import main

    corpus, out = _own_corpus(tmp_path / "mine"), tmp_path / "run"
    assert main(["train", "--corpus-dir", str(corpus), "--text-field", "body", "--out", str(out), "--prepare-only"]) == 0
    data = PreparedData(out / "data")
    assert data.domains == ["chat", "notes"]
    assert [(data.meta["domains"][d]["train"]["documents"], data.meta["domains"][d]["heldout"]["documents"]) for d in data.domains] == [(7, 1)] * 2
    assert data.heldout_texts("notes") == ["note 7\n" + "\n".join(f"line {i} of note 7 about kernels and drivers" for i in range(3))]
    assert data.heldout_texts("chat") == ["message 7: what does the function return when called twice?"]  # the tiny recipe holds out 5%
    assert data.meta["settings"]["separator"] == "blank-line" and data.meta["settings"]["text_field"] == "body"
    # the prepared directory is reused only with the settings it was made with
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--corpus-dir", str(corpus), "--separator", "\\x1e", "--out", str(out), "--prepare-only"])
    assert exit_info.value.code == 2
    assert "was prepared with other settings: separator 'blank-line' (asked: '\\x1e'); text_field 'body' (asked: 'text')" in capsys.readouterr().err
    # without --corpus-dir a prepared directory is reused on the recipe's settings alone (a GPU machine has no corpus)
    assert main(["train", "--data-dir", str(out / "data"), "--out", str(tmp_path / "elsewhere"), "--prepare-only"]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "nothing"), "--prepare-only"])
    assert exit_info.value.code == 2 and "holds no prepared data (data.json): give --corpus-dir to prepare it" in capsys.readouterr().err


def test_a_corpus_read_with_the_wrong_settings_is_named(tmp_path):
    project_format = write_corpus(tmp_path / "project", docs=4)
    with pytest.raises(ValueError, match=re.escape("kernel_docs.txt.gz' holds U+001E record separators but is read as blank-line blocks")):
        prepare_data(project_format, tmp_path / "data", vocab_size=64, heldout_fraction=0.25)
    with pytest.raises(ValueError, match=re.escape("chat.jsonl.gz' has no field 'text' (its fields: ['id', 'body']); set text_field")):
        prepare_data(_own_corpus(tmp_path / "mine"), tmp_path / "data", vocab_size=64, heldout_fraction=0.25)
    (tmp_path / "mine" / "notes.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="domain 'notes' has two files, notes.jsonl and notes.txt"):
        prepare_data(tmp_path / "mine", tmp_path / "data", vocab_size=64, heldout_fraction=0.25)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "essay.txt").write_text("one document without blank lines\nand a second line\n")
    with pytest.raises(ValueError, match="essay has 1 document\\(s\\), too few to split with heldout_fraction 0.25"):
        prepare_data(tmp_path / "one", tmp_path / "data", vocab_size=64, heldout_fraction=0.25)


def test_prepared_data_holds_out_the_last_documents_of_every_domain(prepared):
    data = PreparedData(prepared)
    assert data.domains == sorted(VOCABS)
    for domain in VOCABS:
        row = data.meta["domains"][domain]
        assert (row["train"]["documents"], row["heldout"]["documents"]) == (18, 6)  # the last ceil(24 * 0.25)
        held = data.heldout_texts(domain)
        assert [t.split("\n")[0] for t in held] == [f"{domain} document {d}" for d in range(18, 24)]
        tokenizer = data.tokenizer()
        stream = data.stream("heldout", domain)
        assert len(stream) == row["heldout"]["tokens"] and stream[-1] == tokenizer.eos_token_id
        # the stream is the held-out documents, each followed by <eos>
        assert tokenizer.decode(stream[: list(stream).index(tokenizer.eos_token_id)]) == held[0]
        windows = data.windows("heldout", domain, 16)
        assert windows.shape == (len(stream) // 16, 16)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_tiny_recipe_trains_profiles_and_evaluates(trained, prepared):
    from transformers import OlmoeForCausalLM

    from occult_hf.placement import plan_placement
    from occult_hf.profile import RoutingProfile

    out, log = trained
    assert log["steps"] == 3 and log["tokens_seen"] == 3 * 2 * 32
    assert len(log["loss_history"]) == 3 and all(math.isfinite(h["loss"]) for h in log["loss_history"])
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "recipe.json").read_text())["max_steps"] == 3
    model = OlmoeForCausalLM.from_pretrained(out).eval()
    data = PreparedData(prepared)
    windows = data.windows("heldout", "kernel_docs", 32)
    # perplexity is exp of the mean next-token NLL, recomputed here by hand
    ids = torch.as_tensor(windows)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert perplexity(model, windows, batch_size=3) == pytest.approx(math.exp(nll.item()), rel=1e-5)
    assert log["heldout_perplexity"]["kernel_docs"] == pytest.approx(perplexity(model, data.windows("heldout", "kernel_docs", 32, 256)), rel=1e-5)
    profile = RoutingProfile.collect(model, windows.tolist(), max_length=32, progress=False)
    assert sorted(profile.layers) == [0, 1, 2, 3] and profile.layer(0).token_count == windows.size
    routing = capture_routing(model, windows)
    assert np.array_equal(np.sort(routing[0][0], 1), np.sort(profile.layer(0).topk_sample, 1)) or profile.layer(0).topk_sample.shape[0] < windows.size
    placement = plan_placement(profile, 8, "refined", progress=False)
    removed, pruned = removed_weight(*routing[0], placement.device_of(0), 8, 1)
    assert 0.0 < removed < 1.0 and 0.0 < pruned <= 1.0
    assert removed_weight(*routing[0], placement.device_of(0), 8, 4) == (0.0, 0.0)  # N_d = k: nothing pruned


def test_trainer_steps_do_not_wait_for_the_loss_on_the_host(prepared, tmp_path, monkeypatch):
    """`train` leaves the host free to run ahead of the GPU: Trainer's loop does not test the loss's truth value after
    every step (its `logging_nan_inf_filter` asks `torch.isnan(loss) or torch.isinf(loss)`: a host read, so a wait
    for the GPU, at every step)."""
    import sys

    truth_tests = []
    original = torch.Tensor.__bool__

    def counted(self):
        if sys._getframe(1).f_code.co_filename.endswith("transformers/trainer.py"):
            truth_tests.append(sys._getframe(1).f_lineno)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counted)
    log = train(get_recipe("tiny", **TINY), prepared, tmp_path / "out", eval_tokens=256, progress=False, save=False)
    assert log["steps"] == 3 and truth_tests == []


def test_trainer_moves_each_batch_to_the_device_without_waiting(prepared, tmp_path, monkeypatch):
    """A blocking host-to-device copy synchronises the stream, so the host would wait for the GPU's previous step
    before enqueueing the next one: `train` has accelerate move every batch with `non_blocking=True`."""
    import accelerate.data_loader

    flags = []
    original = accelerate.data_loader.send_to_device

    def recorded(tensor, device, non_blocking=False, **kwargs):
        flags.append(non_blocking)
        return original(tensor, device, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(accelerate.data_loader, "send_to_device", recorded)
    log = train(get_recipe("tiny", **TINY), prepared, tmp_path / "out", eval_tokens=256, progress=False, save=False)
    assert log["steps"] == 3 and len(flags) >= 3 and all(flags)


def test_a_cut_run_resumes_from_its_checkpoint_to_the_uninterrupted_runs_weights(prepared, tmp_path):
    """`checkpoint_steps`: a run stopped after its step-2 checkpoint, run again, ends bit for bit where one run does."""
    from transformers import OlmoeForCausalLM, TrainerCallback

    class CutAtStep3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt("the deadline")

    torch.set_num_threads(1)
    recipe = get_recipe("tiny", **{**TINY, "max_steps": 4})
    whole = train(recipe, prepared, tmp_path / "whole", eval_tokens=256, progress=False, checkpoint_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, prepared, tmp_path / "cut", eval_tokens=256, progress=False, checkpoint_steps=2, trainer_callbacks=[CutAtStep3()])
    assert [p.name for p in (tmp_path / "cut" / "trainer").iterdir()] == ["checkpoint-2"]
    half_saved = tmp_path / "cut" / "trainer" / "checkpoint-3"  # a save the kill cut: weights written, no trainer_state.json
    half_saved.mkdir()
    (half_saved / "model.safetensors").write_bytes(b"cut")
    resumed = train(recipe, prepared, tmp_path / "cut", eval_tokens=256, progress=False, checkpoint_steps=2)
    assert (whole["resumed_at_step"], resumed["resumed_at_step"]) == (None, 2) and resumed["steps"] == 4
    assert resumed["loss_history"] == whole["loss_history"]
    train(recipe, prepared, tmp_path / "plain", eval_tokens=256, progress=False)  # writing checkpoints changes nothing either
    one, *others = (OlmoeForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("whole", "cut", "plain"))
    assert all(torch.equal(one[name], other[name]) for other in others for name in one)
    assert not (tmp_path / "cut" / "trainer").exists()  # the checkpoints go once the run has finished
    with pytest.raises(ValueError, match="checkpoint_steps needs a fixed number of steps; recipe tiny stops after its time budget"):
        train(recipe.replace(time_budget_s=60.0), prepared, tmp_path / "budget", progress=False, checkpoint_steps=2)
    with pytest.raises(ValueError, match="checkpoint_steps builds the model itself"):
        train(recipe, prepared, tmp_path / "built", progress=False, checkpoint_steps=2, model=OlmoeForCausalLM(recipe.model_config()))


def test_routing_structure_of_a_random_router_is_flat():
    ids = random_topk(20_000, 32, 4, seed=1)
    assert load_entropy(ids, 32) > 0.999
    skewed = np.where(ids < 16, ids, ids % 4)  # experts 4..15 and 0..3 double: a skewed load
    assert load_entropy(np.sort(skewed, 1), 32) < 0.95
    s = routing_structure({0: (ids, np.ones_like(ids, dtype=np.float32))}, 32)
    assert s["mean"]["top10_pair_share"] == pytest.approx(s["mean"]["top10_pair_share_random"], abs=0.02)


def test_occult_train_command_prepares_trains_and_writes_its_files(tmp_path):
    from occult_hf.cli import main

    corpus = write_corpus(tmp_path / "corpus", docs=40, lines=(20, 30))  # 2 held-out documents: > 128 tokens
    out = tmp_path / "ckpt"
    argv = ["train", "--recipe", "tiny", "--corpus-dir", str(corpus), "--separator", "\\x1e", "--out", str(out), "--max-steps", "2"]
    assert main(argv) == 0  # the separator as a shell passes it: backslash, x, 1, e
    for name in ("model.safetensors", "tokenizer.json", "recipe.json", "train_log.json", "loss_curve.png", "data/data.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "recipe.json").read_text())["train_domains"] == sorted(VOCABS)  # tiny: every domain, named
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "nope", "--out", str(out)])


def test_occult_train_compile_flag_reaches_the_recipe(tmp_path, monkeypatch):
    """`--compile` trains through torch.compile (`Recipe.torch_compile`, which `train` hands to `TrainingArguments`);
    without it the recipe's own setting stands."""
    import occult_hf.training
    from occult_hf.cli import main

    corpus = write_corpus(tmp_path / "corpus", docs=40, lines=(20, 30))
    trained = []
    log = dict.fromkeys(("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity", "parameters"))
    monkeypatch.setattr(occult_hf.training, "train", lambda recipe, data_dir, out: trained.append(recipe) or log)
    for extra in (["--compile"], []):
        argv = ["train", "--recipe", "tiny", "--corpus-dir", str(corpus), "--separator", "\\x1e", "--out", str(tmp_path / "ckpt"), *extra]
        assert main(argv) == 0
    assert [recipe.torch_compile for recipe in trained] == [True, False]


def test_shipped_tiny_checkpoint_is_small_self_describing_and_learned():
    from transformers import AutoTokenizer, OlmoeForCausalLM

    path = Path(str(tiny_checkpoint_path()))
    assert sum(f.stat().st_size for f in path.iterdir()) <= 8 * 2**20
    recipe = json.loads((path / "recipe.json").read_text())
    assert sorted(recipe["train_domains"]) == sorted(VOCABS)  # the project corpus's three domains
    assert recipe == get_recipe("tiny", train_domains=recipe["train_domains"]).to_dict()  # made by the tiny recipe as it stands
    log = json.loads((path / "train_log.json").read_text())
    assert log["steps"] == recipe["max_steps"]
    model = OlmoeForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # prose written for this test, never in the training corpus (one document a line)
    prose = (Path(__file__).parent / "data" / "held_out_prose.txt").read_text()
    text = " ".join(line for line in prose.splitlines() if line.strip())
    ids = tokenizer(text)["input_ids"]
    windows = np.array([ids[i : i + 128] for i in range(0, len(ids) - 128, 128)])
    torch.manual_seed(0)
    untrained = OlmoeForCausalLM(model.config).eval()
    # learned: better than an untrained model of the same config, and routing far from uniform
    assert perplexity(model, windows) < 0.5 * perplexity(untrained, windows)
    s = routing_structure(capture_routing(model, windows), model.config.num_experts)["mean"]
    assert s["top10_pair_share"] > 1.5 * s["top10_pair_share_random"]

    # saved for inference: a batched, left-padded generate runs (router logits in the outputs would break it) and
    # gives each prompt the tokens it gets alone
    assert model.config.output_router_logits is False
    tokenizer.padding_side = "left"
    prompts = ["def main", "The kernel schedules each task"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)[:, -4:]
    for prompt, tokens in zip(prompts, together):
        alone = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert alone[0, -4:].tolist() == tokens.tolist()


def test_transfer_study_on_the_tiny_models_profiles(trained, prepared):
    from transformers import OlmoeForCausalLM

    from occult_hf.profile import RoutingProfile
    from occult_hf.eval.studies.transfer import markdown, transfer_study

    model = OlmoeForCausalLM.from_pretrained(trained[0]).eval()
    data = PreparedData(prepared)
    domains = ["python_docs", "kernel_docs"]
    train_p, held_p = {}, {}
    for target, split in ((train_p, "train"), (held_p, "heldout")):
        for d in domains:
            target[d] = RoutingProfile.collect(model, data.windows(split, d, 32).tolist(), max_length=32, progress=False)
    rows = transfer_study(train_p, held_p, methods=("contiguous", "occult"), devices=(4,))
    assert len(rows) == 2 * 2 * 2  # methods x sources x targets
    for r in rows:
        if r["source"] == r["target"] or r["method"] == "contiguous":
            assert r["ct_ratio"] == pytest.approx(1.0)  # the oracle itself; contiguous ignores the profile
        assert 1.0 <= r["ct"] <= 4.0 and r["balance"] >= 1.0
    assert "Goal (CT on an unseen domain within 10% of the oracle)" in markdown(rows)


def test_tokens_seen_counts_the_windows_fed_past_an_epochs_short_last_batch(trained, prepared, tmp_path):
    """`tokens_seen` was `steps * batch_size * seq_len`: an epoch ends in a short batch of the windows left, which
    that counted as whole (9 windows at batch 8 logged 1,024 tokens where 576 were fed). Counted against the
    `input_ids` the model received."""
    from transformers import TrainerCallback

    class CountFed(TrainerCallback):
        tokens = 0

        def attach(self, trainer):
            trainer.model.register_forward_pre_hook(self.count, with_kwargs=True)

        def count(self, module, args, kwargs):
            if module.training:
                type(self).tokens += kwargs["input_ids"].numel()

    windows = trained[1]["train_windows"]
    recipe = get_recipe("tiny", **{**TINY, "batch_size": windows - 1, "max_steps": 3})  # 2 steps an epoch, 1 window short
    log = train(recipe, prepared, tmp_path, eval_tokens=64, progress=False, save=False, trainer_callbacks=[CountFed()])
    assert log["tokens_seen"] == CountFed.tokens == (windows + windows - 1) * TINY["seq_len"]


def test_a_bad_eval_tokens_is_refused_before_training(prepared, tmp_path):
    """`eval_tokens` is read after training, to pack the held-out windows: 0 trained to the end and then raised,
    with nothing saved. numpy integers are counts too."""
    with pytest.raises(ValueError, match="train eval_tokens must be an integer >= 1 .*, got 0"):
        train(get_recipe("tiny", **TINY), prepared, tmp_path / "zero", eval_tokens=0, progress=False)
    assert not (tmp_path / "zero").exists()
    from occult_hf.training.data import pack

    assert pack(np.arange(100), 10, max_tokens=np.int64(50)).shape == (5, 10)
