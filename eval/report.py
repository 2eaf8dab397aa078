"""Tables from lm-eval result JSON: one run as markdown, and two runs side by side with deltas.

Each task gets one row per *headline* metric: the metrics in `HEADLINE_METRICS` where the suite
names them (CoQA's EM and F1, QASPER's F1), else the first of `PREFERRED_METRICS` the task reports,
else every metric it reports. Groups that report a metric of their own (MMLU) are one row; groups
that do not (`occult23` itself) are replaced by their members. Values are shown in points (x100).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

#: tasks whose table rows are not simply "acc"
HEADLINE_METRICS: dict[str, tuple[str, ...]] = {"qasper_bool": ("f1",), "coqa": ("em", "f1")}
#: for other tasks, the first of these that the task reports
PREFERRED_METRICS: tuple[str, ...] = ("acc", "exact_match", "f1", "em")


@dataclass(frozen=True)
class Score:
    task: str
    metric: str
    value: float
    stderr: float | None


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """An lm-eval results JSON (ours or lm-eval's own `results_*.json`); must hold `results`."""
    with open(path) as f:
        data = json.load(f)
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


def headline_scores(results: dict[str, Any]) -> list[Score]:
    """The table rows of one run, in the order lm-eval ran the tasks."""
    per_task = results["results"]
    group_members: dict[str, list[str]] = results.get("group_subtasks", {})
    members = {child for children in group_members.values() for child in children}
    scores: list[Score] = []

    def visit(name: str) -> None:
        reported = _reported_metrics(per_task.get(name, {}))
        metrics = _headline(name, reported)
        if metrics:
            scores.extend(Score(name, m, *reported[m]) for m in metrics)
            return
        for child in group_members.get(name, ()):
            visit(child)

    for name in per_task:
        if name not in members:
            visit(name)
    return scores


def _points(value: float | None, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{100 * value:+.2f}" if signed else f"{100 * value:.2f}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def markdown_table(results: dict[str, Any]) -> str:
    """One run: task, metric, value and stderr in points, then the mean over the rows."""
    scores = headline_scores(results)
    lines = ["| Task | Metric | Value | Stderr |", "|---|---|---:|---:|"]
    lines += [f"| {s.task} | {s.metric} | {_points(s.value)} | {_points(s.stderr)} |" for s in scores]
    lines.append(f"| **Average** ({len(scores)} rows) | | {_points(_mean([s.value for s in scores]))} | |")
    return "\n".join(lines)


def compare_table(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B")) -> str:
    """Two runs side by side: per row A, B and B - A in points; the average over rows both runs have."""
    scores_a = {(s.task, s.metric): s.value for s in headline_scores(a)}
    scores_b = {(s.task, s.metric): s.value for s in headline_scores(b)}
    keys = list(scores_a) + [k for k in scores_b if k not in scores_a]
    shared = [k for k in keys if k in scores_a and k in scores_b]
    label_a, label_b = labels
    lines = [
        f"| Task | Metric | {label_a} | {label_b} | Δ ({label_b} − {label_a}) |",
        "|---|---|---:|---:|---:|",
    ]
    for key in keys:
        value_a, value_b = scores_a.get(key), scores_b.get(key)
        delta = value_b - value_a if key in shared else None
        lines.append(f"| {key[0]} | {key[1]} | {_points(value_a)} | {_points(value_b)} | {_points(delta, signed=True)} |")
    mean_a = _mean([scores_a[k] for k in shared])
    mean_b = _mean([scores_b[k] for k in shared])
    delta = None if mean_a is None else mean_b - mean_a
    lines.append(
        f"| **Average** ({len(shared)} shared rows) | | {_points(mean_a)} | {_points(mean_b)} | {_points(delta, signed=True)} |"
    )
    return "\n".join(lines)


__all__ = ["Score", "HEADLINE_METRICS", "PREFERRED_METRICS", "load_results", "headline_scores", "markdown_table", "compare_table"]
