"""The lm-eval hook: occult23's task names, the CoQA metrics shim, result tables and `--compare`,
the EP forward lockstep, and `occult-hf` against lm-eval's stock `hf` on tiny models of every family,
in one process and on a 2-rank gloo EP world.

Everything runs offline: local JSONL tasks (one multiple-choice, one generate-until), a word-level
tokenizer built here, tiny checkpoints saved to a temporary directory, `HF_HUB_OFFLINE=1` and a
temporary `HF_DATASETS_CACHE`. lm-eval is heavy to import, so one process evaluates everything and
one spawned world runs every family's EP checks.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-eval hook needs the eval extra: pip install 'occult_hf[eval]'")

import lm_eval  # noqa: E402
import torch.distributed as dist  # noqa: E402
from distributed import run_world  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tiny_models import FAMILIES, tiny_checkpoint  # noqa: E402

import occult_hf.eval as occult_eval  # noqa: E402
from occult_hf.cli import main as occult_main  # noqa: E402
from occult_hf.eval.lockstep import ForwardLockstep  # noqa: E402
from occult_hf.eval.model import resolve_occult_config  # noqa: E402
from occult_hf.eval.report import compare_table, headline_scores, markdown_table  # noqa: E402
from occult_hf.eval.squad_metrics_shim import compute_exact, compute_f1  # noqa: E402

# ----- offline fixtures: tokenizer, local tasks, tiny checkpoints -------------------------------------

VOCAB_SIZE = 128  # the tiny models' vocabulary
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", ".")  # ids 0-2 match the tiny configs' pad/bos/eos
WORDS = (
    "red blue green fox dog cat runs jumps over under big small quick slow river tree sky sun moon star "
    "day night yes no maybe one two three four five apple pear plum stone house road city town king queen "
    "bird fish swims flies eats sees likes has is was"
).split()
MC_DOCS, GEN_DOCS = 10, 7  # 7 generation prompts: 4 and 3 per rank, so lm-eval pads and ranks' forwards differ
BATCH_SIZE = 4
NUM_DEVICES = 2  # logical devices in one process, real ranks under EP
EVAL_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: one pytest worker runs this module, so its module-scoped checkpoints, task index, evaluations and EP world are made once
pytestmark = pytest.mark.xdist_group("eval")


def build_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over exactly the tiny models' 128 ids (filler words after the real ones)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + WORDS
    tokens += [f"w{i}" for i in range(VOCAB_SIZE - len(tokens))]
    word_level = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(directory)


def write_local_tasks(directory: Path) -> None:
    """`occ_mc` (multiple_choice, acc) and `occ_gen` (generate_until, exact_match) over local JSONL files."""
    rng = random.Random(0)
    sentence = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(directory / "mc.jsonl", "w") as f:
        for _ in range(MC_DOCS):
            doc = {"question": sentence(4, 9), "choices": [sentence(1, 3) for _ in range(3)], "label": rng.randrange(3)}
            f.write(json.dumps(doc) + "\n")
    with open(directory / "gen.jsonl", "w") as f:
        for _ in range(GEN_DOCS):
            f.write(json.dumps({"prompt": sentence(4, 9), "answer": rng.choice(WORDS)}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (directory / "occ_mc.yaml").write_text(
        f"task: occ_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (directory / "occ_gen.yaml").write_text(
        f"task: occ_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def skip_environment_report(setattr_=setattr) -> None:
    """simple_evaluate records `pip list` output etc. (~1 s of subprocesses per call); not needed here."""
    import lm_eval.evaluator

    setattr_(lm_eval.evaluator, "add_env_info", lambda results: None)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """Offline settings for this module, the local task folder and one tiny checkpoint per family."""
    import datasets.config
    import huggingface_hub.constants

    root = tmp_path_factory.mktemp("eval_assets")
    cache = root / "hf_datasets_cache"
    threads = torch.get_num_threads()
    # tiny matrices: on a shared 2-core machine intra-op thread hand-offs cost 10-50x the compute
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**EVAL_ENV, "HF_DATASETS_CACHE": str(cache)}.items():
            patch.setenv(name, value)
        # datasets and huggingface_hub read these at import time, possibly before this module ran
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        skip_environment_report(patch.setattr)
        tasks = root / "tasks"
        tasks.mkdir()
        write_local_tasks(tasks)
        models = {}
        for family in FAMILIES:
            # a published checkpoint does not record router logits at inference; with it on, transformers'
            # OLMoE/Qwen aux-loss code fails during cached generation (the mask and the step disagree)
            models[family] = tiny_checkpoint(family, root / family, seed=3, output_router_logits=False)
            build_tokenizer(models[family])
        yield {"root": root, "tasks": tasks, "cache": cache, "models": models}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def full_task_manager(assets) -> TaskManager:
    """`make_task_manager` over lm-eval's ~10k task YAMLs, occult23 and the local tasks (indexing takes
    seconds, so the tests that need the full index share this one)."""
    return occult_eval.make_task_manager(assets["tasks"])


@pytest.fixture(scope="module")
def local_task_manager(assets) -> TaskManager:
    return TaskManager(include_path=str(assets["tasks"]), include_defaults=False)


def model_args(assets, family: str, **occult) -> dict:
    args = {"pretrained": str(assets["models"][family]), "device": "cpu", "dtype": "float32"}
    return args | occult


PRUNED = {"num_devices": NUM_DEVICES, "prune": "router", "max_devices_per_token": 1}


def outputs(results: dict) -> dict:
    """What a run produced, per task and document: metrics and the model responses the metrics used.

    (Not the raw `resps`: under EP lm-eval pads a rank's requests by running its last request again,
    which appends a second response to that request.)"""
    per_task = {}
    for task, samples in results["samples"].items():
        per_task[task] = {
            "metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, (int, float))},
            "resps": {s["doc_id"]: s["filtered_resps"] for s in samples},
        }
    return per_task


def evaluate(model: str, args: dict, task_manager: TaskManager) -> dict:
    results = lm_eval.simple_evaluate(
        model=model, model_args=args, tasks=["occ_mc", "occ_gen"], batch_size=BATCH_SIZE,
        task_manager=task_manager, bootstrap_iters=0, log_samples=True,
    )  # fmt: skip
    return None if results is None else outputs(results)


def flat_loglikelihoods(run: dict) -> list[float]:
    return [float(ll) for doc in sorted(run["occ_mc"]["resps"]) for ll, _ in run["occ_mc"]["resps"][doc]]


def assert_same_outputs(actual: dict, expected: dict) -> None:
    """Same metrics, same generations, loglikelihoods equal to fp32 reordering (1e-5)."""
    assert actual["occ_gen"]["resps"] == expected["occ_gen"]["resps"]
    assert flat_loglikelihoods(actual) == pytest.approx(flat_loglikelihoods(expected), rel=1e-5, abs=1e-5)
    greedy = lambda run: [g for d in sorted(run["occ_mc"]["resps"]) for _, g in run["occ_mc"]["resps"][d]]  # noqa: E731
    assert greedy(actual) == greedy(expected)
    for task in ("occ_mc", "occ_gen"):
        assert actual[task]["metrics"] == expected[task]["metrics"]


# ----- occult23 and the CoQA shim ---------------------------------------------------------------------


def test_occult23_resolves_to_23_lm_eval_tasks(full_task_manager):
    """All 23 names exist in lm-eval 0.4.13's index (no data downloaded) and the group lists exactly them."""
    assert lm_eval.__version__ == "0.4.13"
    manager = full_task_manager
    names = occult_eval.suite_tasks()
    assert len(names) == 23 and len(set(names)) == 23
    missing = [name for name in names if name not in manager.all_tasks]
    assert not missing, f"not in lm-eval 0.4.13: {missing}"
    assert "occult23" in manager.all_groups
    assert manager.task_index["occult23"].cfg["task"] == list(names)
    # the choices docs/eval.md explains
    assert {"wsc273", "qasper_bool", "mnli", "rte", "logiqa", "mmlu", "coqa"} <= set(names)


