"""Tables and plots of the quality study from its results (made by `occult_hf.eval.studies.quality`).

    python -m occult_hf.eval.studies.report_quality RESULTS_DIR --out-dir OUT

reads `quality_results.json` and `profiles_{train,heldout}.tar.gz` in RESULTS_DIR and writes into `--out-dir`:
`quality_tables.md` (the model, learned routing, one quality table per D, the goals met or not, the
seed spread, drift, transfer), `quality_ppl.png`, and the transfer study's `transfer.json`,
`transfer.md`, `transfer.png`; it prints the markdown.

In a quality table every fine-tuned row is the mean over its seeds with the min-max beside it; the
paired difference divides each seed's perplexity on B by that of `plain` with the same seed (same
data order), a row without fine-tuning by the base model's. Accuracy is lm-eval's `acc` with its
standard error (the mean of the seeds' standard errors).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_json, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.errors import run_command

from .quality import FORGET_DOMAIN, FT_DOMAIN, REFINED
from .variants import Variant

#: the pruned fine-tune must stay within this factor of plain fine-tuning (docs/design.md §8)
WITHIN = 1.01


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """`mean (min-max)`, or the one value."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(np.mean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _percent(values: list[float]) -> str:
    """Ratios as `+0.70% (+0.51..+0.92%)`: the mean difference and its range."""
    pct = [100 * (v - 1) for v in values]
    if len(pct) == 1:
        return f"{pct[0]:+.2f}%"
    return f"{np.mean(pct):+.2f}% ({min(pct):+.2f}..{max(pct):+.2f}%)"


class Study:
    """The results of one study, indexed by variant."""

    def __init__(self, results: dict) -> None:
        self.results = results
        self.settings = results["settings"]
        self.device_limits = {int(d): tuple(n) for d, n in self.settings["device_limits"].items()}
        self.seeds = tuple(self.settings["seeds"])
        self.modes = tuple(self.settings["modes"])
        self.tasks = list((results.get("tasks") or {}).get("tasks", {}))
        self.rows = {v["variant"]: v for v in results["variants"] if "error" not in v}
        self.errors = {v["variant"]: v["error"] for v in results["variants"] if "error" in v}

    def get(self, variant: Variant) -> dict | None:
        return self.rows.get(variant.name)

    def ppl_b(self, variant: Variant) -> float | None:
        row = self.get(variant)
        return row["perplexity"][FT_DOMAIN] if row else None

    def members(self, fine_tuned: bool, mode: str | None, devices: int | None, n_d: int | None) -> list[Variant]:
        """The variants of one table row: one per seed when fine-tuned, else the one."""
        pruned = (mode, devices, n_d) if mode else (None, None, None)
        seeds = self.seeds if fine_tuned else (None,)
        return [Variant(fine_tuned, s, *pruned) for s in seeds]

    def ratios(self, variants: list[Variant]) -> list[float]:
        """Perplexity on B of each variant over its reference's (paired by seed), where both exist."""
        out = []
        for v in variants:
            mine, ref = self.ppl_b(v), self.ppl_b(v.reference)
            if mine is not None and ref is not None:
                out.append(mine / ref)
        return out


def describe_model(results: dict) -> str:
    base = results["base"]
    r = base["recipe"]
    ppl = ", ".join(f"{d} {v:.2f}" for d, v in base["heldout_perplexity"].items())
    return (f"`OlmoeForCausalLM` trained from scratch by recipe `{r['name']}` "
            f"({base['parameters'] / 1e6:.1f}M parameters; E={r['num_experts']} experts of width {r['intermediate_size']}, "
            f"top-{r['top_k']}, {r['num_layers']} layers at hidden {r['hidden_size']}, BPE vocabulary {r['vocab_size']}), "
            f"{base['steps']} steps x {r['batch_size']} x {r['seq_len']} = {base['tokens_seen'] / 1e6:.1f}M tokens of "
            f"{' + '.join(r['train_domains'])} in {base['wall_s']:.0f} s on {base['device']}; final training loss "
            f"{base['final_loss']:.3f}; held-out perplexity {ppl}.{_fingerprint(results)}")  # fmt: skip


def _fingerprint(results: dict) -> str:
    """The sentence naming the base job's outputs every variant ran on (runs before the fingerprint have none)."""
    if not results.get("base_fingerprint"):
        return ""
    return f" Base job outputs (weights, placements, profile, tasks) SHA-256 {results['base_fingerprint'][:16]}: every variant below ran on them."


