"""`occult train`: train an `OlmoeForCausalLM` from scratch with `Trainer` on local text domains.

    occult train --recipe tiny --corpus-dir ../shared/data/corpus --out runs/tiny

prepares the data (the `datasets` text builder on the corpus files, documents split on U+001E, a
held-out split per domain, a BPE tokenizer trained on the training split; cached in
`<out>/data` or `--data-dir`), trains with tqdm progress and writes the checkpoint, `recipe.json`,
`train_log.json` and `loss_curve.png` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from . import add_no_progress_argument


def register(subparsers) -> None:
    from ..training.recipes import RECIPES

    parser = subparsers.add_parser(
        "train",
        help=f"train an OLMoE from scratch with Trainer on local text (recipes: {', '.join(RECIPES)})",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tiny", help="recipe (default: tiny)")
    parser.add_argument("--corpus-dir", default="../shared/data/corpus", help="directory of <domain>.txt.gz files")
    parser.add_argument("--data-dir", default=None, help="prepared data (made here when absent; default: OUT/data)")
    parser.add_argument("--out", required=True, help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=None, help="override the recipe's seed")
    parser.add_argument("--max-steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--time-budget", type=float, default=None, help="override the recipe's time budget (s)")
    parser.add_argument("--prepare-only", action="store_true", help="prepare the data and stop")
    add_no_progress_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..training import get_recipe, prepare_data, train

    changes = {k: v for k, v in (("seed", args.seed), ("max_steps", args.max_steps), ("time_budget_s", args.time_budget)) if v is not None}
    recipe = get_recipe(args.recipe, **changes)
    data_dir = args.data_dir or os.path.join(args.out, "data")
    if not os.path.isfile(os.path.join(data_dir, "data.json")):
        start = time.perf_counter()
        prepare_data(args.corpus_dir, data_dir, vocab_size=recipe.vocab_size, heldout_fraction=recipe.heldout_fraction,
                     max_chars_per_domain=recipe.max_chars_per_domain, cache_dir=os.path.join(data_dir, "hf_cache"))  # fmt: skip
        print(f"occult train: prepared {data_dir} in {time.perf_counter() - start:.1f} s")
    if args.prepare_only:
        return 0
    log = train(recipe, data_dir, args.out)
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity", "parameters")}, indent=1))
    print(f"occult train: checkpoint, recipe.json, train_log.json and loss_curve.png in {args.out}")
    return 0
