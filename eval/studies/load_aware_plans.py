"""Replicas planned for the load-aware runtime rule, replayed on the held-out Qwen half (the 1.05 goal).

    python -m occult_hf.eval.studies.load_aware_plans --routing-dir ../shared/data/routing --out-dir docs

For D=4 and D=8, seeds 0-9, seven plans with 8 redundant slots made on the planning half (prefill and decode
as two profiles): the robust plan made for the static rule (the best of the earlier session), and the planner
mode made for the load-aware rule (`replica_choice="load_aware"`: single-home load within `1 - shed_margin` of
the mean on every device, copies linked into one group: `placement.shedding`) with the margin at 0.15 (the
default), 0.20 and "auto" (chosen for each plan by cross-validation in time on the planning half,
`refined.cross_validated("shed_margin", ...)`), and with `max_load_ratio="auto"` too (`refined.cross_validated("max_load_ratio", ...)`).
Each is replayed on the held-out half under the static rule and under the runtime's load-aware rule at pin
slack 0.02 (the default), 0.01 and 0 (`robust_placement_study.replay_load_aware`, steps of 2,192 tokens cut
into D ranks). Two more plans leave the pin slack to the planner (`pin_slack="auto"`, margins 0.15 and 0.20)
and are replayed with the slack each plan records, as the runtime reads it from the placement file; an oracle,
planned on the held-out half itself, shows what a plan with the same budget can reach on those tokens. The last
two plans cut each profile into 2 consecutive time windows (`time_windows=2`), each bounded as a profile of its
own: the drift in time treated as several profiles rather than noise. Beside
them two bounds no rule can beat on these tokens: the fluid bound (the best split of the replicas,
`best_replica_split`) and the busiest device's single-home load (what no split moves).

Shape legend (docs/conventions.md): N tokens, k experts per token, E experts, D devices, M homes of one expert.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from occult_hf.utils.atomic import atomic_save_figure
from occult_hf.metrics import evaluate_placement, summarize
from occult_hf.replicas.routing import PIN_SLACK, resolve_homes_np
from occult_hf.utils.errors import run_command
from .placement_study import StudyResult
from .robust_placement_study import ROBUST, best_replica_split, qwen_parts, replay_load_aware, served_ct_and_balance, timed_plan

#: the planner mode for the load-aware rule, as the study runs it
LOAD_AWARE = {"num_redundant_experts": 8, "replica_choice": "load_aware", "max_load_ratio": 1.05, "pin_slack": PIN_SLACK}
SEEDS = tuple(range(10))
PIN_SLACKS = (0.02, 0.01, 0.0)
GOAL = 1.05

#: (name, planner options) of the plans compared
PLANS = (
    ("refined robust + 8 redundant, prefill+decode (for the static rule)", {**ROBUST, "num_redundant_experts": 8}),
    ("refined + 8 redundant for the load-aware rule, margin 0.15", {**LOAD_AWARE, "shed_margin": 0.15}),
    ("refined + 8 redundant for the load-aware rule, margin 0.20", {**LOAD_AWARE, "shed_margin": 0.20}),
    ("refined + 8 redundant for the load-aware rule, margin auto", {**LOAD_AWARE, "shed_margin": "auto"}),
    (
        "refined + 8 redundant for the load-aware rule, margin auto, ratio auto",
        {**LOAD_AWARE, "shed_margin": "auto", "max_load_ratio": "auto"},
    ),
    ("refined + 8 redundant for the load-aware rule, margin 0.15, pin slack auto", {**LOAD_AWARE, "shed_margin": 0.15, "pin_slack": "auto"}),
    ("refined + 8 redundant for the load-aware rule, margin 0.20, pin slack auto", {**LOAD_AWARE, "shed_margin": 0.20, "pin_slack": "auto"}),
    (
        "refined + 8 redundant for the load-aware rule, margin 0.20, 2 time windows per profile",
        {**LOAD_AWARE, "shed_margin": 0.20, "time_windows": 2},
    ),
    (
        "refined + 8 redundant for the load-aware rule, margin 0.20, pin slack auto, 2 time windows per profile",
        {**LOAD_AWARE, "shed_margin": 0.20, "pin_slack": "auto", "time_windows": 2},
    ),
)
#: plans made on the held-out half itself (an oracle no deployment has): whether any plan with this budget can
#: meet the goals on these tokens, i.e. whether a seed that misses them misses for want of a plan or of foresight
ORACLE_PLANS = (
    ("oracle: for the load-aware rule, margin 0.20, pin slack auto, planned on the held-out half itself", {**LOAD_AWARE, "shed_margin": 0.20, "pin_slack": "auto"}),
)


def single_home_bound(load_E: np.ndarray, home_table_EM: np.ndarray, num_devices: int) -> float:
    """The busiest device's load in experts with one home / the mean device load: no split of the replicas
    brings a device below it."""
    single_E = (home_table_EM >= 0).sum(1) == 1
    load_D = np.bincount(home_table_EM[single_E, 0], weights=load_E[single_E], minlength=num_devices)
    return float(load_D.max() / (load_E.sum() / num_devices))


def load_aware_plan_rows(routing_dir: Path, plans=PLANS, oracle_plans=ORACLE_PLANS) -> tuple[list[dict[str, Any]], dict[str, list], float]:
    """The table (one row per D, plan and rule); for the figure, per plan at D=8 each seed's `(CT, balance)`
    under the default load-aware rule, and today's refined CT there (seed mean)."""
    parts = qwen_parts(routing_dir)
    both = {"prefill": parts["prefill"], "decode": parts["decode"]}
    held_Nk = parts["held_out"].layer(0).topk_sample
    load_E = np.bincount(held_Nk.ravel(), minlength=60).astype(np.float64)
    window = len(held_Nk)
    rows, points = [], {}
    for num_devices in (4, 8):
        today = float(np.mean([
            summarize(evaluate_placement(parts["held_out"], timed_plan(parts["first"], num_devices, {"seed": s})[0]))["ct"] for s in SEEDS
        ]))
        cases = [(name, options, both) for name, options in plans] + [(name, options, parts["held_out"]) for name, options in oracle_plans]
        for name, options, profiles in cases:
            runs = [timed_plan(profiles, num_devices, {**options, "seed": s}) for s in SEEDS]
            tables = [placement.home_table(0) for placement, _ in runs]
            fluid = [best_replica_split(load_E, table, num_devices) for table in tables]
            single = [single_home_bound(load_E, table, num_devices) for table in tables]
            chosen = [placement.pin_slack_of(0) for placement, _ in runs]  # the plan's own (auto) or the runtime's
            if options.get("pin_slack") == "auto":
                rules = [("static", None), ("load-aware, the plan's pin slack", chosen)]
            else:
                rules = [("static", None)] + [(f"load-aware, pin slack {slack}", [slack] * len(runs)) for slack in PIN_SLACKS]
            for rule, slacks in rules:
                scores = [
                    served_ct_and_balance(
                        resolve_homes_np(held_Nk, table, num_devices) if slacks is None
                        else replay_load_aware(held_Nk, table, num_devices, window, slack),
                        num_devices, window,
                    )
                    for table, slack in zip(tables, slacks or [None] * len(tables))
                ]
                ct = [c for c, _, _ in scores]
                balance = [b for _, b, _ in scores]
                if num_devices == 8 and rule in (f"load-aware, pin slack {PIN_SLACKS[0]}", "load-aware, the plan's pin slack"):
                    points[name], today_8 = list(zip(ct, balance)), today
                rows.append({
                    "D": num_devices,
                    "plan (seeds 0-9)": name,
                    "replica rule": rule,
                    "CT held-out, mean (vs today's refined)": f"{np.mean(ct):.3f} ({100 * (np.mean(ct) / today - 1):+.1f}%)",
                    "balance held-out, mean / worst seed": f"{np.mean(balance):.3f} / {max(balance):.3f}",
                    "seeds <= 1.05 with CT below today's": f"{sum(b <= GOAL + 1e-9 and c < today for c, b in zip(ct, balance))} / {len(SEEDS)}",
                    "fluid bound, mean / worst / seeds > 1.05": (
                        f"{np.mean(fluid):.3f} / {max(fluid):.3f} / {sum(f > GOAL for f in fluid)}" if slacks is None else ""
                    ),
                    "single-home bound, mean / worst": f"{np.mean(single):.3f} / {max(single):.3f}" if slacks is None else "",
                    "pin slack (seeds)": "" if slacks is None else ", ".join(f"{v} x{slacks.count(v)}" for v in sorted(set(slacks), reverse=True)),
                    "plan CPU s (mean)": round(float(np.mean([cpu for _, cpu in runs])), 1) if slacks is None else "",
                })
    return rows, points, today_8