def structure_table(results: dict) -> str:
    header = ["held-out domain", "load entropy (learned / random router)",
              "top-10% pairs' share of co-activations (learned / random)", "hottest expert / mean load"]  # fmt: skip
    rows = []
    for domain, s in results["base_routing"]["structure"].items():
        m = s["mean"]
        rows.append([domain, f"{m['load_entropy']:.3f} / {m['load_entropy_random']:.3f}",
                     f"{m['top10_pair_share']:.3f} / {m['top10_pair_share_random']:.3f}", f"{m['max_expert_load_over_mean']:.2f}"])  # fmt: skip
    return markdown_table(header, rows)


def _accuracy_cell(rows: list[dict], task: str) -> str:
    accs = [r["accuracy"][task]["acc"] for r in rows if "accuracy" in r]
    if not accs:
        return ""
    stderr = np.mean([r["accuracy"][task]["acc_stderr"] for r in rows if "accuracy" in r])
    spread = "" if len(accs) == 1 else f" ({min(accs):.3f}-{max(accs):.3f})"
    return f"{np.mean(accs):.3f} ±{stderr:.3f}{spread}"


def quality_table(study: Study, devices: int) -> str:
    """One row per variant at `devices` (module docstring for the cells)."""
    tasks = study.tasks
    header = ["variant", "fine-tuned", "seeds", f"ppl {FT_DOMAIN} (B)", "paired difference (vs plain / base)", f"ppl {FORGET_DOMAIN} (A)",
              *(f"{t} acc" for t in tasks), "CT", "bytes/token/layer", "removed weight"]  # fmt: skip
    lines = []
    groups = []
    for fine_tuned in (True, False):
        groups.append((fine_tuned, None, None))
        groups += [(fine_tuned, mode, n) for mode in study.modes for n in study.device_limits[devices]]
    for fine_tuned, mode, n_d in groups:
        members = study.members(fine_tuned, mode, devices if mode else None, n_d)
        rows = [study.get(v) for v in members if study.get(v)]
        label = members[0].row
        if not rows:
            missing = ", ".join(sorted({f"failed ({study.errors[v.name].split(':')[0]})" if v.name in study.errors else "not run"
                                        for v in members}))  # the whole errors: the report's list of failed variants
            lines.append([label, "yes" if fine_tuned else "no", "0", missing, *([""] * (len(header) - 4))])
            continue
        comm = [r["communication"][str(devices)] for r in rows]
        paired = "-" if not mode else _percent(study.ratios(members)) if study.ratios(members) else "no reference"
        cells = [label, "yes" if fine_tuned else "no", str(len(rows)),
                 _spread([r["perplexity"][FT_DOMAIN] for r in rows]), paired, _spread([r["perplexity"][FORGET_DOMAIN] for r in rows]),
                 *(_accuracy_cell(rows, t) for t in tasks),
                 f"{np.mean([c['ct'] for c in comm]):.3f}", f"{np.mean([c['bytes_per_token'] for c in comm]):.0f}",
                 f"{np.mean([r['removed_weight'] for r in rows]):.3f}"]  # fmt: skip
        lines.append(cells)
    return markdown_table(header, lines, align="llrrrr" + "r" * len(tasks) + "rrr")


