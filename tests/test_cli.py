"""`occult profile / place / report / demo` through `occult_hf.cli.main`, in temporary directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from occult_hf.cli import main
from occult_hf.placement import Placement
from occult_hf.profile import RoutingProfile

REPO = Path(__file__).resolve().parents[1]
ROUTING = REPO / ".." / "shared" / "data" / "routing"
QWEN_TRACE = ROUTING / "qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"
OLMOE_PAIRS = ROUTING / "olmoe1b7b0125__runB_2025-03-07__wikitext2_8192tok_coact.npz"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def table_rows(printed: str) -> list[list[str]]:
    """The cells of every markdown table line the command printed (headers and separator rows included)."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("|")]


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"real routing data the project does not ship: {QWEN_TRACE} not present")
def test_trace_to_profile_to_placement_to_report(tmp_path, capsys):
    profile_path, placement_path = tmp_path / "qwen.safetensors", tmp_path / "occult_placement.json"
    assert main(["profile", "--from-trace", str(QWEN_TRACE), "--out", str(profile_path), "--model-type", "qwen2_moe"]) == 0
    profile = RoutingProfile.load(profile_path)
    assert (profile.num_experts, profile.top_k, profile.model_type) == (60, 4, "qwen2_moe")
    assert "tokens per layer 4384" in capsys.readouterr().out

    assert main(["place", str(profile_path), "--num-devices", "8", "--method", "occult", "--out", str(placement_path)]) == 0
    placement = Placement.load(placement_path)
    assert placement.num_devices == 8 and placement.meta["method"] == "occult"
    assert sorted(placement.capacities(0)) == [7, 7, 7, 7, 8, 8, 8, 8]  # E=60 on 8 devices
    printed = capsys.readouterr().out
    assert {row[1] for row in table_rows(printed) if row[0] == "mean"} == {"contiguous", "occult"}

    plots = tmp_path / "plots"
    assert main(["report", str(profile_path), str(placement_path), "--num-devices", "8", "--methods", "contiguous,refined",
                 "--option", "max_load_ratio=1.2", "--plots", str(plots)]) == 0
    printed = capsys.readouterr().out
    rows = {row[1]: row for row in table_rows(printed) if row[0] == "0"}
    assert sorted(rows) == ["contiguous", "occult", "refined"]
    ct = {name: float(row[3]) for name, row in rows.items()}
    assert ct["refined"] < ct["contiguous"] and ct["occult"] < ct["contiguous"]  # real routing has structure
    assert rows["refined"][4] == "1-4"  # CT bound for capacities 7-8 and k=4
    assert is_png(plots / "ct_by_layer.png") and is_png(plots / "coactivation_layer0.png")


@pytest.mark.skipif(not OLMOE_PAIRS.is_file(), reason=f"real routing data the project does not ship: {OLMOE_PAIRS} not present")
def test_pair_count_profile_reports_cut_without_ct(tmp_path, capsys):
    profile_path = tmp_path / "olmoe.safetensors"
    main(["profile", "--from-trace", str(OLMOE_PAIRS), "--out", str(profile_path)])
    assert "pair counts only" in capsys.readouterr().out
    main(["report", str(profile_path), "--num-devices", "4", "--methods", "contiguous,occult", "--no-plots"])
    printed = capsys.readouterr().out
    layer_rows = [row for row in table_rows(printed) if row[0] == "15"]
    assert [row[1] for row in layer_rows] == ["contiguous", "occult"]
    assert all(row[3] == "-" and float(row[6]) > 0 for row in layer_rows)  # CT unknown, cut per token known


DOCUMENTS = ["the train left at nine", "bread rises slowly", "", "the bread left the train at nine nine"]