def test_squad_metrics_match_hand_computed_values():
    assert compute_exact("The Cat!", "cat") == 1  # case, punctuation and articles do not count
    assert compute_exact("a red fox", "red foxes") == 0
    assert compute_f1("the quick brown fox", "quick fox jumps") == pytest.approx(2 / 3)  # P = R = 2/3
    assert compute_f1("Hello, World", "hello world world") == pytest.approx(0.8)  # P = 2/3, R = 1
    assert compute_f1("", "") == 1 and compute_f1("", "something") == 0  # "no answer" only matches itself
    assert compute_f1("x y z", "a b c") == 0


def test_coqa_task_loads_and_scores_with_the_shim(assets):
    """lm-eval's own CoQA task (its utils.py imports transformers.data.metrics.squad_metrics) on a local doc."""
    from lm_eval.tasks._yaml_loader import load_yaml

    import transformers.data.metrics.squad_metrics as squad_metrics

    assert squad_metrics.compute_f1 is compute_f1
    coqa_yaml = Path(lm_eval.__file__).parent / "tasks" / "coqa" / "default.yaml"
    config = load_yaml(coqa_yaml, resolve_func=True)  # imports the task's utils.py
    doc = {
        "story": "The cat sat on the mat.",
        "questions": {"input_text": ["Where did the cat sit?", "What color is it?"]},
        "answers": {"input_text": ["on the mat", "Black"]},
        "additional_answers": {"0": {"input_text": ["the mat", "black cat"]}},
    }
    data = assets["root"] / "coqa.jsonl"
    data.write_text(json.dumps(doc) + "\n")
    config |= {"dataset_path": "json", "dataset_kwargs": {"data_files": {"validation": str(data), "train": str(data)}}}
    task = TaskManager(include_defaults=False).load([config])["tasks"]["coqa"]
    loaded_doc = next(iter(task.validation_docs()))
    assert task.doc_to_text(loaded_doc).endswith("Q: What color is it?\n\nA:")
    assert task.doc_to_target(loaded_doc) == ["Black", "black cat"]
    # golds {"Black", "black cat"}, each scored against the other: EM (0 + 1) / 2, F1 (2/3 + 1) / 2
    scores = task.process_results(loaded_doc, ["black\nQ: and then?"])
    assert scores["em"] == pytest.approx(0.5)
    assert scores["f1"] == pytest.approx(5 / 6)


# ----- result tables ----------------------------------------------------------------------------------


def suite_like_results(acc_shift: float = 0.0) -> dict:
    """A results dict shaped like an occult23 run: a metric-less group, a group with its own acc, CoQA."""
    return {
        "results": {
            "occult23": {"alias": "occult23"},
            "winogrande": {"acc,none": 0.6 + acc_shift, "acc_stderr,none": 0.01},
            "mmlu": {"acc,none": 0.5 + acc_shift, "acc_stderr,none": 0.004},
            "mmlu_stem": {"acc,none": 0.4},
            "qasper_bool": {"f1,none": 0.7},
            "coqa": {"em,none": 0.55, "f1,none": 0.65, "em_stderr,none": "N/A"},
            "gsm8k_like": {"exact_match,flexible-extract": 0.2, "exact_match,strict-match": 0.1},
        },
        "group_subtasks": {
            "occult23": ["winogrande", "mmlu", "qasper_bool", "coqa", "gsm8k_like"],
            "mmlu": ["mmlu_stem"],
            "mmlu_stem": [],
        },
    }


def test_headline_rows_expand_metricless_groups_only():
    rows = [(s.task, s.metric, s.value) for s in headline_scores(suite_like_results())]
    assert rows == [
        ("winogrande", "acc", 0.6),
        ("mmlu", "acc", 0.5),
        ("qasper_bool", "f1", 0.7),
        ("coqa", "em", 0.55),
        ("coqa", "f1", 0.65),
        ("gsm8k_like", "exact_match", 0.2),  # no "none" filter: the first one reported
    ]


