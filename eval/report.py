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
`make_table` over a results dict cut down to the headline rows (`headline_results`), in the suite's
order, followed by the mean of those rows; `compare_table` is written by the package's table helper
(`occult_hf.utils.tables.markdown_table`), with values as lm-eval prints them (4 decimals, 0-1 scale).
`occult eval --headline RESULTS` and `occult eval --compare A B` print them; RESULTS may be a
`results_*.json` or an lm-eval output folder (its newest `results_*.json`). Neither table says how a
run was made, so `partial_run_warnings` (a run that scored only part of its documents) and
`comparison_warnings` (two runs with different `--limit`, documents scored or n-shot, or no task in
common) give the lines the command prints on stderr beside them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from occult_hf.utils.checks import shown
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
    """`path` itself, or for a folder (lm-eval's `--output_path`) its newest `results_*.json`, at any depth, when
    they all lie in one folder: lm-eval writes each checkpoint's runs into a folder of its own, and the newest file
    of several checkpoints' would be whichever ran last. (Runs of one checkpoint under other occult settings share its
    folder: `occult eval` names the file it reads.)"""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: (p.stat().st_mtime, p.name))
        if not found:
            raise FileNotFoundError(f"{os.fspath(path)!r} holds no results_*.json (lm-eval's output layout)")
        folders = sorted({os.fspath(p.parent) for p in found})
        if len(folders) > 1:
            raise ValueError(
                f"{os.fspath(path)!r} holds the results of {len(folders)} models' runs ({', '.join(folders)}): give "
                f"one of those folders, or a results_*.json"
            )
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
    _check_results(data["results"], os.fspath(path))
    return data


def _check_results(results: Any, path: str) -> None:
    """Raise naming `path` unless `results` is lm-eval's `{task: {"metric,filter": number, ...}}` with a task (a
    metric may be null, shown as a dash; stderrs may be "N/A"): a malformed file would otherwise fail deep in the
    table code, or print a table of dashes as if the runs had nothing to report."""
    if not isinstance(results, dict) or not results:
        raise ValueError(f"{path!r}: 'results' must map each task to its metrics, got {_short(results)}")
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            raise ValueError(f"{path!r}: results[{task!r}] must map metric names to values, got {_short(metrics)}")
        for key, value in metrics.items():
            metric, sep, _ = key.partition(",")
            if sep and not metric.endswith("_stderr") and value is not None and not _is_number(value):
                raise ValueError(f"{path!r}: results[{task!r}][{key!r}] must be a number, got {_short(value)}")


def _is_number(value: Any) -> bool:
    """A metric value: an int or float, not a bool (JSON's true would otherwise read as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """`repr(value)` cut to 60 characters, for an error message about a file that may hold megabytes."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reported_metrics(task_results: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """`{"acc": (value, stderr)}` from lm-eval's `"acc,none"`-style keys; the "none" filter wins over others."""
    found: dict[str, tuple[float, float | None]] = {}
    for key, value in task_results.items():
        metric, sep, filter_name = key.partition(",")
        if not sep or metric.endswith("_stderr") or not _is_number(value):
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


def _keyed_in_order(cut: dict[str, Any]) -> dict[str, Any]:
    """`cut` (`headline_results`) with each task keyed by its position and shown by its alias: lm-eval's `make_table`
    prints rows sorted by key, and the headline rows belong in the suite's order (the paper's)."""
    key = {task: f"{position:03d}" for position, task in enumerate(cut["results"])}
    fields = ("versions", "n-shot", "higher_is_better")
    return {
        "results": {key[task]: {"alias": task} | row for task, row in cut["results"].items()},
        **{field: {key[task]: value for task, value in cut[field].items()} for field in fields},
    }


def markdown_table(results: dict[str, Any]) -> str:
    """One `occult23` run's headline rows in the suite's order: lm-eval's `make_table`, then the mean over the rows
    (when they are all fractions, as occult23's are)."""
    from lm_eval.utils import make_table

    scores = headline_scores(results)
    table = make_table(_keyed_in_order(headline_results(results))).rstrip("\n")
    mean = mean_of_fractions(scores)
    return table if mean is None else f"{table}\n\nAverage over the {len(scores)} headline rows: {_value(mean)}"


