"""`occult place / replan / report / demo`: outputs and numeric flags checked before the run, the file a command wrote
named, one-line errors that say what is missing, and `OccultConfig.save` + `load` naming the same files."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from occult_hf import OccultConfig
from occult_hf.cli import main
from occult_hf.utils.errors import one_line
from occult_hf.placement import PLACEMENT_FILENAME, Placement
from occult_hf.placement.validation import profile_from_sample


@pytest.fixture
def files(tmp_path):
    """A 2-layer routing profile (E=16, k=4) and a contiguous placement of it on 4 devices."""
    from occult_hf.eval.studies.placement_study import structured_topk

    layers = {layer: structured_topk(200, 16, 4, 4, np.linspace(1, 3, 16), seed=layer) for layer in (0, 1)}
    profile, placement = tmp_path / "p.safetensors", tmp_path / "p4.json"
    profile_from_sample(layers, 16, "test").save(profile)
    Placement.contiguous(16, 4, [0, 1]).save(placement)
    return profile, placement


def refused(argv: list[str], capsys) -> str:
    """The one line `occult` printed for `argv`, which must end in exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _never(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran before the command checked its arguments")

    return fail


@pytest.mark.parametrize("command", ["place", "replan"])
def test_place_and_replan_check_out_before_planning(command, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("occult_hf.placement.plan_placement", _never("plan_placement"))
    monkeypatch.setattr("occult_hf.placement.rebalance.replan_replicas", _never("replan_replicas"))
    profile, placement = files
    inputs = [str(profile), "--num-devices", "4"] if command == "place" else [str(placement), str(profile)]
    out = tmp_path / "missing" / "x.json"
    err = refused([command, *inputs, "--out", str(out)], capsys)
    assert f"occult {command}: error: --out {str(out)!r}: directory {str(out.parent)!r} does not exist" in err
    if os.path.isdir("/proc"):  # a folder nobody can create a file in, even root
        err = refused([command, *inputs, "--out", "/proc/x.json"], capsys)
        assert f"occult {command}: error: --out '/proc/x.json': cannot write in directory '/proc' (" in err, err


@pytest.mark.parametrize("command", ["place", "replan", "profile"])
def test_an_out_path_ending_in_a_separator_is_refused_before_any_work(command, files, tmp_path, capsys, monkeypatch):
    """`--out newdir/` passed the check (abspath drops the separator) and failed after the work with a bare
    "[Errno 20] Not a directory"."""
    monkeypatch.setattr("occult_hf.placement.plan_placement", _never("plan_placement"))
    monkeypatch.setattr("occult_hf.placement.rebalance.replan_replicas", _never("replan_replicas"))
    monkeypatch.setattr("occult_hf.profile.RoutingProfile.from_trace", _never("RoutingProfile.from_trace"))
    profile, placement = files
    inputs = {"place": [str(profile), "--num-devices", "4"], "replan": [str(placement), str(profile)],
              "profile": ["--from-trace", str(tmp_path / "t.npz")]}[command]  # fmt: skip
    out = f"{tmp_path / 'newdir'}{os.sep}"
    err = refused([command, *inputs, "--out", out], capsys)
    expected = "ends with a separator: a directory, expected a file path" if command == "profile" else f"directory {out!r} does not exist"
    assert f"occult {command}: error: --out {out!r}" in err and expected in err, err


def test_an_out_path_that_is_an_input_is_refused_before_any_work(files, tmp_path, capsys, monkeypatch):
    """Each wrote over its input with exit code 0: the trace or profile was gone. `replan` over its PLACEMENT is the
    documented use and stays allowed."""
    monkeypatch.setattr("occult_hf.placement.plan_placement", _never("plan_placement"))
    profile, placement = files
    trace = tmp_path / "t.npz"
    np.savez(trace, topk_ids=np.arange(8).reshape(4, 2))
    before = {path: path.read_bytes() for path in (profile, trace)}
    cases = [(["profile", "--from-trace", str(trace), "--out", str(trace)], f"occult profile: --out {str(trace)!r} is the --from-trace {str(trace)!r}"),
             (["place", str(profile), "--num-devices", "4", "--out", str(profile)], f"occult place: --out {str(profile)!r} is the PROFILE"),
             (["replan", str(placement), str(profile), "--out", str(profile)], f"occult replan: --out {str(profile)!r} is the PROFILE")]  # fmt: skip
    for argv, message in cases:
        err = refused(argv, capsys)
        assert message in err and "writing there would replace it" in err, err
    assert {path: path.read_bytes() for path in before} == before
    assert main(["replan", str(placement), str(profile), "--out", str(placement)]) == 0
    assert "the replicas are unchanged" in capsys.readouterr().out  # a contiguous placement has no slot for one


def test_no_progress_and_debug_anywhere_and_ctrl_c_in_one_line(files, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("occult_hf.placement.plan_placement", interrupted)
    argv = ["--no-progress", "place", str(files[0]), "--num-devices", "4", "--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "occult place: interrupted\n"


@pytest.mark.parametrize(
    "option, message",
    [
        ("devices_per_node=2", "occult place: give devices_per_node as --devices-per-node, not as --option"),
        ("cross_validate=3", "occult place: give cross_validate as --cross-validate, not as --option"),
        ("method=occult", "occult place: give method as --method, not as --option"),
        ("layers=[0]", "placement method 'refined' has no option(s) ['layers']; its options are ['max_load_ratio'"),
        ("progress=true", "placement method 'refined' has no option(s) ['progress']"),
    ],
)
def test_place_refuses_options_that_are_not_the_planners_before_planning(option, message, files, tmp_path, capsys, monkeypatch):
    """Such names had reached plan_placement's own keywords: Python's "got multiple values" error, or (`layers`) a
    one-layer placement written before the error, or (`progress`) nothing said."""
    monkeypatch.setattr("occult_hf.placement.plan_placement", _never("plan_placement"))
    profile, _ = files
    out = tmp_path / "o.json"
    err = refused(["place", str(profile), "--num-devices", "4", "--option", option, "--out", str(out)], capsys)
    assert message in err and not out.exists(), err


def test_report_suggests_the_option_a_typo_meant(files, capsys):
    err = refused(["report", str(files[0]), "--num-devices", "4", "--option", "max_load_raito=1.1", "--no-plots"], capsys)
    assert "no method in" in err and "has option(s) ['max_load_raito'] (did you mean 'max_load_ratio'?)" in err, err


def test_report_refuses_an_option_that_is_its_own_flag(files, capsys):
    """`occult report --option devices_per_node=2` had reached plan_placement twice: Python's "got multiple values"."""
    err = refused(["report", str(files[0]), "--num-devices", "4", "--option", "devices_per_node=2", "--no-plots"], capsys)
    assert "occult report: give devices_per_node as --devices-per-node, not as --option" in err, err


@pytest.mark.parametrize("command", ["place", "replan"])
def test_place_and_replan_name_the_file_written_into_an_out_directory(command, files, tmp_path, capsys):
    profile, placement = files
    inputs = [str(profile), "--num-devices", "4", "--cross-validate", "0"] if command == "place" else [str(placement), str(profile)]
    out = tmp_path / "deploy"
    out.mkdir()
    assert main([command, *inputs, "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / PLACEMENT_FILENAME}"
    assert Placement.load(out / PLACEMENT_FILENAME).num_devices == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-devices", "4", "--cross-validate", "1"], "argument --cross-validate: expected 0 or an integer >= 2, got 1"),
        (["--num-devices", "4", "--cross-validate", "-2"], "argument --cross-validate: expected 0 or an integer >= 2, got -2"),
        (["--num-devices", "0"], "argument --num-devices/--num_devices: expected an integer >= 1, got 0"),
        (["--num-devices", "4", "--devices-per-node", "3"], "--devices-per-node=3 does not divide num_devices=4"),
    ],
)
def test_place_checks_its_numbers_before_planning(flags, message, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("occult_hf.placement.planning.plan_profiles", _never("plan_profiles"))
    err = refused(["place", str(files[0]), *flags, "--out", str(tmp_path / "x.json")], capsys)
    assert f"occult place: error: {message}" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hidden-size", "-5000", "--devices-per-node", "2"], "argument --hidden-size: expected an integer >= 1, got -5000"),
        (["--heatmap-layer", "-1"], "argument --heatmap-layer: expected an integer >= 0, got -1"),
        (["--heatmap-layer", "99"], "--heatmap-layer 99 is not a layer of the routing profile (it has [0, 1])"),
        (["--num-devices", "0"], "argument --num-devices/--num_devices: expected an integer >= 1, got 0"),
        (["--num-devices", "4", "--devices-per-node", "0"], "argument --devices-per-node/--devices_per_node: expected an integer >= 1, got 0"),
    ],
)
def test_report_checks_its_numbers_before_any_work(flags, message, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("occult_hf.placement.plan_placement", _never("plan_placement"))
    plots = tmp_path / "plots"
    err = refused(["report", *map(str, files), *flags, "--plots", str(plots)], capsys)
    assert message in err
    assert not plots.exists()  # no plot written before the error


@pytest.mark.parametrize("plots, message", [("afile", "is an existing file"), ("afile/sub", "lies under the file")])
def test_report_plots_that_cannot_be_a_directory_are_named_before_any_work(plots, message, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("occult_hf.report.evaluate_placements", _never("evaluate_placements"))
    (tmp_path / "afile").write_text("")
    err = refused(["report", *map(str, files), "--plots", str(tmp_path / plots)], capsys)
    assert f"occult report: error: --plots {str(tmp_path / plots)!r} {message}" in err
    if plots == "afile" and os.path.isdir("/proc"):  # a folder nobody can create a file in, even root (os.access says yes)
        err = refused(["report", *map(str, files), "--plots", "/proc/plots"], capsys)
        assert "occult report: error: --plots '/proc/plots': directory '/proc' is not writable" in err, err


def test_report_prints_its_table_before_a_plot_fails(files, tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("occult_hf.report.plot_coactivation", disk_full)
    with pytest.raises(SystemExit):
        main(["report", *map(str, files), "--plots", str(tmp_path / "plots")])
    printed = capsys.readouterr()
    assert "No space left on device" in printed.err
    assert [line.split("|")[2].strip() for line in printed.out.splitlines() if line.startswith("|    mean")] == ["contiguous"]


def test_demo_checks_num_devices_before_profiling(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("occult_hf.profile.RoutingProfile.collect", _never("RoutingProfile.collect"))
    out = tmp_path / "demo"
    err = refused(["demo", "--num-devices", "0", "--tokens", "256", "--no-plots", "--out", str(out)], capsys)
    assert "occult demo: error: argument --num-devices/--num_devices: expected an integer >= 1, got 0" in err
    assert not out.exists()


def _shipped_copy(tmp_path):
    from occult_hf.training.shipped import tiny_checkpoint_path

    return shutil.copytree(tiny_checkpoint_path(), tmp_path / "model")


def test_demo_of_a_model_whose_recipe_lacks_a_key_describes_it_by_its_class(tmp_path, capsys):
    model = _shipped_copy(tmp_path)
    recipe = json.loads((model / "recipe.json").read_text())
    del recipe["name"]
    (model / "recipe.json").write_text(json.dumps(recipe))
    argv = ["demo", "--model", str(model), "--tokens", "256", "--num-devices", "4", "--no-plots", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert f"occult demo: the OlmoeForCausalLM checkpoint {model} (model_type 'olmoe', E=32, k=4, 4 layers)." in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, text",
    [("recipe.json", "[1, 2]"), ("train_log.json", '"a log"'), ("train_log.json", '{"parameters": "many"}')],
)
def test_recipe_and_log_of_another_shape_give_the_class_and_shape(name, text, tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf.cli.demo import describe_checkpoint

    model_dir = _shipped_copy(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, occult_config=None)
    assert describe_checkpoint(model_dir, model).startswith("an OlmoeForCausalLM trained from scratch")
    (model_dir / name).write_text(text)
    assert describe_checkpoint(model_dir, model) == f"the OlmoeForCausalLM checkpoint {model_dir} (model_type 'olmoe', E=32, k=4, 4 layers)"


@pytest.mark.parametrize(
    "error, line",
    [
        (KeyError("name"), "missing key 'name'"),
        (KeyError(3), "missing key 3"),
        (KeyError("placement 'p.json' has no layer 3"), "placement 'p.json' has no layer 3"),
    ],
)
def test_a_key_error_says_which_key_is_missing(error, line):
    assert one_line(error) == line


def test_config_save_and_load_name_the_same_files(files, tmp_path, monkeypatch):
    """Relative paths are the working directory's in memory and the file's directory on disk: saved below the
    file's directory they stay relative (the two move together), else they are written absolute."""
    profile, placement = files
    (tmp_path / "sub").mkdir()
    shutil.copy(placement, tmp_path / "sub" / "beside.json")
    monkeypatch.chdir(tmp_path)
    for kept in ("p4.json", "sub/beside.json"):
        config = OccultConfig(num_devices=4, placement=kept, prune="similarity", max_devices_per_token=2, profile=profile.name)
        config.save("sub/occult.json")
        saved = json.loads((tmp_path / "sub" / "occult.json").read_text())
        loaded = OccultConfig.load("sub/occult.json")
        assert os.path.samefile(loaded.placement, kept) and os.path.samefile(loaded.profile, profile.name)
        assert saved["placement"] == (str(tmp_path / kept) if kept == "p4.json" else "beside.json")
        assert saved["profile"] == str(profile)