def test_headline_table_is_lm_evals_make_table_of_the_headline_rows(tmp_path, capsys):
    from lm_eval.utils import make_table

    from occult_hf.eval.report import headline_results
    from occult_hf.utils.tables import markdown_rows

    cut = headline_results(suite_like_results())
    assert set(cut["results"]) == {"winogrande", "mmlu", "qasper_bool", "coqa", "gsm8k_like"}  # no groups, no members of mmlu
    assert cut["results"]["gsm8k_like"] == {"exact_match,flexible-extract": 0.2}  # only the filter the row reads
    table = markdown_table(suite_like_results())
    lm_eval_table = make_table(cut).rstrip("\n").splitlines()  # lm-eval's own table, whose rows it sorts by name
    assert table.splitlines()[:2] == lm_eval_table[:2] and sorted(table.splitlines()[2:8]) == sorted(lm_eval_table[2:])
    rows = {(r[0] or "coqa", r[4]): (r[6], r[8]) for r in markdown_rows(table.split("\n\n")[0])}
    assert rows[("winogrande", "acc")] == ("0.60", "0.010") and rows[("coqa", "f1")][0] == "0.65"
    assert len(rows) == 6 and table.endswith("Average over the 6 headline rows: 0.5333")
    # the command, on an lm-eval output folder: its newest results_*.json
    run = tmp_path / "out" / "model"
    run.mkdir(parents=True)
    (run / "results_2026-01-01T00-00-00.json").write_text(json.dumps(suite_like_results(acc_shift=-0.5)))
    time.sleep(0.01)
    (run / "results_2026-01-02T00-00-00.json").write_text(json.dumps(suite_like_results()))
    assert occult_main(["eval", "--headline", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == table


def test_headline_table_lists_the_rows_in_the_suites_order():
    """docs/eval.md shows the paper's order (winogrande first, coqa last) and `headline_scores` reads the rows in it;
    lm-eval's `make_table` sorted them by name (coqa first)."""
    from occult_hf.utils.tables import markdown_rows

    printed = [row[0] for row in markdown_rows(markdown_table(suite_like_results()).split("\n\n")[0]) if row[0]]
    assert printed == ["winogrande", "mmlu", "qasper_bool", "coqa", "gsm8k_like"]
    assert printed == list(dict.fromkeys(score.task for score in headline_scores(suite_like_results())))


def limited(results: dict, limit: float, scored: int, shots: int = 0) -> dict:
    """`results` as a run with `--limit limit` that scored `scored` of each task's 10 documents with `shots` shots."""
    tasks = [task for task in results["results"] if task != "occult23"]
    return results | {"config": {"limit": limit}, "n-shot": {task: shots for task in tasks},
                      "n-samples": {task: {"original": 10, "effective": scored} for task in tasks}}  # fmt: skip


def test_compare_and_headline_warn_when_runs_are_not_comparable(tmp_path, capsys):
    """A run over 1 document of 13 compared with a full one printed deltas, and `--headline` of it an average, with no
    sign that the runs differed; two runs with no task in common printed a table of dashes."""
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    full.write_text(json.dumps(limited(suite_like_results(), None, scored=10)))
    part.write_text(json.dumps(limited(suite_like_results(acc_shift=-0.03), 0.1, scored=1, shots=5)))
    assert occult_main(["eval", "--compare", str(full), str(part), "--labels", "full", "part"]) == 0
    captured = capsys.readouterr()
    assert "| winogrande" in captured.out and "warning" not in captured.out
    assert captured.err.splitlines() == [
        "occult eval: warning: the runs differ in --limit: full None, part 0.1",
        "occult eval: warning: the runs differ in documents scored: ['winogrande: full 10, part 1', 'mmlu: full 10, part 1', "
        "'mmlu_stem: full 10, part 1', 'qasper_bool: full 10, part 1', 'coqa: full 10, part 1', 'gsm8k_like: full 10, part 1']",
        "occult eval: warning: the runs differ in n-shot: ['winogrande: full 0, part 5', 'mmlu: full 0, part 5', "
        "'mmlu_stem: full 0, part 5', 'qasper_bool: full 0, part 5', 'coqa: full 0, part 5', 'gsm8k_like: full 0, part 5']",
    ]  # fmt: skip
    assert occult_main(["eval", "--compare", str(full), str(full)]) == 0
    assert capsys.readouterr().err == ""  # runs made alike: no warning
    assert occult_main(["eval", "--headline", str(part)]) == 0
    assert capsys.readouterr().err == (
        f"occult eval: warning: {part} scored only part of its documents (--limit 0.1, documents ['winogrande 1 of 10', "
        f"'mmlu 1 of 10', 'mmlu_stem 1 of 10', 'qasper_bool 1 of 10', 'coqa 1 of 10', 'gsm8k_like 1 of 10']): not "
        f"comparable with a full run or the paper's numbers\n"
    )  # fmt: skip
    other = tmp_path / "other.json"
    other.write_text(json.dumps(other_tasks_results()))
    assert occult_main(["eval", "--compare", str(full), str(other)]) == 0
    assert capsys.readouterr().err == "occult eval: warning: A and B share no task: no row has values from both\n"


def test_malformed_results_files_are_named(tmp_path, capsys):
    """`{"results": []}` failed with "'list' object has no attribute 'items'"; `{"results": {}}` and metrics that are
    strings were compared as a table of dashes."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(suite_like_results()))
    for name, results, message in [
        ("list", [], "'results' must map each task to its metrics, got []"),
        ("empty", {}, "'results' must map each task to its metrics, got {}"),
        ("number", {"t": 5}, "results['t'] must map metric names to values, got 5"),
        ("text", {"t": {"acc,none": "0.5"}}, "results['t']['acc,none'] must be a number, got '0.5'"),
    ]:  # fmt: skip
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps({"results": results}))
        with pytest.raises(SystemExit):
            occult_main(["eval", "--compare", str(good), str(bad)])
        assert f"occult eval: error: '{bad}': {message}" in capsys.readouterr().err


def test_a_folder_of_several_models_runs_is_refused_and_the_file_read_is_named(tmp_path, capsys):
    """`--compare DIR` read the newest results file anywhere under DIR: with two models' runs there (lm-eval writes each
    model's into a folder of its own), whichever model ran last, silently."""
    runs = tmp_path / "runs"
    for model, shift in (("model_a", 0.0), ("model_b", -0.03)):
        (runs / model).mkdir(parents=True)
        (runs / model / "results_2026-12-05T10-00-00.json").write_text(json.dumps(suite_like_results(acc_shift=shift)))
    with pytest.raises(SystemExit):
        occult_main(["eval", "--compare", str(runs), str(runs / "model_b")])
    assert f"holds the results of 2 models' runs ({runs / 'model_a'}, {runs / 'model_b'})" in capsys.readouterr().err
    assert occult_main(["eval", "--compare", str(runs / "model_a"), str(runs / "model_b")]) == 0
    assert f"reading {runs / 'model_a' / 'results_2026-12-05T10-00-00.json'}, its newest" in capsys.readouterr().err


def test_compare_prints_deltas_and_average(tmp_path, capsys):
    from occult_hf.utils.tables import markdown_rows

    path_a, path_b = tmp_path / "a.json", tmp_path / "b.json"
    path_a.write_text(json.dumps(suite_like_results()))
    path_b.write_text(json.dumps(suite_like_results(acc_shift=-0.03)))
    assert occult_main(["eval", "--compare", str(path_a), str(path_b), "--labels", "standard", "pruned"]) == 0
    printed = capsys.readouterr().out
    header = [cell.strip() for cell in printed.splitlines()[0].strip("|").split("|")]
    assert header == ["Tasks", "Metric", "standard", "pruned", "Δ (pruned − standard)"]
    rows = {(r[0], r[1]): [float(v) for v in r[2:]] for r in markdown_rows(printed)}
    assert rows[("winogrande", "acc")] == pytest.approx([0.60, 0.57, -0.03])
    assert rows[("coqa", "f1")] == pytest.approx([0.65, 0.65, 0.0])
    assert rows[("Average (6 shared rows)", "")] == pytest.approx([0.5333, 0.5233, -0.01], abs=1e-4)  # two of six rows moved
    missing = markdown_rows(compare_table(suite_like_results(), {"results": {}}))
    assert sum(row.count("–") for row in missing) >= 6
    with pytest.raises(SystemExit):
        occult_main(["eval", "--compare", str(path_a), str(path_b), "--headline", str(path_a)])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        occult_main(["eval", "--headline", str(empty)])
    assert "holds no results_*.json" in capsys.readouterr().err


def other_tasks_results(shift: float = 0.0) -> dict:
    """A run of two tasks outside occult23: a rolling-perplexity task and a multiple-choice one."""
    return {
        "results": {
            "wikitext": {"word_perplexity,none": 1.8e12 + shift, "byte_perplexity,none": 4.2, "bits_per_byte,none": 2.07},
            "arc_easy": {"acc,none": 0.25 + shift, "acc_stderr,none": 0.01, "acc_norm,none": 0.3},
        },
    }


def test_headline_rows_and_averages_are_only_for_occult23(tmp_path, capsys):
    """Issue 32: a run of other tasks printed its whole table again as "headline rows", then a mean of
    perplexities and accuracies (371193052874.1066)."""
    from occult_hf.utils.tables import markdown_rows

    with pytest.raises(ValueError, match="the results hold no occult23 run \\(tasks: wikitext, arc_easy\\)"):
        markdown_table(other_tasks_results())
    path_a, path_b = tmp_path / "a.json", tmp_path / "b.json"
    path_a.write_text(json.dumps(other_tasks_results()))
    path_b.write_text(json.dumps(other_tasks_results(shift=0.5)))
    with pytest.raises(SystemExit):
        occult_main(["eval", "--headline", str(path_a)])
    assert "the results hold no occult23 run" in capsys.readouterr().err
    # two runs of other tasks compare on every metric, with no mean across metric kinds
    assert occult_main(["eval", "--compare", str(path_a), str(path_b)]) == 0
    rows = {(r[0], r[1]): [float(v) for v in r[2:]] for r in markdown_rows(capsys.readouterr().out)}
    assert set(rows) == {("wikitext", m) for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")} | {
        ("arc_easy", "acc"), ("arc_easy", "acc_norm")}
    assert rows[("arc_easy", "acc")] == pytest.approx([0.25, 0.75, 0.5])
    # ... also when every metric is a fraction: arc_easy's acc and acc_norm were averaged together
    accuracies = {"results": {"arc_easy": {"acc,none": 0.25, "acc_norm,none": 0.3}, "piqa": {"acc,none": 0.6}}}
    assert not [row for row in markdown_rows(compare_table(accuracies, accuracies)) if row[0].startswith("Average")]
    # an occult23 run next to other tasks: the headline rows, their mean, and nothing of the other tasks
    mixed = suite_like_results()
    mixed["results"] |= other_tasks_results()["results"]
    assert markdown_table(mixed) == markdown_table(suite_like_results())


def test_compare_rejects_a_file_without_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": {}}))
    with pytest.raises(SystemExit):
        occult_main(["eval", "--compare", str(bad), str(bad)])
    assert "bad.json' is not an lm-eval results file: it has no top-level 'results' key" in capsys.readouterr().err

    cut = tmp_path / "cut.json"
    cut.write_text('{"results": {"arc_easy": {"acc,none": 0.5')  # a results file cut short
    with pytest.raises(SystemExit):
        occult_main(["eval", "--headline", str(cut)])
    assert "cut.json' is not valid JSON: Expecting" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        occult_main(["eval", "--compare", str(tmp_path / "absent.json"), str(cut)])
    assert "absent.json' does not exist" in capsys.readouterr().err


# ----- model_args validation -------------------------------------------------------------------------


def test_occult_settings_resolve_from_a_file_or_fields(tmp_path):
    assert resolve_occult_config(None, {"placement": None}) is None
    config = resolve_occult_config(None, {"num_devices": 4, "prune": "router", "max_devices_per_token": 2})
    assert (config.num_devices, config.prune, config.max_devices_per_token) == (4, "router", 2)
    config.save(tmp_path / "occult.json")
    assert resolve_occult_config(str(tmp_path / "occult.json"), {}) == config
    with pytest.raises(ValueError, match="either occult_config=.* or the individual settings \\['num_devices'\\]"):
        resolve_occult_config(str(tmp_path / "occult.json"), {"num_devices": 2})
    with pytest.raises(ValueError, match="max_devices_per_token"):
        resolve_occult_config(None, {"prune": "router"})


def test_occult_model_args_reach_the_model(assets, tmp_path):
    """Fields given in a model_args string (as lm-eval's CLI passes them) configure the runtime."""
    from occult_hf.hf.apply import occult_config_of
    from occult_hf.placement import Placement

    # experts interleaved over the two devices: not the contiguous default
    placement = Placement(num_experts=8, num_devices=2, layers={layer: [e % 2 for e in range(8)] for layer in (0, 1)})
    placement.save(tmp_path / "occult_placement.json")
    arg_string = f"pretrained={assets['models']['olmoe']},placement={tmp_path / 'occult_placement.json'},num_devices=2,dispatch=per_expert,dtype=float32"
    lm = get_model("occult-hf").create_from_arg_string(arg_string, {"device": "cpu", "batch_size": 2})
    running = occult_config_of(lm.model)
    assert (running.num_devices, running.dispatch, lm.batch_size) == (2, "per_expert", 2)
    assert running.placement.device_of(1) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert lm.get_model_info()["occult_config"]["dispatch"] == "per_expert"


def test_unsupported_hf_args_are_rejected(assets):
    with pytest.raises(ValueError, match="model_args \\['peft'\\] are not supported"):
        get_model("occult-hf")(pretrained=str(assets["models"]["olmoe"]), device="cpu", peft="some/adapter")


def test_a_misspelt_model_arg_is_named_with_the_setting_meant(assets):
    """A misspelt Occult setting reaches from_pretrained, whose model class rejected it without saying
    that it came from model_args or what was meant."""
    with pytest.raises(ValueError, match=r"occult-hf: model_args 'placment' is not .* \(did you mean 'placement'\?\)"):
        get_model("occult-hf").create_from_arg_string(f"pretrained={assets['models']['olmoe']},placment=contiguous", {"device": "cpu"})


# ----- the lockstep protocol on a stand-in EP module (run in the EP world below) -----------------------


class CollectiveEveryForward(torch.nn.Module):
    """Stands in for an EP model: every forward is an all_reduce (as every MoE layer's exchange is)."""

    def forward(self, input_ids, use_cache=None):
        total = input_ids.sum().reshape(1).float()
        dist.all_reduce(total)
        return total


def lockstep_check(rank: int, world_size: int) -> dict:
    model = CollectiveEveryForward()
    lockstep = ForwardLockstep(model, dist.group.WORLD, torch.device("cpu"), idle_token_id=0)
    values = [[1, 2, 3], [10, 20, 30, 40, 50]][rank]  # rank 1 has two more forwards than rank 0
    sums = [model(input_ids=torch.tensor([[v]])).item() for v in values]
    lockstep.drain()
    counts = (lockstep.real_forwards, lockstep.idle_forwards)
    lockstep.drain()  # a second meeting with nothing left to run: no forwards
    gathered = [None] * world_size
    dist.all_gather_object(gathered, counts)
    after = lockstep.real_forwards + lockstep.idle_forwards  # equal on every rank after a drain()
    return {"sums": sums, "counts": counts, "gathered": gathered, "after": after}


@pytest.mark.world_size(NUM_DEVICES)  # ep_reports runs the EP world
def test_lockstep_pairs_forwards_and_drains_unequal_ranks(ep_reports):
    rank0, rank1 = (report["lockstep"] for report in ep_reports)
    # rank 0's idle forwards contribute token 0, so rank 1's last two sums are its own values
    assert rank0["sums"] == [11.0, 22.0, 33.0] and rank1["sums"] == [11.0, 22.0, 33.0, 40.0, 50.0]
    assert rank0["counts"] == (3, 2) and rank1["counts"] == (5, 0)
    assert rank0["after"] == rank1["after"] == 5


# ----- occult-hf on tiny models of every family ---------------------------------------------------------


@pytest.fixture(scope="module")
def runs(assets, local_task_manager):
    """`runs(model, family, **occult)`: that evaluation's outputs, computed once and shared by the tests."""
    done: dict = {}

    def run(model: str, family: str, **occult) -> dict:
        key = (model, family, tuple(sorted(occult.items())))
        if key not in done:
            done[key] = evaluate(model, model_args(assets, family, **occult), local_task_manager)
        return done[key]

    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_occult_hf_equals_stock_hf_in_exact_mode(family, runs):
    assert_same_outputs(runs("occult-hf", family, num_devices=NUM_DEVICES), runs("hf", family))


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_changes_results_only_when_it_drops_devices(family, runs):
    stock = runs("hf", family)
    pruned = flat_loglikelihoods(runs("occult-hf", family, **PRUNED))
    assert max(abs(a - b) for a, b in zip(pruned, flat_loglikelihoods(stock))) > 1e-3
    # N_d = D keeps every token's devices, so the model is the exact one
    unpruned = dict(PRUNED, max_devices_per_token=NUM_DEVICES)
    assert_same_outputs(runs("occult-hf", family, **unpruned), stock)


def forward_batch_sizes(lm) -> list[int]:
    """Record the batch dimension of every top-level forward of `lm.model`."""
    sizes: list[int] = []

    def record(module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        sizes.append(input_ids.shape[0])

    lm.model.register_forward_pre_hook(record, with_kwargs=True)
    return sizes


def test_batch_size_is_honoured(assets, local_task_manager):
    sizes = {}
    for model, batch_size in (("hf", BATCH_SIZE), ("occult-hf", BATCH_SIZE), ("occult-hf", 1)):
        occult = {"num_devices": NUM_DEVICES} if model == "occult-hf" else {}
        lm = get_model(model).create_from_arg_obj(model_args(assets, "qwen3_moe", **occult), {"batch_size": batch_size})
        sizes[model, batch_size] = forward_batch_sizes(lm)
        lm_eval.simple_evaluate(model=lm, tasks=["occ_mc"], task_manager=local_task_manager, bootstrap_iters=0)
    assert sizes["occult-hf", BATCH_SIZE] == sizes["hf", BATCH_SIZE]
    assert max(sizes["occult-hf", BATCH_SIZE]) == BATCH_SIZE and set(sizes["occult-hf", 1]) == {1}


def test_occult_hf_scores_a_batch_with_one_host_read_and_the_right_answers(assets):
    """`occult-hf` scores all requests of a batch on the device and reads them back once (`eval/scoring.py`), where
    HFLM reads four times per request. Its answers equal one forward per request, and HFLM's own loop on the same
    batches, for requests that share an input (HFLM's one-token-continuation cache), that lm-eval truncates from the
    left, that are the model's greedy continuation, and of mixed lengths. One case differs from HFLM, where HFLM is
    wrong: a cached request whose continuation is shorter than its group's longest (a shorter context with the same
    tokens) is scored by HFLM at the group's first continuation positions instead of its own last ones."""
    from lm_eval.models.huggingface import HFLM

    lm = get_model("occult-hf").create_from_arg_obj(model_args(assets, "olmoe", num_devices=NUM_DEVICES, max_length=12),
                                                    {"batch_size": 3})  # fmt: skip
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, 60) for _ in range(n)]  # noqa: E731

    def reference(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        inputs = (context + continuation)[-(lm.max_length + 1) :][:-1]
        with torch.no_grad():
            log_probs = torch.log_softmax(lm.model(torch.tensor([inputs])).logits[0, -len(continuation) :].float(), dim=-1)
        picked = log_probs[torch.arange(len(continuation)), torch.tensor(continuation)]
        return float(picked.sum()), log_probs.argmax(dim=-1).tolist() == continuation

    def greedy_continuation(context: list[int], length: int) -> list[int]:
        sequence = list(context)
        for _ in range(length):
            with torch.no_grad():
                sequence.append(int(lm.model(torch.tensor([sequence])).logits[0, -1].argmax()))
        return sequence[len(context) :]

    cached, shorter_cached, greedy_context = tokens(5), tokens(5), tokens(4)
    pairs = [(cached, [7]), (cached, [9]), (shorter_cached, [8]), (shorter_cached[:3], shorter_cached[3:] + [11]),
             (tokens(20), tokens(3)), (tokens(15), [4]), (greedy_context, greedy_continuation(greedy_context, 2)),
             *[(tokens(rng.randrange(1, 9)), tokens(rng.randrange(1, 5))) for _ in range(8)]]  # fmt: skip
    requests = [((f"context {i}", f"continuation {i}"), context, continuation) for i, (context, continuation) in enumerate(pairs)]

    forwards = forward_batch_sizes(lm)
    reads = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("tolist", "item", "__float__", "__bool__"):

            def counted(self, *args, _original=getattr(torch.Tensor, name), _name=name):
                if sys._getframe(1).f_code.co_filename.endswith("scoring.py"):
                    reads.append(_name)
                return _original(self, *args)

            patch.setattr(torch.Tensor, name, counted)
        ours = lm._loglikelihood_tokens(requests)
    batches = len(forwards)
    theirs = HFLM._loglikelihood_tokens(lm, requests)
    hflm_forwards = forwards[batches:]
    expected = [reference(context, continuation) for context, continuation in pairs]
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in expected] and ours[6][1]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in expected], rel=1e-5, abs=1e-5)
    hflm_right = [i for i in range(len(pairs)) if i != 2]
    assert [ours[i][0] for i in hflm_right] == pytest.approx([theirs[i][0] for i in hflm_right], rel=1e-6, abs=1e-6)
    assert [ours[i][1] for i in hflm_right] == [theirs[i][1] for i in hflm_right]
    assert hflm_forwards == forwards[:batches]  # the same batches as HFLM's
    assert reads == ["tolist"] * batches and batches < len(requests)


