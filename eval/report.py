"""Tables from lm-eval result JSON: one run's headline rows, and two runs side by side with deltas.

The *headline rows* are the paper's table, so only a run of the `occult23` suite has them: each of
its tasks gets one row per headline metric, the metrics in `HEADLINE_METRICS` where the suite names
them (CoQA's EM and F1, QASPER's F1), else the first of `PREFERRED_METRICS` the task reports, else
every metric it reports. Groups that report a metric of their own (MMLU) are one row; groups that do
not (`occult23` itself) are replaced by their members. `compare_table` of two runs without `occult23`
compares every metric of every task instead.

A mean over rows is printed only where every row is a fraction of documents scored right
(`FRACTION_METRICS`: accuracy, exact match, F1 on lm-eval's 0-1 scale), as for `occult23`; a mean of
perplexities and accuracies would mean nothing, so a table with any other metric has no mean.

Both tables are generated from results files, the lm-eval way: `markdown_table` is lm-eval's own
`make_table` over a results dict cut down to the headline rows (`headline_results`), followed by
the mean of those rows; `compare_table` is written by the package's table helper
(`occult_hf.utils.tables.markdown_table`), with values as lm-eval prints them (4 decimals, 0-1 scale).
`occult eval --headline RESULTS` and `occult eval --compare A B` print them; RESULTS may be a
`results_*.json` or an lm-eval output folder (its newest `results_*.json`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from occult_hf.utils.strict_json import read_json_file

from .suite import SUITE_NAME

#: tasks whose table rows are not simply "acc"
HEADLINE_METRICS: dict[str, tuple[str, ...]] = {"qasper_bool": ("f1",), "coqa": ("em", "f1")}
#: for other tasks, the first of these that the task reports
PREFERRED_METRICS: tuple[str, ...] = ("acc", "exact_match", "f1", "em")
#: metrics that are a fraction of documents scored right (0-1, higher is better): a mean over rows of these means something
FRACTION_METRICS: frozenset[str] = frozenset({"acc", "acc_norm", "exact_match", "f1", "em"})


@dataclass(frozen=True)
class Score:
    task: str
    metric: str
    value: float
    stderr: float | None


def results_file(path: str | os.PathLike) -> Path:
    """`path` itself, or for a folder (lm-eval's `--output_path`) its newest `results_*.json`, at any depth."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: (p.stat().st_mtime, p.name))
        if not found:
            raise FileNotFoundError(f"{os.fspath(path)!r} holds no results_*.json (lm-eval's output layout)")
        return found[-1]
    return path


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """An lm-eval results JSON (ours or lm-eval's own `results_*.json`, or a folder holding one); must hold `results`."""
    path = results_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"{os.fspath(path)!r} does not exist")
    data = read_json_file(path, "lm-eval results", allow_nan=True)  # lm-eval writes NaN where a stderr is undefined
    if not isinstance(data, dict) or "results" not in data:
        raise ValueError(f"{os.fspath(path)!r} is not an lm-eval results file: it has no top-level 'results' key")
    return data


