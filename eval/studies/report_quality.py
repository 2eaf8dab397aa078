"""Tables and plots of the quality study from `quality_results.json` (made by `occult_hf.eval.studies.quality`).

    python -m occult_hf.eval.studies.report_quality RESULTS_DIR --out-dir docs

writes `quality.md` (the model, the routing-structure table, the quality table with the goals, the
drift table) and `quality_ppl.png` into `--out-dir`, and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from occult_hf.utils.atomic import atomic_save_figure, atomic_write_text
from .quality import FORGET_DOMAIN, FT_DOMAIN


def describe_model(results: dict) -> str:
    base = results["base"]
    r = base["recipe"]
    ppl = ", ".join(f"{d} {v:.2f}" for d, v in base["heldout_perplexity"].items())
    return (f"`OlmoeForCausalLM` trained from scratch by `occult train --recipe {r['name']}` "
            f"({base['parameters'] / 1e6:.1f}M parameters; E={r['num_experts']} experts of width {r['intermediate_size']}, "
            f"top-{r['top_k']}, {r['num_layers']} layers at hidden {r['hidden_size']}, BPE vocabulary {r['vocab_size']}), "
            f"{base['steps']} steps x {r['batch_size']} x {r['seq_len']} = {base['tokens_seen'] / 1e6:.1f}M tokens of "
            f"{' + '.join(r['train_domains'])} in {base['wall_s']:.0f} s on {base['device']}; final training loss "
            f"{base['final_loss']:.3f}; held-out perplexity {ppl}.")  # fmt: skip


def structure_table(results: dict) -> str:
    lines = ["| held-out domain | load entropy (learned / random router) | top-10% pairs' share of co-activations (learned / random) | hottest expert / mean load |",
             "|---|---|---|---|"]  # fmt: skip
    for domain, s in results["base_routing"]["structure"].items():
        m = s["mean"]
        lines.append(f"| {domain} | {m['load_entropy']:.3f} / {m['load_entropy_random']:.3f} | "
                     f"{m['top10_pair_share']:.3f} / {m['top10_pair_share_random']:.3f} | {m['max_expert_load_over_mean']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def quality_table(results: dict) -> tuple[str, dict]:
    """The variants' table and the goals `{name: (ratio, met)}`.

    "vs unpruned" compares a fine-tuned variant with the plain fine-tune (same steps, data and seed)
    and a variant without fine-tuning with the base model itself (its held-out perplexity).
    """
    rows = {v["variant"]: v for v in results["variants"]}
    plain = rows.get("plain", {})
    plain_ppl = plain.get("perplexity", {}).get(FT_DOMAIN)
    base_ppl = results.get("base", {}).get("heldout_perplexity", {}).get(FT_DOMAIN)
    lines = [f"| variant | fine-tuned | N_d | ppl {FT_DOMAIN} (B) | vs unpruned (plain fine-tune / base) | ppl {FORGET_DOMAIN} (A) | CT (held-out B) | remote copies | bytes/token/layer | removed weight |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    order = ["plain"] + sorted((n for n in rows if n != "plain"), key=lambda n: (n.startswith("noft"), n))
    for name in order:
        v = rows[name]
        if "perplexity" not in v:
            lines.append(f"| {name} | | | {v.get('error') or v.get('skipped')} | | | | | | |")
            continue
        ppl_b = v["perplexity"][FT_DOMAIN]
        reference = plain_ppl if v["fine_tuned"] else base_ppl
        ratio = f"{ppl_b / reference:.4f}" if reference else ""
        lines.append(f"| {name} | {'yes' if v['fine_tuned'] else 'no'} | {v['max_devices_per_token'] or '-'} | {ppl_b:.3f} | {ratio} | "
                     f"{v['perplexity'][FORGET_DOMAIN]:.3f} | {v['ct']:.3f} | {v['remote_copies']:.3f} | {v['bytes_per_token']:.0f} | {v['removed_weight']:.3f} |")  # fmt: skip
    goals = {}
    for n_d in (2, 1):
        for mode in ("router", "similarity"):
            v = rows.get(f"{mode}-{n_d}", {})
            if plain_ppl and "perplexity" in v:
                ratio = v["perplexity"][FT_DOMAIN] / plain_ppl
                goals[f"{mode} N_d={n_d} fine-tuned within 1% of plain fine-tuning"] = (ratio, ratio <= 1.01)
    return "\n".join(lines), goals


def drift_table(results: dict) -> str:
    lines = ["| fine-tune | CT, placement planned before (held-out B) | CT, re-planned on fine-tuned routing | before / re-planned | balance before / re-planned | callback drift watch at the last check: ct_current / ct_replanned |",
             "|---|---:|---:|---:|---|---|"]  # fmt: skip
    for v in results["variants"]:
        if "drift" not in v:
            continue
        d = v["drift"]
        watch = [h for h in v.get("callback_logs", []) if "occult/drift/ct_current" in h]
        w = f"{watch[-1]['occult/drift/ct_current']:.3f} / {watch[-1]['occult/drift/ct_replanned']:.3f} (step {watch[-1].get('step')})" if watch else "no check logged"
        lines.append(f"| {v['variant']} | {d['ct_before']:.3f} | {d['ct_replanned']:.3f} | {d['ct_before'] / d['ct_replanned']:.3f} | "
                     f"{d['balance_before']:.2f} / {d['balance_replanned']:.2f} | {w} |")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {v["variant"]: v for v in results["variants"] if "perplexity" in v}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode, marker in (("router", "o"), ("similarity", "s")):
        for ft, style in ((True, "-"), (False, ":")):
            pts = sorted((v["max_devices_per_token"], v["perplexity"][FT_DOMAIN], v["ct"]) for v in rows.values()
                         if v["mode"] == mode and v["fine_tuned"] == ft)  # fmt: skip
            if pts:
                label = f"{mode}, {'fine-tuned' if ft else 'no fine-tune'}"
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker, label=label)
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], style, marker=marker, label=label)
    if "plain" in rows:
        axes[0].axhline(rows["plain"]["perplexity"][FT_DOMAIN], color="k", lw=1, label="plain fine-tune")
        axes[0].axhline(1.01 * rows["plain"]["perplexity"][FT_DOMAIN], color="k", lw=0.8, ls="--", label="plain + 1%")
        axes[1].axhline(rows["plain"]["ct"], color="k", lw=1, label="unpruned")
    axes[0].set(xlabel="N_d (devices per token, D=4)", ylabel=f"held-out perplexity, {FT_DOMAIN}", yscale="log")
    axes[1].set(xlabel="N_d (devices per token, D=4)", ylabel="mean CT (held-out)")
    for ax in axes:
        ax.set_xticks([1, 2, 3])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)


def render(results: dict) -> str:
    parts = [
        f"Model: {describe_model(results)}",
        f"Devices: {', '.join(results['devices'])}; date {results['date']}; stage times (s): {results['timings_s']}.",
        "### Learned routing against a random router\n\n" + structure_table(results),
    ]
    if any(v["variant"] == "plain" for v in results["variants"]):
        quality, goals = quality_table(results)
        goal_lines = "\n".join(f"- {name}: ratio {ratio:.4f} -> {'met' if ok else 'NOT met'}" for name, (ratio, ok) in goals.items())
        parts += ["### Quality after pruning and fine-tuning\n\n" + quality, "Goals:\n" + goal_lines,
                  "### Drift\n\n" + drift_table(results)]  # fmt: skip
    else:
        parts.append("No fine-tuning variant finished in this run.")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.report_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="directory with quality_results.json")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    results = json.loads((args.results / "quality_results.json").read_text())
    text = render(results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out_dir / "quality_tables.md", text + "\n")
    if any(v["variant"] == "plain" for v in results["variants"]):
        plot(results, args.out_dir / "quality_ppl.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