def plot(points: dict[str, list], today: float, path: Path) -> None:
    """Held-out CT against held-out balance of each seed's plan at D=8 under the default load-aware rule."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, seeds in points.items():
        ax.scatter([c for c, _ in seeds], [b for _, b in seeds], s=22, label=name.replace("refined ", "").replace(", prefill+decode", ""))
    goal_axes(ax, today, "Qwen1.5-MoE layer 0, D=8, 8 redundant slots, seeds 0-9")
    ax.legend(fontsize=6, loc="upper left")
    atomic_save_figure(fig, path, dpi=110)


def goal_axes(ax, today: float, title: str) -> None:
    """Lines, labels and grid of a held-out CT against balance scatter: the 1.05 goal (dotted) and today's
    refined CT (dashed), the two lines a seed must stay below."""
    ax.axhline(GOAL, color="grey", linestyle=":", linewidth=0.8)
    ax.axvline(today, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlabel("held-out CT (dashed: today's refined, seed mean)")
    ax.set_ylabel("held-out balance under the load-aware rule")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


def run(routing_dir: Path, out_dir: Path | None) -> StudyResult:
    rows, points, today = load_aware_plan_rows(routing_dir)
    result = StudyResult()
    title = "Qwen1.5-MoE layer 0, 8 redundant slots: replicas planned for the load-aware rule, replayed on the held-out half"
    result.tables[title] = rows
    result.notes[title] = [
        "load-aware rule replayed as the runtime computes it (one step of 2,192 tokens cut into D ranks); the fluid "
        "bound and the single-home bound hold for every rule on these tokens: a seed above 1.05 there cannot meet "
        "the goal with that plan",
        f"planner mode: {LOAD_AWARE} and shed_margin; prefill and decode as two profiles",
    ]
    if out_dir is not None:
        plot(points, today, out_dir / "load_aware_placement.png")
    return result


def main_on_qwen_trace(
    argv: list[str] | None, doc: str, study: Callable[[Path, Path | None], StudyResult], figure: str
) -> int:
    """The command line of a study of the Qwen trace: `--routing-dir` (required: the trace is not shipped) and
    `--out-dir` (where `study` writes `figure`); prints `study`'s tables."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--routing-dir", type=Path, required=True,
        help="folder of the third-party routing .npz files (../shared/data/routing: the Qwen1.5-MoE trace)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help=f"where to write {figure}")
    args = parser.parse_args(argv)
    print(study(args.routing_dir, args.out_dir).markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_on_qwen_trace(argv, __doc__, run, "load_aware_placement.png")


__all__ = ["LOAD_AWARE", "ORACLE_PLANS", "PLANS", "goal_axes", "load_aware_plan_rows", "main_on_qwen_trace", "plot", "run", "single_home_bound"]


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.load_aware_plans", main))