def test_bfloat16_log_likelihoods_are_summed_in_full_precision(assets):
    """Each request's sum of token log-probabilities was accumulated in the model's dtype (`index_add_` rounds after
    every token): in bfloat16 a 60-token sum drifted by nats from the exact sum, and a 1024-token window's stopped near
    -2048, halving perplexities. The sum must be the float64 sum of the same bfloat16 token log-probabilities, within
    HFLM's one rounding of its total to bfloat16."""
    from lm_eval.models.huggingface import HFLM

    args = model_args(assets, "olmoe", num_devices=NUM_DEVICES) | {"dtype": "bfloat16"}
    lm = get_model("occult-hf").create_from_arg_obj(args, {"batch_size": 1})  # forwards of [1, S], as the reference's
    rng = random.Random(4)
    pairs = [([rng.randrange(3, 60) for _ in range(4)], [rng.randrange(3, 60) for _ in range(56 + i)]) for i in range(3)]
    requests = [((f"context {i}", f"continuation {i}"), context, continuation) for i, (context, continuation) in enumerate(pairs)]
    ours = [total for total, _ in lm._loglikelihood_tokens(requests)]
    exact = []
    for context, continuation in pairs:
        with torch.no_grad():
            logits = lm._model_call(torch.tensor([(context + continuation)[:-1]]))[0, -len(continuation) :]
        token_log_probs = torch.log_softmax(logits, dim=-1)[torch.arange(len(continuation)), torch.tensor(continuation)]
        assert token_log_probs.dtype == torch.bfloat16
        exact.append(float(token_log_probs.double().sum()))
    assert ours == pytest.approx(exact, rel=1e-9, abs=1e-9)
    theirs = [total for total, _ in HFLM._loglikelihood_tokens(lm, requests)]
    assert all(abs(o - t) <= abs(t) * 2**-8 for o, t in zip(ours, theirs)), (ours, theirs)


