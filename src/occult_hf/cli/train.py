"""`occult train`: train an `OlmoeForCausalLM` from scratch with `Trainer` on local text domains.

    occult train --recipe tiny --corpus-dir my_corpus --out runs/tiny

`--corpus-dir` holds one file per domain: `<domain>.txt` / `.txt.gz` (documents are the blocks between
blank lines, or the pieces between `--separator`s) or `<domain>.jsonl` / `.jsonl.gz` (one JSON object per
document, its text in `--text-field`); docs/quality.md shows the format. The command prepares the data
(read through `datasets`, a held-out split per domain, a BPE tokenizer trained on the training split; cached
in `<out>/data` or `--data-dir`, reused only when prepared from the same corpus files with the same settings),
trains with tqdm progress and writes the checkpoint, `recipe.json`, `loss_curve.png` and, last, `train_log.json` to
`--out`. An `--out` that holds a finished run (its `train_log.json`) is refused unless `--overwrite` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from ..utils.arguments import positive_int, separator


def seconds(value: str) -> float:
    """`--time-budget`: a finite number of seconds > 0 (the budget schedules the steps that fit in it)."""
    try:
        budget = float(value)
    except ValueError:
        budget = math.nan
    if not (math.isfinite(budget) and budget > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return budget


def register(subparsers) -> None:
    from ..training.data import BLANK_LINE
    from ..training.recipes import RECIPES

    parser = subparsers.add_parser(
        "train",
        help=f"train an OLMoE from scratch with Trainer on local text (recipes: {', '.join(RECIPES)})",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tiny", help="recipe (default: tiny)")
    parser.add_argument("--corpus-dir",
                        help="directory of one <domain>.txt, .txt.gz, .jsonl or .jsonl.gz file per domain (needed unless --data-dir is prepared)")
    parser.add_argument("--separator", type=separator, default=BLANK_LINE,
                        help=f"what ends a document in a text file: {BLANK_LINE} (default) or a string, backslash escapes "
                             f"decoded ('\\x1e': documents separated by the ASCII record separator)")  # fmt: skip
    parser.add_argument("--text-field", default="text", help="the field of a .jsonl record that holds its text (default: text)")
    parser.add_argument("--train-domains", type=lambda v: tuple(v.split(",")),
                        help="comma-separated domains to train on (default: the recipe's; tiny: every domain)")  # fmt: skip
    parser.add_argument("--data-dir", help="prepared data (made here when absent; default: OUT/data)")
    parser.add_argument("--out", required=True, help="checkpoint directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the finished run (train_log.json) in --out; without it such an --out is refused")  # fmt: skip
    parser.add_argument("--seed", type=int, help="override the recipe's seed")
    parser.add_argument("--max-steps", type=positive_int, help="override the recipe's steps (>= 1)")
    parser.add_argument("--time-budget", type=seconds, help="override the recipe's time budget (s, > 0)")
    parser.add_argument("--compile", dest="torch_compile", action="store_true", default=None,
                        help="train through torch.compile (the recipe's torch_compile): faster on a GPU, not bitwise repeatable")  # fmt: skip
    parser.add_argument("--prepare-only", action="store_true", help="prepare the data and stop")
    parser.set_defaults(func=run)


def refuse_finished_run(out: str) -> None:
    """Stop before any data preparation or training when `out` holds a finished run: a run starts from scratch, so
    it would replace the earlier model (the data directory is likewise reused only when it matches)."""
    from ..training.train import finished_run

    finished = finished_run(out)
    if finished is not None:
        raise SystemExit(f"occult train: --out {out!r} holds a finished run ({finished}); give --overwrite to replace it, or another --out")


def run(args: argparse.Namespace) -> int:
    from ..training import PreparedData, get_recipe, prepare_data, train
    from ..training.data import preparation_settings
    from . import check_output_dir

    check_output_dir(args.out)
    if not (args.prepare_only or args.overwrite):
        refuse_finished_run(args.out)
    overrides = (("seed", args.seed), ("max_steps", args.max_steps), ("time_budget_s", args.time_budget), ("train_domains", args.train_domains),
                 ("torch_compile", args.torch_compile))  # fmt: skip
    recipe = get_recipe(args.recipe, **{k: v for k, v in overrides if v is not None})
    data_dir = args.data_dir or os.path.join(args.out, "data")
    if os.path.isfile(os.path.join(data_dir, "data.json")):
        settings = preparation_settings(args.corpus_dir, recipe.vocab_size, recipe.heldout_fraction, recipe.max_chars_per_domain,
                                        args.separator, args.text_field)  # fmt: skip
        PreparedData(data_dir).check_settings(settings)
        checked = "its corpus files and settings unchanged" if args.corpus_dir else "no --corpus-dir: only the recipe's settings checked"
        print(f"occult train: reusing the data prepared in {data_dir} ({checked})")
    elif args.corpus_dir is None:
        raise SystemExit(f"occult train: {data_dir!r} holds no prepared data (data.json): give --corpus-dir to prepare it")
    else:
        start = time.perf_counter()
        prepare_data(args.corpus_dir, data_dir, vocab_size=recipe.vocab_size, heldout_fraction=recipe.heldout_fraction,
                     max_chars_per_domain=recipe.max_chars_per_domain, separator=args.separator, text_field=args.text_field,
                     cache_dir=os.path.join(data_dir, "hf_cache"))  # fmt: skip
        print(f"occult train: prepared {data_dir} in {time.perf_counter() - start:.1f} s")
    if args.prepare_only:
        return 0
    log = train(recipe, data_dir, args.out)
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity", "parameters")}, indent=1))
    print(f"occult train: checkpoint, recipe.json, train_log.json and loss_curve.png in {args.out}")
    return 0