def compare_table(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B")) -> str:
    """Two runs side by side: per row A, B and B - A. When both runs are `occult23` runs the rows are their headline
    rows (one metric per task), followed by the average over the rows both have; else every metric of every task,
    with no average (it would mix metric kinds: a task's acc and acc_norm, a group and its subtasks)."""
    from occult_hf.utils.tables import markdown_table as table

    headline = has_suite(a) and has_suite(b)
    rows_of = headline_scores if headline else every_score
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
    mean_a = mean_of_fractions([scores_a[k] for k in shared]) if headline else None
    mean_b = mean_of_fractions([scores_b[k] for k in shared]) if headline else None
    if mean_a is not None:
        values.append([f"Average ({len(shared)} shared rows)", "", _value(mean_a), _value(mean_b), _value(mean_b - mean_a, signed=True)])
    return table(["Tasks", "Metric", label_a, label_b, f"Δ ({label_b} − {label_a})"], values, align="llrrr")


def partial_run_warnings(results: dict[str, Any], name: str) -> list[str]:
    """A line when the run `name` scored only part of its tasks' documents (`--limit`, or lm-eval's `samples`):
    its numbers are then comparable neither with a full run nor with the paper's."""
    limit = (results.get("config") or {}).get("limit")
    partial = [f"{task} {counts['effective']} of {counts['original']}" for task, counts in _scored_documents(results).items()
               if counts["effective"] != counts["original"]]  # fmt: skip
    how = ([f"--limit {limit}"] if limit is not None else []) + ([f"documents {shown(partial)}"] if partial else [])
    if not how:
        return []
    return [f"{name} scored only part of its documents ({', '.join(how)}): not comparable with a full run or the paper's numbers"]


def comparison_warnings(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """One line per way the runs `a` and `b` were not run alike (`--limit`; documents scored and n-shot, each
    listing the tasks both ran that differ), or one saying they share no task: a delta between such runs
    measures the settings, not the models."""
    label_a, label_b = labels
    if not set(a["results"]) & set(b["results"]):
        return [f"{label_a} and {label_b} share no task: no row has values from both"]
    lines = []
    limits = [(run.get("config") or {}).get("limit") for run in (a, b)]
    if limits[0] != limits[1]:
        lines.append(f"the runs differ in --limit: {label_a} {limits[0]}, {label_b} {limits[1]}")
    documents_a, documents_b = _scored_documents(a), _scored_documents(b)
    counts = {task: (documents_a[task]["effective"], documents_b[task]["effective"]) for task in documents_a if task in documents_b}
    shots_a, shots_b = a.get("n-shot") or {}, b.get("n-shot") or {}
    shots = {task: (shots_a[task], shots_b[task]) for task in shots_a if task in shots_b}
    for what, pairs in (("documents scored", counts), ("n-shot", shots)):
        differing = [f"{task}: {label_a} {x}, {label_b} {y}" for task, (x, y) in pairs.items() if x != y]
        if differing:
            lines.append(f"the runs differ in {what}: {shown(differing)}")
    return lines


def _scored_documents(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's `n-samples`: per task, `{"original": documents in the task, "effective": documents scored}`."""
    return {task: counts for task, counts in (results.get("n-samples") or {}).items()
            if isinstance(counts, dict) and {"original", "effective"} <= set(counts)}  # fmt: skip


__all__ = [
    "Score",
    "FRACTION_METRICS",
    "HEADLINE_METRICS",
    "PREFERRED_METRICS",
    "compare_table",
    "comparison_warnings",
    "every_score",
    "has_suite",
    "headline_results",
    "headline_scores",
    "load_results",
    "markdown_table",
    "mean_of_fractions",
    "partial_run_warnings",
    "results_file",
]