def test_occult_hf_names_a_request_it_cannot_score(assets):
    lm = get_model("occult-hf").create_from_arg_obj(model_args(assets, "olmoe", max_length=12), {"batch_size": 2})
    for context, continuation in (([], [5]), ([5], []), ([5], list(range(3, 16)))):
        with pytest.raises(ValueError, match="a request needs a context and a continuation of at most 12 tokens"):
            lm._loglikelihood_tokens([(("context", "continuation"), context, continuation)])


# ----- the same under 2-rank gloo expert parallelism -----------------------------------------------------


def ep_world(rank: int, world_size: int, assets: dict) -> dict:
    """The lockstep check, then every family, exact and pruned, through occult-hf on this EP world."""
    import occult_hf.eval  # noqa: F401  (registers occult-hf in this spawned process)

    report = {"lockstep": lockstep_check(rank, world_size)}
    skip_environment_report()
    task_manager = TaskManager(include_path=str(assets["tasks"]), include_defaults=False)
    for family in FAMILIES:
        for label, occult in (("exact", {"num_devices": world_size}), ("pruned", PRUNED)):
            lm = get_model("occult-hf").create_from_arg_obj(model_args(assets, family, **occult), {"batch_size": BATCH_SIZE})
            results = lm_eval.simple_evaluate(
                model=lm, tasks=["occ_mc", "occ_gen"], task_manager=task_manager, bootstrap_iters=0, log_samples=True
            )
            report["families", family, label] = {
                "outputs": None if results is None else outputs(results),
                "forwards": (lm._lockstep.real_forwards, lm._lockstep.idle_forwards),
                "world": (lm.rank, lm.world_size),
            }
    report["command checks"] = command_checks(rank, world_size, assets)  # last: it forms the world anew
    return report