def tiny_model_dir(tmp_path):
    """A saved tiny OLMoE with a word-level tokenizer over the words of DOCUMENTS."""
    from tiny_models import tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "tiny-olmoe"
    tiny_model("olmoe").save_pretrained(model_dir)
    words = ["the", "train", "left", "at", "nine", "bread", "rises", "slowly"]
    vocab = {"[PAD]": 0, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(model_dir)
    return model_dir


def test_profile_command_on_a_saved_model_with_text_and_dataset(tmp_path, capsys):
    import datasets

    model_dir = tiny_model_dir(tmp_path)
    text = tmp_path / "docs.txt"
    documents = DOCUMENTS
    text.write_text("\n".join(documents))

    out = tmp_path / "p.safetensors"
    assert main(["profile", str(model_dir), "--text", str(text), "--out", str(out), "--max-length", "4",
                 "--batch-size", "2", "--sample-size", "6"]) == 0
    profile = RoutingProfile.load(out)
    assert sorted(profile.layers) == [0, 1] and profile.model_type == "olmoe"
    assert profile.layer(0).token_count == 5 + 3 + 8
    assert profile.layer(1).topk_sample.shape == (6, 2)
    assert "tiny-olmoe on" in profile.meta["source"]

    dataset_dir = tmp_path / "dataset"
    datasets.Dataset.from_dict({"body": documents}).save_to_disk(str(dataset_dir))
    out_ds = tmp_path / "d.safetensors"
    main(["profile", str(model_dir), "--dataset", str(dataset_dir), "--text-column", "body", "--out", str(out_ds),
          "--max-length", "4"])
    np.testing.assert_array_equal(RoutingProfile.load(out_ds).layer(1).coactivation, profile.layer(1).coactivation)
    capsys.readouterr()


def test_profile_reads_local_files_and_dataset_configs_through_datasets(tmp_path, capsys):
    """JSON Lines, CSV and Parquet files are parsed (not read as raw lines), `--text-column` picks the
    column, `--dataset-config` selects a configuration of a local dataset directory; structured files
    given to `--text` and configurations given for a single file are errors."""
    import datasets

    model_dir = tiny_model_dir(tmp_path)
    documents = [d for d in DOCUMENTS if d]
    common = ["--max-length", "4", "--sample-size", "0"]
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(documents))
    assert main(["profile", str(model_dir), "--text", str(text), "--out", str(tmp_path / "t.safetensors"), *common]) == 0
    expected = RoutingProfile.load(tmp_path / "t.safetensors").layer(1).coactivation
    table = datasets.Dataset.from_dict({"id": list(range(len(documents))), "body": documents})
    table.to_json(tmp_path / "docs.jsonl")
    table.to_csv(tmp_path / "docs.csv", index=False)
    table.to_parquet(tmp_path / "docs.parquet")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: other\n  data_files: other.jsonl\n- config_name: docs\n  data_files: docs.jsonl\n---\n"
    )
    datasets.Dataset.from_dict({"body": ["slowly slowly"] * 3}).to_json(repo / "other.jsonl")
    table.to_json(repo / "docs.jsonl")
    sources = [["docs.jsonl"], ["docs.csv"], ["docs.parquet"], ["repo", "--dataset-config", "docs"]]
    for i, source in enumerate(sources):
        out = tmp_path / f"p{i}.safetensors"
        argv = ["profile", str(model_dir), "--dataset", str(tmp_path / source[0]), *source[1:], "--text-column", "body"]
        assert main([*argv, "--out", str(out), *common]) == 0, source
        np.testing.assert_array_equal(RoutingProfile.load(out).layer(1).coactivation, expected, err_msg=str(source))
    errors = [
        (["--text", str(tmp_path / "docs.jsonl")], "is a json file, which --text would read as raw lines"),
        (["--dataset", str(tmp_path / "docs.jsonl"), "--text-column", "body", "--dataset-config", "x"], "has no configurations"),
        (["--dataset", str(tmp_path / "docs.csv")], "text column 'text' is not in"),
    ]
    for argv, message in errors:
        with pytest.raises(SystemExit):
            main(["profile", str(model_dir), *argv, "--out", str(tmp_path / "x.safetensors")])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "PROFILE"], "give placement files, or --num-devices D"),
        (["report"], "run `occult demo`"),
        (["profile", "some/model", "--from-trace", "TRACE", "--out", "x"], "give MODEL or --from-trace, not both"),
        (["profile", "--text", "docs.txt", "--out", "x"], "MODEL is required with --text or --dataset"),
    ],
)
def test_command_line_errors_say_what_to_do(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative paths name nothing: an `x` directory where pytest runs is another error
    argv = [str(tmp_path / "p.safetensors") if a == "PROFILE" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err  # a usage error: argparse's code


@pytest.mark.parametrize("command", ["place", "report"])
def test_a_malformed_planner_option_is_the_subcommands_usage_error(command, tmp_path, capsys):
    argv = [command, str(tmp_path / "p.safetensors"), "--num-devices", "2", "--option", "max_load_ratio"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"occult {command}: error: argument --option: expected NAME=VALUE, got 'max_load_ratio'" in capsys.readouterr().err


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason=f"real routing data the project does not ship: {QWEN_TRACE} not present")
def test_unknown_planner_option_is_named(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    RoutingProfile.from_trace(QWEN_TRACE).save(path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(path), "--num-devices", "4", "--methods", "contiguous", "--option", "seed=1"])
    assert exit_info.value.code == 2 and "no method in ['contiguous'] has option(s) ['seed']" in capsys.readouterr().err


def test_demo_main_job_runs_end_to_end(tmp_path, capsys):
    """At its defaults, as README.md and docs/cli.md quote it: the demo's text is a frozen snapshot
    (`data/demo_sources.json.xz`), not the installed sources, so the quoted figures are what every
    version and every install (editable or wheel) prints."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cli_doc, readme = (REPO / "docs" / "cli.md").read_text(), (REPO / "README.md").read_text()
    first_cell = lambda line: line.strip("|").split("|")[0].strip()  # noqa: E731
    quoted = [line for line in printed.splitlines() if line.startswith("|") and (first_cell(line) == "mean" or " / " in line and first_cell(line).isdigit())]
    assert len(quoted) == 3 + 4 and all(line in cli_doc for line in quoted), quoted  # the mean rows, the pruning rows
    figures = re.search(
        r"held-out CT is ([\d.]+) \(contiguous\), ([\d.]+) \(occult\) and ([\d.]+) \(refined, which keeps device load at "
        r"([\d.]+)x the mean where occult reaches ([\d.]+)x\)", " ".join(readme.split())
    )
    mean_of = {row[1]: row for row in table_rows(printed) if row[0] == "mean"}
    assert figures.groups() == (
        mean_of["contiguous"][3], mean_of["occult"][3], mean_of["refined"][3], mean_of["refined"][7], mean_of["occult"][7]
    )
    assert "occult demo: an OlmoeForCausalLM trained from scratch by `occult train --recipe tiny`" in printed
    assert "text it never trained on" in printed
    methods = ("contiguous", "occult", "refined")
    rows = [r for r in table_rows(printed) if len(r) > 5 and r[0].isdigit() and r[1] in methods]
    assert sorted({(int(r[0]), r[1]) for r in rows}) == [
        (layer, method) for layer in range(4) for method in ("contiguous", "occult", "refined")
    ]
    means = {row[1]: row for row in table_rows(printed) if row[0] == "mean"}
    ct = {name: float(row[3]) for name, row in means.items()}
    # learned routing has co-activation structure: the collaboration-aware planners beat contiguous held out
    assert ct["occult"] < ct["contiguous"] and ct["refined"] < ct["contiguous"]
    pruning = json.loads((out / "pruning.json").read_text())
    for method in ("contiguous", "occult", "refined"):
        removed = [pruning[f"{method}/N_d={n}"]["removed_weight"] for n in (1, 2, 3, 4)]
        assert removed[0] > removed[1] > removed[2] > removed[3] == 0.0  # fewer devices, more weight removed; N_d = k none
    assert pruning["refined/N_d=2"]["removed_weight"] < pruning["contiguous/N_d=2"]["removed_weight"]
    for name in ("profile_plan.safetensors", "profile_held_out.safetensors"):
        assert RoutingProfile.load(out / name).model_type == "olmoe"
    for method in ("contiguous", "occult", "refined"):
        assert json.loads((out / f"placement_{method}.json").read_text())["num_devices"] == 8
    assert is_png(out / "ct_by_layer.png") and is_png(out / "coactivation_layer0.png")


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`occult demo | head -1`: the command stops when its reader closes the pipe, with no error line and the status a
    shell gives a tool that SIGPIPE ended (it had printed "error: [Errno 32] Broken pipe" and exit code 2)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "occult_hf.cli", "demo", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert process.stdout.readline().startswith(b"occult demo:")
    process.stdout.close()
    assert (process.wait(timeout=300), process.stderr.read()) == (141, b"")


def test_place_several_profiles_with_replicas_prints_the_promises(tmp_path, capsys):
    from occult_hf.placement.validation import profile_from_sample
    from occult_hf.eval.studies.placement_study import structured_topk

    paths = []
    for name, seed in (("prefill", 0), ("decode", 1)):
        popularity = np.linspace(1, 4, 16)[:: 1 if seed == 0 else -1]
        profile = profile_from_sample({0: structured_topk(400, 16, 4, 4, popularity, seed=seed)}, 16, name)
        paths.append(tmp_path / f"{name}.safetensors")
        profile.save(paths[-1])
    out = tmp_path / "occult_placement.json"
    argv = ["place", *map(str, paths), "--num-devices", "4", "--option", "num_redundant_experts=4", "--option", "search_rounds=2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "expected held-out (2-fold cross-validation" in printed and "worst of 2 profiles: layer 0" in printed
    assert "slots per device" in printed
    placement = Placement.load(out)
    assert placement.slots_per_device == 5 and placement.has_replicas
    assert main(["report", str(paths[0]), str(out), "--no-plots"]) == 0
    assert "expected held-out (2-fold" in capsys.readouterr().out


def test_replan_keeps_primaries_and_moves_the_copies_to_what_is_hot_now(tmp_path, capsys):
    """`occult replan`: a placement planned with replicas on one profile, re-planned on one where other experts
    are hot; the primaries stay, the copies move, and the recent load's max device drops."""
    from occult_hf.metrics import evaluate_placement
    from occult_hf.placement.validation import profile_from_sample
    from occult_hf.eval.studies.placement_study import structured_topk

    paths = {}
    for name, order in (("planned", 1), ("recent", -1)):  # the hot experts of "recent" are the cold ones of "planned"
        popularity = np.geomspace(1, 30, 16)[::order]
        paths[name] = tmp_path / f"{name}.safetensors"
        profile_from_sample({0: structured_topk(600, 16, 4, 4, popularity, seed=order % 3)}, 16, name).save(paths[name])
    deployed_path, replanned_path = tmp_path / "deployed.json", tmp_path / "replanned.json"
    argv = ["place", str(paths["planned"]), "--num-devices", "4", "--option", "num_redundant_experts=4",
            "--cross-validate", "0", "--out", str(deployed_path)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["replan", str(deployed_path), str(paths["recent"]), "--out", str(replanned_path)]) == 0
    printed = capsys.readouterr().out
    assert {row[1] for row in table_rows(printed) if row[0] == "mean"} == {"deployed", "replanned"}
    deployed, replanned = Placement.load(deployed_path), Placement.load(replanned_path)
    assert replanned.device_of(0) == deployed.device_of(0)  # primaries kept
    copies = sum(map(len, replanned.replicas[0].values()))
    assert sum(map(len, deployed.replicas[0].values())) == 4 and 0 < copies <= 4  # fewer when one more would not help
    assert set(replanned.replicas[0]) != set(deployed.replicas[0])  # other experts are copied
    recent = RoutingProfile.load(paths["recent"])
    before, after = (evaluate_placement(recent, p)[0] for p in (deployed, replanned))
    assert after.balance < before.balance, (before.balance, after.balance)
    # --replica-choice load_aware: copies chosen for the load-aware rule (fluid bound, then CT), as the library does
    aware_path = tmp_path / "aware.json"
    capsys.readouterr()
    assert main(["replan", str(deployed_path), str(paths["recent"]), "--replica-choice", "load_aware", "--out", str(aware_path)]) == 0
    assert "(both measured under the static replica rule; the copies were chosen for the load-aware rule" in capsys.readouterr().out
    from occult_hf.placement.rebalance import replan_replicas

    aware = Placement.load(aware_path)
    assert aware.replicas == replan_replicas(deployed, recent, replica_choice="load_aware").replicas != replanned.replicas

    # a profile of another model (another expert count) is named, not planned on
    profile_from_sample({0: structured_topk(100, 8, 2, 4, np.ones(8), seed=0)}, 8, "other").save(tmp_path / "other.safetensors")
    with pytest.raises(SystemExit):
        main(["replan", str(deployed_path), str(tmp_path / "other.safetensors"), "--out", str(tmp_path / "x.json")])
    assert "the profile has 8 routed experts but the placement is for num_experts=16" in capsys.readouterr().err


def test_demo_measures_pruning_on_every_held_out_token(tmp_path, capsys, monkeypatch):
    """The pruning table took the full 128-token windows only: `--tokens 100` gave NaN cells and then a crash
    writing pruning.json, `--tokens 200` measured 128 of the 200 tokens."""
    from occult_hf.training import evaluate

    captured, capture = [], evaluate.capture_routing
    monkeypatch.setattr(evaluate, "capture_routing", lambda model, windows_BS: captured.append(windows_BS.size) or capture(model, windows_BS))
    for tokens in (100, 200):
        captured.clear()
        assert main(["demo", "--tokens", str(tokens), "--no-plots", "--out", str(tmp_path / str(tokens))]) == 0
        assert sum(captured) == tokens
        pruning = json.loads((tmp_path / str(tokens) / "pruning.json").read_text())
        assert all(0.0 <= cell[key] <= 1.0 for cell in pruning.values() for key in ("removed_weight", "tokens_pruned"))
    capsys.readouterr()


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_demo_runs_any_supported_family_and_names_it(family, tmp_path, capsys):
    """Issue 32: `occult demo --model <a Qwen-MoE dir>` failed (`found no MoE blocks in OlmoeModel`: the
    demo hard-coded OlmoeForCausalLM) and called any model "the shipped tiny OLMoE"."""
    from tiny_models import save_tiny_tokenizer, tiny_checkpoint

    checkpoint = save_tiny_tokenizer(tiny_checkpoint(family, tmp_path / family))
    assert main(["demo", "--model", str(checkpoint), "--tokens", "256", "--no-plots", "--num-devices", "4",
                 "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"occult demo: the {family.split('_')[0].capitalize()}" in printed and str(checkpoint) in printed
    assert "shipped tiny OLMoE" not in printed and "Collaboration pruning to N_d" in printed