def _reported_metrics(task_results: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """`{"acc": (value, stderr)}` from lm-eval's `"acc,none"`-style keys; the "none" filter wins over others."""
    found: dict[str, tuple[float, float | None]] = {}
    for key, value in task_results.items():
        metric, sep, filter_name = key.partition(",")
        if not sep or metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if metric in found and filter_name != "none":
            continue
        stderr = task_results.get(f"{metric}_stderr,{filter_name}")
        found[metric] = (float(value), float(stderr) if isinstance(stderr, (int, float)) else None)
    return found


def _headline(task: str, reported: dict[str, tuple[float, float | None]]) -> list[str]:
    if task in HEADLINE_METRICS:
        return [m for m in HEADLINE_METRICS[task] if m in reported]
    for metric in PREFERRED_METRICS:
        if metric in reported:
            return [metric]
    return list(reported)


def has_suite(results: dict[str, Any]) -> bool:
    """True when `results` holds an `occult23` run (the only run with headline rows)."""
    return SUITE_NAME in results["results"] or SUITE_NAME in results.get("group_subtasks", {})


def headline_scores(results: dict[str, Any]) -> list[Score]:
    """The headline rows of an `occult23` run, in the suite's order; an error for any other run."""
    if not has_suite(results):
        tasks = ", ".join(results["results"]) or "none"
        raise ValueError(
            f"the results hold no {SUITE_NAME} run (tasks: {tasks}): headline rows are the paper's {SUITE_NAME} "
            f"table; lm-eval's table of this run (every metric) is what `occult eval` printed when it ran"
        )
    per_task = results["results"]
    group_members: dict[str, list[str]] = results.get("group_subtasks", {})
    scores: list[Score] = []

    def visit(name: str, suite_itself: bool = False) -> None:
        reported = _reported_metrics(per_task.get(name, {}))
        metrics = [] if suite_itself else _headline(name, reported)
        if metrics:
            scores.extend(Score(name, m, *reported[m]) for m in metrics)
            return
        for child in group_members.get(name, ()):
            visit(child)

    visit(SUITE_NAME, suite_itself=True)
    return scores


def every_score(results: dict[str, Any]) -> list[Score]:
    """Every metric of every task and group of a run, as rows (what two runs without `occult23` compare on)."""
    return [
        Score(task, metric, value, stderr)
        for task, task_results in results["results"].items()
        for metric, (value, stderr) in _reported_metrics(task_results).items()
    ]


def mean_of_fractions(scores: list[Score]) -> float | None:
    """The mean over `scores` when every one is a `FRACTION_METRICS` metric; None otherwise (or when empty)."""
    if not scores or any(score.metric not in FRACTION_METRICS for score in scores):
        return None
    return sum(score.value for score in scores) / len(scores)


def _value(value: float | None, signed: bool = False) -> str:
    """A value as lm-eval's `make_table` prints it (4 decimals); an en dash where there is none."""
    if value is None or math.isnan(value):
        return "–"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def headline_results(results: dict[str, Any]) -> dict[str, Any]:
    """`results` cut down to its headline rows, in lm-eval's result layout (for lm-eval's `make_table`).

    Each headline task keeps only its headline metric(s) and their stderrs, its alias, version,
    n-shot and higher-is-better entries; groups replaced by their members disappear.
    """
    per_task = results["results"]
    rows: dict[str, dict[str, Any]] = {}
    for score in headline_scores(results):
        task = per_task[score.task]
        row = rows.setdefault(score.task, {"alias": task["alias"]} if "alias" in task else {})
        filters = [key.partition(",")[2] for key in task if key.partition(",")[0] == score.metric]
        chosen = "none" if "none" in filters else filters[0]  # the filter `headline_scores` read
        for key in (f"{score.metric},{chosen}", f"{score.metric}_stderr,{chosen}"):
            if key in task:
                row[key] = task[key]
    keep = set(rows)
    return {
        "results": rows,
        "versions": {k: v for k, v in results.get("versions", {}).items() if k in keep},
        "n-shot": {k: v for k, v in results.get("n-shot", {}).items() if k in keep},
        "higher_is_better": {k: v for k, v in results.get("higher_is_better", {}).items() if k in keep},
    }


def markdown_table(results: dict[str, Any]) -> str:
    """One `occult23` run's headline rows: lm-eval's `make_table`, then the mean over the rows (when they
    are all fractions, as occult23's are)."""
    from lm_eval.utils import make_table

    scores = headline_scores(results)
    table = make_table(headline_results(results)).rstrip("\n")
    mean = mean_of_fractions(scores)
    return table if mean is None else f"{table}\n\nAverage over the {len(scores)} headline rows: {_value(mean)}"


def compare_table(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B")) -> str:
    """Two runs side by side: per row A, B and B - A, then the average over the rows both runs have
    (when those are all fractions). The rows are the headline rows when both runs are `occult23` runs,
    else every metric of every task."""
    from occult_hf.utils.tables import markdown_table as table

    rows_of = headline_scores if has_suite(a) and has_suite(b) else every_score
    scores_a = {(s.task, s.metric): s for s in rows_of(a)}
    scores_b = {(s.task, s.metric): s for s in rows_of(b)}
    keys = list(scores_a) + [k for k in scores_b if k not in scores_a]
    shared = [k for k in keys if k in scores_a and k in scores_b]
    label_a, label_b = labels
    values = []
    for key in keys:
        value_a, value_b = (scores[key].value if key in scores else None for scores in (scores_a, scores_b))
        delta = value_b - value_a if key in shared else None
        values.append([key[0], key[1], _value(value_a), _value(value_b), _value(delta, signed=True)])
    mean_a = mean_of_fractions([scores_a[k] for k in shared])
    mean_b = mean_of_fractions([scores_b[k] for k in shared])
    if mean_a is not None:
        values.append([f"Average ({len(shared)} shared rows)", "", _value(mean_a), _value(mean_b), _value(mean_b - mean_a, signed=True)])
    return table(["Tasks", "Metric", label_a, label_b, f"Δ ({label_b} − {label_a})"], values, align="llrrr")


__all__ = [
    "Score",
    "FRACTION_METRICS",
    "HEADLINE_METRICS",
    "PREFERRED_METRICS",
    "compare_table",
    "every_score",
    "has_suite",
    "headline_results",
    "headline_scores",
    "load_results",
    "markdown_table",
    "mean_of_fractions",
    "results_file",
]
