"""Transfer: does a placement profiled on one text domain still cut communication on another?

For every source domain A and method (contiguous, occult, refined) and device count D (4, 8): plan on
the routing profile of A's training split, then measure mean CT and held-out balance (max / mean
device load) on the held-out split of every target domain T (`refined` with the quality study's options, `REFINED`). The **oracle** for T is the same method
planned on T's own training profile, measured on the same held-out T (docs/design.md §8). The goal: CT on
an unseen domain (T != A) within 10% of the oracle (`CT_transfer <= 1.10 * CT_oracle`).

    python -m occult_hf.eval.studies.transfer --profiles DIR --out-dir docs

reads `train_<domain>.safetensors` and `heldout_<domain>.safetensors` (written by
`occult_hf.eval.studies.quality`'s base stage, or by `--model CKPT --data DATA` here) and writes
`transfer.json`, `transfer.md` and `transfer.png`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_json, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.errors import run_command

METHODS = ("contiguous", "occult", "refined")
DEVICES = (4, 8)


def load_profiles(directory: Path) -> tuple[dict, dict]:
    """({domain: training profile}, {domain: held-out profile}) of a profile directory."""
    from occult_hf.profile import RoutingProfile

    train = {p.stem[len("train_") :]: RoutingProfile.load(p) for p in sorted(directory.glob("train_*.safetensors"))}
    held = {p.stem[len("heldout_") :]: RoutingProfile.load(p) for p in sorted(directory.glob("heldout_*.safetensors"))}
    if not train or set(train) != set(held):
        raise FileNotFoundError(f"{directory}: needs train_<d>.safetensors and heldout_<d>.safetensors for the same domains; "
                                f"found train {sorted(train)}, heldout {sorted(held)}")  # fmt: skip
    return train, held


def _mean(profile, placement) -> tuple[float, float]:
    from occult_hf.metrics import evaluate_placement

    metrics = evaluate_placement(profile, placement)
    return float(np.mean([m.ct for m in metrics.values()])), float(np.mean([m.balance for m in metrics.values()]))


def transfer_study(train: dict, held: dict, methods=METHODS, devices=DEVICES) -> list[dict]:
    """One row per (D, method, source, target): CT and balance on held-out target, oracle, ratio."""
    from occult_hf.placement import plan_placement

    from .quality import REFINED

    plans = {(d, m, a): plan_placement(train[a], d, m, progress=False, **(REFINED if m == "refined" else {}))
             for d in devices for m in methods for a in train}  # fmt: skip
    rows = []
    for d, m in itertools.product(devices, methods):
        for a, t in itertools.product(train, held):
            ct, balance = _mean(held[t], plans[d, m, a])
            ct_oracle, balance_oracle = _mean(held[t], plans[d, m, t])
            rows.append({"devices": d, "method": m, "source": a, "target": t, "ct": ct, "balance": balance,
                         "ct_oracle": ct_oracle, "balance_oracle": balance_oracle, "ct_ratio": ct / ct_oracle})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    header = ["D", "method", "profiled on (A)", "measured on (B)", "CT", "CT oracle (planned on B)", "CT / oracle", "balance", "balance oracle"]
    cells = []
    for r in rows:
        mark = "" if r["source"] == r["target"] else (" ✓" if r["ct_ratio"] <= 1.10 else " ✗")
        cells.append([r["devices"], r["method"], r["source"], r["target"], f"{r['ct']:.3f}", f"{r['ct_oracle']:.3f}",
                      f"{r['ct_ratio']:.3f}{mark}", f"{r['balance']:.2f}", f"{r['balance_oracle']:.2f}"])  # fmt: skip
    lines = [markdown_table(header, cells, align="rlllrrrrr")]
    unseen = [r for r in rows if r["source"] != r["target"] and r["method"] != "contiguous"]
    if unseen:
        worst = max(unseen, key=lambda r: r["ct_ratio"])
        met = sum(r["ct_ratio"] <= 1.10 for r in unseen)
        lines.append("")
        lines.append(f"Goal (CT on an unseen domain within 10% of the oracle), occult and refined: met in {met} of {len(unseen)} "
                     f"(source, target, method, D) cases; worst {worst['ct_ratio']:.3f} ({worst['method']}, D={worst['devices']}, "
                     f"{worst['source']} -> {worst['target']}).")  # fmt: skip
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per (D, method) planned on a profile: CT / oracle on the unseen domains (mean, worst), CT on its
    own domain, contiguous CT, held-out balance on the unseen domains; then the goal line of `markdown`."""
    header = ["D", "method", "mean CT / oracle, unseen domains", "worst (A -> B)", "CT on own domain (mean)", "contiguous CT (mean)",
              "held-out balance, unseen (mean)"]  # fmt: skip
    cells = []
    for d in sorted({r["devices"] for r in rows}):
        contiguous = np.mean([r["ct"] for r in rows if r["devices"] == d and r["method"] == "contiguous"])
        for m in METHODS[1:]:
            group = [r for r in rows if r["devices"] == d and r["method"] == m]
            unseen = [r for r in group if r["source"] != r["target"]]
            if not unseen:
                continue
            worst = max(unseen, key=lambda r: r["ct_ratio"])
            cells.append([d, m, f"{np.mean([r['ct_ratio'] for r in unseen]):.3f}", f"{worst['ct_ratio']:.3f} ({worst['source']} -> {worst['target']})",
                          f"{np.mean([r['ct'] for r in group if r['source'] == r['target']]):.2f}", f"{contiguous:.2f}",
                          f"{np.mean([r['balance'] for r in unseen]):.2f}"])  # fmt: skip
    return "\n".join([markdown_table(header, cells, align="rlrlrrr"), "", *markdown(rows).splitlines()[-1:]])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({r["source"] for r in rows})
    methods = [m for m in METHODS if m != "contiguous" and any(r["method"] == m for r in rows)]
    devices = sorted({r["devices"] for r in rows})
    fig, axes = plt.subplots(len(devices), len(methods), figsize=(3.6 * len(methods), 3.2 * len(devices)), squeeze=False)
    for (i, d), (j, m) in itertools.product(enumerate(devices), enumerate(methods)):
        grid = np.array([[next(r["ct_ratio"] for r in rows if r["devices"] == d and r["method"] == m and r["source"] == a and r["target"] == t)
                          for t in domains] for a in domains])  # fmt: skip
        ax = axes[i][j]
        ax.imshow(grid, cmap="RdYlGn_r", vmin=0.9, vmax=1.2)
        for a, t in itertools.product(range(len(domains)), range(len(domains))):
            ax.text(t, a, f"{grid[a, t]:.3f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(domains)), [d_.replace("_", "\n") for d_ in domains], fontsize=7)
        ax.set_yticks(range(len(domains)), [d_.replace("_", "\n") for d_ in domains], fontsize=7)
        ax.set_title(f"{m}, D={d}: CT / oracle CT", fontsize=9)
        ax.set_xlabel("measured on (held-out)", fontsize=8)
        ax.set_ylabel("profiled on", fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, required=True, help="directory of train_<d>/heldout_<d>.safetensors")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="where transfer.json/.md/.png go")
    parser.add_argument("--devices", default="4,8", help="device counts (default 4,8)")
    args = parser.parse_args(argv)
    train, held = load_profiles(args.profiles)
    rows = transfer_study(train, held, devices=tuple(int(d) for d in args.devices.split(",")))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "transfer.json", rows)
    table = markdown(rows)
    atomic_write_text(args.out_dir / "transfer.md", table + "\n")
    plot(rows, args.out_dir / "transfer.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.transfer", main))