def command_checks(rank: int, world_size: int, assets: dict) -> list[tuple]:
    """`occult eval` on this rank as a launcher that sets RANK and WORLD_SIZE itself starts it (srun, mpirun: no
    torchrun agent ends the others when one exits), so the command forms the EP group; per case, its (exit code,
    stderr, seconds). lm-eval's evaluation (the model load) must start only where every rank's checks passed."""
    import contextlib
    import io
    import os

    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(assets["port"]), RANK=str(rank), WORLD_SIZE=str(world_size))
    node = Path(assets["checks"]) / f"node{rank}"
    node.mkdir(parents=True)
    os.chdir(node)
    if rank == 0:
        (node / "out").touch()  # --output_path out: a file on rank 0's node only, the one rank that writes
    task_manager = TaskManager(include_path=str(assets["tasks"]), include_defaults=False)
    occult_eval.make_task_manager = lambda include_path: task_manager

    def evaluation(**kwargs):
        raise AssertionError("the evaluation started")

    lm_eval.simple_evaluate = evaluation
    command = ["eval", str(assets["models"]["olmoe"]), "--tasks", "occ_mc", "--device", "cpu"]
    outcomes = []
    for extra in (["--output_path", "out"], ["--output_path", "run", "--limit", "1"], ["--output_path", "run"]):
        stderr, start = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(stderr):
            try:
                code = occult_main([*command, *extra])
            except SystemExit as exit_:
                code = exit_.code
        outcomes.append((code, stderr.getvalue(), time.monotonic() - start))
    return outcomes