def goals(study: Study) -> list[str]:
    """The issue's goals, each met or not, with the seed spread (module docstring)."""
    out = []
    plain = [study.ppl_b(Variant(True, s)) for s in study.seeds if study.ppl_b(Variant(True, s)) is not None]
    if len(plain) > 1:
        out.append(f"- Seed spread of plain fine-tuning itself: perplexity on B {min(plain):.3f}-{max(plain):.3f} "
                   f"({100 * (max(plain) - min(plain)) / np.mean(plain):.2f}% of the mean) over {len(plain)} seeds.")  # fmt: skip
    for devices in sorted(study.device_limits):
        for mode in study.modes:
            if 2 not in study.device_limits[devices]:
                continue
            members = study.members(True, mode, devices, 2)
            ratios = study.ratios(members)
            per_seed = ", ".join(f"seed {v.seed} {100 * (study.ppl_b(v) / study.ppl_b(v.reference) - 1):+.2f}%"
                                 for v in members if study.ppl_b(v) is not None and study.ppl_b(v.reference) is not None)  # fmt: skip
            # one measured seed outside 1% decides an every-seed goal; only all seeds inside it meet it
            if ratios and max(ratios) > WITHIN:
                verdict = "**not met**" + (f" ({len(ratios)} of {len(study.seeds)} seeds measured)" if len(ratios) < len(study.seeds) else "")
            elif len(ratios) < len(study.seeds):
                verdict = f"not established ({len(ratios)} of {len(study.seeds)} seeds measured)"
            else:
                verdict = "**met**"
            out.append(f"- D={devices}, {mode} N_d=2 + fine-tune within 1% of plain fine-tuning on every seed: {verdict} ({per_seed or 'no seed'}).")
    for devices in sorted(study.device_limits):
        for n_d in study.device_limits[devices]:
            for fine_tuned in (True, False):
                pairs = []
                for router, similarity in zip(study.members(fine_tuned, "router", devices, n_d), study.members(fine_tuned, "similarity", devices, n_d)):
                    if study.ppl_b(router) is not None and study.ppl_b(similarity) is not None:
                        pairs.append(study.ppl_b(similarity) / study.ppl_b(router))
                if not pairs:
                    continue
                if all(p > 1 for p in pairs):
                    winner = f"router lower on {'every seed' if fine_tuned else 'the base model'}"
                elif all(p < 1 for p in pairs):
                    winner = f"similarity lower on {'every seed' if fine_tuned else 'the base model'}"
                else:
                    winner = "mixed: the sign changes between seeds"
                out.append(f"- D={devices}, N_d={n_d}, {'fine-tuned' if fine_tuned else 'no fine-tune'}: similarity against router "
                           f"(perplexity on B, paired by seed) {_percent(pairs)}; {winner}.")  # fmt: skip
    for devices in sorted(study.device_limits):
        for mode in study.modes:
            for fine_tuned in (True, False):
                ratios = study.ratios(study.members(fine_tuned, mode, devices, 1))
                if ratios:
                    against = "plain fine-tuning" if fine_tuned else "the base model"
                    out.append(f"- N_d=1, D={devices}, {mode}, {'fine-tuned' if fine_tuned else 'no fine-tune'}: {_percent(ratios)} against {against}"
                               f"{'' if max(ratios) <= WITHIN else ' (not within 1%)'}.")  # fmt: skip
    return out


def drift_table(study: Study) -> str:
    header = ["D", "CT, placement planned before fine-tuning (held-out B)", "CT, re-planned on the fine-tuned routing",
              "before / re-planned", "balance before / re-planned", "seeds"]  # fmt: skip
    rows = []
    for devices in sorted(study.device_limits):
        drifts = [r["drift"][str(devices)] for v in study.members(True, None, None, None) if (r := study.get(v)) and "drift" in r]
        if not drifts:
            continue
        rows.append([devices, _spread([d["ct_before"] for d in drifts]), _spread([d["ct_replanned"] for d in drifts]),
                     _spread([d["ct_before"] / d["ct_replanned"] for d in drifts]),
                     f"{np.mean([d['balance_before'] for d in drifts]):.2f} / {np.mean([d['balance_replanned'] for d in drifts]):.2f}", len(drifts)])  # fmt: skip
    lines = [markdown_table(header, rows, align="rrrrlr")]
    watches = []
    for v in study.members(True, None, None, None):
        checks = [h for h in (study.get(v) or {}).get("callback_logs", []) if "occult/drift/ct_current" in h]
        if checks:
            watches.append(f"seed {v.seed}: {checks[-1]['occult/drift/ct_current']:.3f} / {checks[-1]['occult/drift/ct_replanned']:.3f} (step {checks[-1].get('step')})")
    if watches:
        exact = max(study.device_limits)
        lines += ["", f"`OccultCallback`'s drift watch at its last check (D={exact}, ct_current / ct_replanned on its training window): " + "; ".join(watches) + "."]
    return "\n".join(lines)


def plot(study: Study, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted(study.device_limits)
    fig, axes = plt.subplots(1, len(devices), figsize=(4.6 * len(devices), 3.4), squeeze=False)
    for ax, d in zip(axes[0], devices):
        for mode, marker in (("router", "o"), ("similarity", "s")):
            for fine_tuned, style in ((True, "-"), (False, ":")):
                pts = []
                for n_d in study.device_limits[d]:
                    values = [study.ppl_b(v) for v in study.members(fine_tuned, mode, d, n_d) if study.ppl_b(v) is not None]
                    if values:
                        pts.append((n_d, np.mean(values), np.mean(values) - min(values), max(values) - np.mean(values)))
                if pts:
                    x, y, lo, hi = zip(*pts)
                    ax.errorbar(x, y, yerr=[lo, hi], fmt=style, marker=marker, capsize=3,
                                label=f"{mode}, {'fine-tuned' if fine_tuned else 'no fine-tune'}")  # fmt: skip
        plain = [study.ppl_b(v) for v in study.members(True, None, None, None) if study.ppl_b(v) is not None]
        if plain:
            ax.axhline(np.mean(plain), color="k", lw=1, label="plain fine-tune (mean)")
            ax.axhline(WITHIN * np.mean(plain), color="k", lw=0.8, ls="--", label="plain + 1%")
        ax.set(xlabel=f"N_d (devices per token, D={d})", ylabel=f"held-out perplexity, {FT_DOMAIN}", yscale="log",
               xticks=list(study.device_limits[d]))  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)


