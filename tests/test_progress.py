"""Progress bars follow Hugging Face's switches, and every subcommand takes `--no-progress` (issue 32:
`disable_progress_bar()` and `HF_HUB_DISABLE_PROGRESS_BARS=1` still left 17-22 bar lines of `occult demo`,
whose bars were raw `tqdm.auto`)."""

from __future__ import annotations

import argparse

import sys
import pytest
from huggingface_hub.utils import are_progress_bars_disabled
from transformers.utils import logging as transformers_logging

from occult_hf.cli import build_parser
from occult_hf.cli import main as occult_main
from occult_hf.cli.bench import BENCHMARKS

#: what occult_hf's bars print: their descriptions
BAR_NAMES = ("profiling routing", "placement ")


def demo_bar_lines(tmp_path, capsys, *flags: str) -> int:
    assert occult_main(["demo", "--tokens", "256", "--no-plots", "--out", str(tmp_path / "demo"), *flags]) == 0
    err = capsys.readouterr().err
    return sum(line.count(name) for line in err.replace("\r", "\n").splitlines() for name in BAR_NAMES)


@pytest.fixture
def bars_back_on(monkeypatch):
    yield
    monkeypatch.undo()  # the hub's variable first: enabling under it only warns
    transformers_logging.enable_progress_bar()


def test_demo_bars_follow_every_switch(tmp_path, capsys, monkeypatch, bars_back_on):
    assert demo_bar_lines(tmp_path, capsys) > 0  # on by default: the checks below can fail
    assert demo_bar_lines(tmp_path, capsys, "--no-progress") == 0
    assert not are_progress_bars_disabled()  # the flag is the run's: the caller's bars are back on after it
    transformers_logging.disable_progress_bar()
    assert demo_bar_lines(tmp_path, capsys) == 0
    transformers_logging.enable_progress_bar()
    # what HF_HUB_DISABLE_PROGRESS_BARS=1 sets when huggingface_hub is imported
    monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", True)
    assert demo_bar_lines(tmp_path, capsys) == 0


def _leaf_parsers(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) of every runnable subcommand."""
    subcommands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not subcommands:
        yield path, parser
    for action in subcommands:
        for name, sub in action.choices.items():
            yield from _leaf_parsers(sub, (*path, name))


def test_every_subcommand_takes_no_progress():
    leaves = dict(_leaf_parsers(build_parser()))
    assert {path[0] for path in leaves} >= {"demo", "train", "profile", "place", "replan", "report", "eval", "bench"}
    assert {path[1] for path in leaves if path[0] == "bench"} == set(BENCHMARKS)
    for path, parser in leaves.items():
        assert any("--no-progress" in action.option_strings for action in parser._actions), path