@pytest.fixture(scope="module")
def ep_reports(assets) -> list[dict]:
    """One spawned 2-rank gloo world (starting one costs seconds) for all EP checks; per-rank reports."""
    with socket.socket() as probe:  # a free port for the world `command_checks` forms
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    paths = {"tasks": assets["tasks"], "models": assets["models"], "checks": assets["root"] / "command_checks", "port": port}
    env = {**EVAL_ENV, "HF_DATASETS_CACHE": str(assets["cache"])}
    return run_world(ep_world, NUM_DEVICES, paths, env=env, timeout_s=240)


@pytest.mark.world_size(NUM_DEVICES)  # ep_reports runs the EP world
def test_expert_parallel_results_equal_one_process(ep_reports, runs):
    rank0, rank1 = ep_reports
    idle_forwards = 0
    for family in FAMILIES:
        for label, expected in (("exact", runs("hf", family)), ("pruned", runs("occult-hf", family, **PRUNED))):
            first, second = rank0["families", family, label], rank1["families", family, label]
            assert first["world"] == (0, NUM_DEVICES) and second["world"] == (1, NUM_DEVICES)
            assert second["outputs"] is None  # results come out once, on rank 0
            assert_same_outputs(first["outputs"], expected)
            assert sum(first["forwards"]) == sum(second["forwards"]), (family, label)
            idle_forwards += first["forwards"][1] + second["forwards"][1]
    assert idle_forwards > 0  # the ranks' own forward counts did differ, so the lockstep was needed


@pytest.mark.world_size(NUM_DEVICES)  # ep_reports runs the EP world
def test_a_check_that_fails_on_one_rank_stops_every_rank_before_the_model_loads(ep_reports):
    """Rank 0 refused an --output_path (a file on its node only) before the process group existed and exited; the
    other ranks waited for it in `init_process_group` until its 30-minute timeout. Every rank must fail within
    seconds with the reason; a --limit below the world size (a rank without documents, which lm-eval found only
    after the model loaded) is refused on every rank; checks that pass on every rank let the evaluation start."""
    (file0, limit0, passed0), (file1, limit1, passed1) = (report["command checks"] for report in ep_reports)
    assert file0[0] == 2 and "occult eval: --output_path 'out' is an existing file; give a folder" in file0[1]
    assert file1[0] == 2 and "rank 0 of the expert-parallel group failed at occult eval's checks before the model loads" in file1[1]
    assert "--output_path 'out' is an existing file" in file1[1]
    for code, err, _ in (limit0, limit1):
        assert code == 2 and "occult eval: --limit 1 leaves ranks [1] of the 2 without a document" in err
    for code, err, _ in (passed0, passed1):
        assert code == 2 and "AssertionError: the evaluation started" in err
    assert max(seconds for outcome in (file0, file1, limit0, limit1) for *_, seconds in [outcome]) < 30


# ----- the command lines ----------------------------------------------------------------------------------


def lm_eval_results_file(output_path: Path) -> dict:
    """The one `<output_path>/<model>/results_<time>.json` that lm-eval's layout puts there."""
    (written,) = output_path.rglob("results_*.json")
    return json.loads(written.read_text())


def test_occult_eval_writes_lm_eval_layout_and_table(assets, runs, full_task_manager, tmp_path, capsys, monkeypatch):
    def shared_manager(include_path):
        assert include_path == str(assets["tasks"])
        return full_task_manager

    monkeypatch.setattr(occult_eval, "make_task_manager", shared_manager)
    out = tmp_path / "run"
    argv = ["eval", str(assets["models"]["qwen3_moe"]), "--tasks", "occ_mc,occ_gen", "--include_path", str(assets["tasks"]),
            "--num-devices", str(NUM_DEVICES), "--device", "cpu", "--dtype", "float32", "--batch_size", str(BATCH_SIZE),
            "--bootstrap_iters", "0", "--output_path", str(out), "--log_samples"]  # fmt: skip
    assert occult_main(argv) == 0
    results = lm_eval_results_file(out)
    acc = runs("hf", "qwen3_moe")["occ_mc"]["metrics"]["acc,none"]
    assert results["results"]["occ_mc"]["acc,none"] == acc
    assert results["config"]["model"] == "occult-hf" and results["config"]["occult_config"]["num_devices"] == NUM_DEVICES
    assert len(list(out.rglob("samples_occ_mc_*.jsonl"))) == 1
    printed = capsys.readouterr().out  # lm-eval's make_table: header, then a row per task and metric
    assert "| Tasks |Version|Filter|n-shot|" in printed
    assert any(line.startswith("|occ_mc") and "|acc" in line.replace(" ", "") for line in printed.splitlines())
    assert "Headline rows" not in printed and "Average" not in printed  # the paper's table is occult23's alone