#: the base job's routing profiles, which the transfer study reads
PROFILE_ARCHIVES = ("profiles_train.tar.gz", "profiles_heldout.tar.gz")


def _read_results(results_dir: Path) -> dict:
    """`quality_results.json` of `results_dir`; a one-line error when it is missing or holds no finished base job."""
    path = results_dir / "quality_results.json"
    if not path.is_file():
        raise SystemExit(f"report_quality: {path} does not exist: give the --out directory of the quality command")
    results = json.loads(path.read_text())
    if not results.get("base"):
        raise SystemExit(f"report_quality: {path}: the base job has not finished (cut by the deadline); run the quality "
                         f"command again with the same --work to go on; nothing to report yet")  # fmt: skip
    return results


def transfer(results_dir: Path, out_dir: Path, devices: tuple[int, ...]) -> str:
    """The transfer study on the base model's profiles (`profiles_{train,heldout}.tar.gz`): its markdown;
    files in `out_dir`."""
    from . import transfer as study

    with tempfile.TemporaryDirectory() as tmp:
        for name in PROFILE_ARCHIVES:
            with tarfile.open(results_dir / name) as tar:
                tar.extractall(tmp, filter="data")
        train, held = study.load_profiles(Path(tmp) / "profiles")
        rows = study.transfer_study(train, held, devices=devices)
    atomic_write_json(out_dir / "transfer.json", rows)
    table = study.markdown(rows)
    atomic_write_text(out_dir / "transfer.md", table + "\n")
    study.plot(rows, out_dir / "transfer.png")
    return study.summary(rows) + "\n\nEvery pair: `transfer.md`."


def failures(study: Study) -> str:
    """One line per variant whose worker recorded an error, with the error (the table cells name only its kind)."""
    return "\n".join(f"- {name}: {error[:300]}" for name, error in sorted(study.errors.items()))


def render(results: dict, transfer_md: str | None = None) -> str:
    study = Study(results)
    parts = [f"Model: {describe_model(results)}",
             f"Devices: {', '.join(results['devices'])}; date {results['date']}; this run's stage times (s): {results['timings_s']}; "
             f"variants with results: {len(study.rows)}, missing: {len(results['missing'])}"
             + (f" ({', '.join(results['missing'])})" if results["missing"] else "") + ".",
             "### Learned routing against a random router\n\n" + structure_table(results)]  # fmt: skip
    if results.get("tasks"):
        items = ", ".join(f"{t} {n}" for t, n in results["tasks"]["items"].items())
        parts.append(f"Multiple-choice tasks (4 choices, chance 0.25), items: {items}.")
    for devices in sorted(study.device_limits):
        parts.append(f"### Quality at D={devices}\n\n" + quality_table(study, devices))
    parts.append("### Goals\n\n" + "\n".join(goals(study)))
    parts.append("### Drift (plain fine-tunes)\n\n" + drift_table(study))
    if study.errors:
        parts.append("### Variants that failed (run again to retry them)\n\n" + failures(study))
    if transfer_md:
        parts.append(f"### Transfer (refined with {REFINED})\n\n" + transfer_md)
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.report_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="directory with quality_results.json and profiles_{train,heldout}.tar.gz")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--no-transfer", action="store_true", help="skip the transfer study (minutes of CPU at E=64)")
    args = parser.parse_args(argv)
    results = _read_results(args.results)
    if not args.no_transfer:
        missing = [name for name in PROFILE_ARCHIVES if not (args.results / name).is_file()]
        if missing:
            raise SystemExit(f"report_quality: {args.results} has no {', '.join(missing)} (the base job's profiles, "
                             f"which the transfer study reads); copy them beside the results, or pass --no-transfer")  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    devices = tuple(sorted(int(d) for d in results["settings"]["device_limits"]))
    transfer_md = None if args.no_transfer else transfer(args.results, args.out_dir, devices)
    text = render(results, transfer_md)
    atomic_write_text(args.out_dir / "quality_tables.md", text + "\n")
    plot(Study(results), args.out_dir / "quality_ppl.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.report_quality", main))
