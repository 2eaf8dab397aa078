"""`occult bench` refuses bad flags at once, naming the flag, instead of running at other sizes, failing deep in the
first forward, or failing after the whole run. Parsing and early refusals only: nothing here builds a model."""

import numpy as np
import pytest
import torch

from occult_hf.cli import build_parser
from occult_hf.cli import main as occult_main


def _refused(argv, capsys) -> str:
    """stderr of `occult *argv`, which must exit with code 2."""
    with pytest.raises(SystemExit) as exited:
        occult_main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "--hidden", "0"],
        ["model", "--intermediate", "0"],
        ["model", "--batch", "0"],
        ["model", "--seq", "-3"],
        ["model", "--layers", "0"],
        ["ep", "--hidden", "0"],
        ["ep", "--intermediate", "0"],
        ["realsize", "--hidden", "0"],
        ["realsize", "--layers", "0"],
        ["realsize", "--seq", "0"],
        ["realsize", "--iterations", "0"],
        ["decode", "--hidden", "0"],
        ["decode", "--batches", "1", "0"],
        ["decode", "--new-tokens", "0"],
    ],
)
def test_a_size_flag_below_one_is_refused_at_parse_time(argv, capsys):
    """`--hidden 0 --intermediate 0` ran silently at the real OLMoE widths (0 read as "not given")."""
    err = _refused(["bench", *argv], capsys)
    assert f"argument {argv[1]}: expected an integer >= 1" in err, err


@pytest.mark.parametrize("name", ["model", "realsize", "decode"])
def test_a_hidden_width_that_does_not_split_into_the_heads_is_refused_at_parse_time(name, capsys):
    """`--hidden 30` failed inside the first forward: the dry-run model has 4 heads, of even width for rotary."""
    err = _refused(["bench", name, "--hidden", "30"], capsys)
    assert "argument --hidden: expected a multiple of 8" in err, err
    assert build_parser().parse_args(["bench", name, "--hidden", "32"]).hidden == 32


def test_bench_model_refuses_an_out_that_is_a_file_before_the_run(tmp_path, monkeypatch, capsys):
    """`--out FILE` failed with "[Errno 17] File exists" only after the whole run."""
    from occult_hf.benchmarks import experts, model

    def no_run(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(experts, "dense_gemm_tflops", no_run)
    monkeypatch.setattr(model, "measure", no_run)
    out = tmp_path / "results"
    out.write_text("")
    err = _refused(["bench", "model", "--cpu", "--out", str(out)], capsys)
    assert "--out" in err and "is an existing file" in err and "the run started" not in err, err


def test_bench_exchange_outside_torchrun_says_how_to_launch_it(monkeypatch, capsys):
    """Outside torchrun it failed with "'NoneType' object has no attribute 'group_name'"."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _refused(["bench", "exchange", "--cpu"], capsys)
    assert "torchrun --nproc-per-node D" in err and "group_name" not in err, err


@pytest.mark.parametrize(
    "flag, value, rule",
    [("--gbs", "0", "a finite number > 0"), ("--gbs", "-1", "a finite number > 0"), ("--call-ms", "-0.1", "a finite number >= 0"),
     ("--tokens", "0", "an integer >= 1"), ("--model-devices", "0", "an integer >= 1")],  # fmt: skip
)
def test_bench_exchange_model_checks_its_numbers_at_parse_time(flag, value, rule, capsys):
    """`--gbs 0` printed infinite times and `--gbs -1` negative ones with exit code 0; the counts failed deep inside
    without naming the flag."""
    err = _refused(["bench", "exchange", "--model", "t.npz", flag, value], capsys)
    assert f"argument {flag}: expected {rule}, got " in err, err


def test_bench_exchange_model_names_the_shapes_it_knows(tmp_path, capsys):
    """A trace of another (E, k) than the known shapes was a bare StopIteration."""
    trace = tmp_path / "t.npz"
    np.savez(trace, topk_ids=np.stack([np.arange(32) % 32, (np.arange(32) + 1) % 32], axis=1))
    err = _refused(["bench", "exchange", "--model", str(trace), "--out", str(tmp_path)], capsys)
    assert "its E=32, k=2 is none of the expert shapes whose row width is known: olmoe-1b-7b (E=64, k=8)" in err, err


def test_bench_experts_does_not_offer_cpu(monkeypatch, capsys):
    """`--cpu` was in the help of `bench experts`, whose run then refused it ("needs a CUDA GPU")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused(["bench", "experts", "--cpu"], capsys)
    assert "unrecognized arguments: --cpu" in err, err
    err = _refused(["bench", "experts"], capsys)
    assert "no CUDA device" in err and "it has no --cpu check" in err, err