def test_occult_eval_of_a_directory_occult_hf_saved(assets, runs, local_task_manager, tmp_path, monkeypatch):
    """A fine-tune's or a run's output carries its occult_config; evaluating it used to fail JSON-dumping
    the OccultConfig object that the loader put on the transformers config."""
    import shutil

    from transformers import AutoModelForCausalLM

    from occult_hf import OccultConfig, apply_occult

    source = assets["models"]["olmoe"]
    saved = tmp_path / "saved"
    model = AutoModelForCausalLM.from_pretrained(source, occult_config=None, dtype=torch.float32)
    apply_occult(model, OccultConfig(num_devices=NUM_DEVICES)).save_pretrained(saved)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, saved / name)
    monkeypatch.setattr(occult_eval, "make_task_manager", lambda include_path: local_task_manager)
    out = tmp_path / "run"
    argv = ["eval", str(saved), "--tasks", "occ_mc", "--device", "cpu", "--dtype", "float32", "--bootstrap_iters", "0",
            "--batch_size", str(BATCH_SIZE), "--output_path", str(out)]  # fmt: skip
    assert occult_main(argv) == 0
    results = lm_eval_results_file(out)
    assert results["results"]["occ_mc"]["acc,none"] == runs("hf", "olmoe")["occ_mc"]["metrics"]["acc,none"]


def test_lm_eval_command_line_finds_occult_hf(assets, runs, tmp_path, monkeypatch):
    """`python -m occult_hf.eval run --model occult-hf ...` is lm-eval's own CLI with occult-hf registered."""
    from occult_hf.eval.__main__ import main as lm_eval_main

    model_args = f"pretrained={assets['models']['olmoe']},num_devices={NUM_DEVICES},dtype=float32"
    argv = ["python -m occult_hf.eval", "run", "--model", "occult-hf", "--model_args", model_args, "--tasks", "occ_mc",
            "--include_path", str(assets["tasks"]), "--device", "cpu", "--batch_size", str(BATCH_SIZE),
            "--output_path", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    lm_eval_main()
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["results"]["occ_mc"]["acc,none"] == runs("hf", "olmoe")["occ_mc"]["metrics"]["acc,none"]


def test_eval_of_a_pruned_checkpoint_applies_its_pruning(tmp_path):
    """Issue 32: a pruned fine-tune loaded without occult_hf runs unpruned; `occult eval` (the `occult-hf`
    model with no Occult settings given) must run it with the pruning it was saved with."""
    from tiny_models import tiny_batch, tiny_model

    from occult_hf import OccultConfig, apply_occult, occult_config_of
    from occult_hf.eval.model import load_occult_model

    pruned = OccultConfig(num_devices=NUM_DEVICES, prune="router", max_devices_per_token=1)
    model = apply_occult(tiny_model("olmoe", seed=3), pruned).eval()
    model.save_pretrained(tmp_path / "pruned")
    loaded = load_occult_model(str(tmp_path / "pruned"), None, device=torch.device("cpu"), dtype="float32")
    config = occult_config_of(loaded)
    assert (config.prune, config.max_devices_per_token, config.num_devices) == ("router", 1, NUM_DEVICES)
    batch = tiny_batch(batch=2, seq=16, seed=1)
    with torch.no_grad():
        expected, got = model(input_ids=batch).logits, loaded(input_ids=batch).logits
        unpruned = tiny_model("olmoe", seed=3)(input_ids=batch).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, unpruned, rtol=1e-3, atol=1e-4)  # the pruning changes the logits: the check can fail


def test_occult_offline_runs_on_the_shipped_model_without_a_download(full_task_manager, tmp_path, capsys, monkeypatch):
    """Issue 32: no runnable lm-eval task shipped (occult23 needs the hub). `occult eval --tasks occult_offline`
    with no model evaluates the shipped tiny OLMoE on text the package ships, offline (EVAL_ENV)."""
    monkeypatch.setattr(occult_eval, "make_task_manager", lambda include_path: full_task_manager)
    out = tmp_path / "offline"
    assert occult_main(["eval", "--tasks", "occult_offline", "--device", "cpu", "--bootstrap_iters", "0",
                        "--output_path", str(out), "--no-progress"]) == 0  # fmt: skip
    results = lm_eval_results_file(out)["results"]
    assert 0.0 <= results["occult_offline_nextline"]["acc,none"] <= 1.0
    assert results["occult_offline_ppl"]["byte_perplexity,none"] > 1.0
    captured = capsys.readouterr()
    assert "evaluating the shipped tiny OLMoE" in captured.out
    assert "%|" not in captured.err  # no bar: lm-eval's request building draws one per task unless told


def test_rolling_loglikelihood_uses_the_batched_scorer_and_hides_its_bars(assets, capsys, monkeypatch):
    """Perplexity tasks: lm-eval's `loglikelihood_rolling` scores each batch of windows through
    `_loglikelihood_tokens(..., disable_tqdm=False, override_bs=...)`. `occult-hf` scores them with its batched
    scorer too (not HFLM's per-request loop), draws no request bar when HF's progress switches are off
    (`occult eval --no-progress`), and its perplexities equal stock `hf`'s."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import occult_hf.eval.model as occult_model
    from occult_hf.eval.scoring import score_requests
    from occult_hf.utils.progress import progress_bars_off

    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(length)) for length in (30, 17, 25)]
    requests = [Instance("loglikelihood_rolling", {}, (text,), idx) for idx, text in enumerate(texts)]
    create = lambda model, **occult: get_model(model).create_from_arg_obj(  # noqa: E731
        model_args(assets, "olmoe", max_length=12, **occult), {"batch_size": BATCH_SIZE})
    expected = create("hf").loglikelihood_rolling(requests, disable_tqdm=True)
    lm = create("occult-hf", num_devices=NUM_DEVICES)
    calls = {"batched": 0, "per_request": 0}

    def counted(kind, scorer):
        def call(*args, **kwargs):
            calls[kind] += 1
            return scorer(*args, **kwargs)

        return call

    monkeypatch.setattr(occult_model, "score_requests", counted("batched", score_requests))
    monkeypatch.setattr(HFLM, "_loglikelihood_tokens", counted("per_request", HFLM._loglikelihood_tokens))
    capsys.readouterr()
    with progress_bars_off():
        got = lm.loglikelihood_rolling(requests)
    bars = capsys.readouterr().err
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert calls["batched"] > 1 and calls["per_request"] == 0  # several batches of windows, none in HFLM's loop
    assert "Running loglikelihood requests" not in bars and "%|" not in bars
