"""`occult demo`: the main job, end to end on a model with learned routing (no download, no GPU).

It loads the small `OlmoeForCausalLM` that ships inside the package (`occult_hf/data/tiny_olmoe`:
trained from scratch by `occult train --recipe tiny` on the project's three text domains, with its
BPE tokenizer, `recipe.json` and `train_log.json` beside the weights), profiles its routing through
the same router hooks `occult profile` uses on text the model never trained on (this package's own
Python sources, as a frozen snapshot: the even-numbered files plan, the odd-numbered ones are held out), saves and reloads
the profile, plans placements with every registered method, and prints per layer the held-out CT,
bounds, remote copies and device load, then the routing weight that collaboration pruning to each
`N_d` would remove under each placement. `--model DIR` runs the same on any checkpoint of a
supported family with its tokenizer (loaded through `AutoModelForCausalLM`, vanilla; for example one
made by `occult train`), and the report names the model it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..utils.arguments import positive_int
from ..utils.strict_json import read_json_file
from .devices import add_num_devices_argument

def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: profile the shipped tiny trained OLMoE, plan placements, print the report (no download)",
        description=__doc__.split("\n\n")[0],
    )
    add_num_devices_argument(parser, help="devices D to plan for (default: 8)", default=8)
    parser.add_argument("--out", default="occult_demo", help="directory for profiles, placements and plots (default: ./occult_demo)")
    parser.add_argument("--model", help="a checkpoint directory of any supported MoE family, with its tokenizer (default: the shipped tiny OLMoE)")
    parser.add_argument("--tokens", type=positive_int, default=12_288, help="tokens to profile in each of the plan and held-out halves (default: 12288)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the profile's token sample (default: 0)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.set_defaults(func=run)


def describe_checkpoint(path: str | os.PathLike, model) -> str:
    """One sentence: what the model is, from its `recipe.json` and `train_log.json` when both are present and hold
    what `occult train` writes, else its class and shape (another tool's files of those names describe no occult
    training)."""
    path = Path(path)
    recipe_file, log_file = path / "recipe.json", path / "train_log.json"
    if recipe_file.is_file() and log_file.is_file():  # broken JSON is still an error naming the file
        recipe, log = read_json_file(recipe_file, "recipe"), read_json_file(log_file, "training log")
        with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
            return _trained_description(recipe, log)
    from occult_hf.patches.base import adapter_for

    adapter, config = adapter_for(model.config), model.config
    return (
        f"the {type(model).__name__} checkpoint {path} (model_type {config.model_type!r}, "
        f"E={adapter.num_experts(config)}, k={adapter.top_k(config)}, {config.num_hidden_layers} layers)"
    )


def _trained_description(recipe: dict, log: dict) -> str:
    """The sentence about a model `occult train` made, from its recipe and training log; raises when a field is
    missing or of another type."""
    ppl = ", ".join(f"{d} {v:.1f}" for d, v in log.get("heldout_perplexity", {}).items())
    return (
        f"an OlmoeForCausalLM trained from scratch by `occult train --recipe {recipe['name']}` "
        f"({log['parameters'] / 1e6:.2f}M parameters, E={recipe['num_experts']}, k={recipe['top_k']}, "
        f"{recipe['num_layers']} layers at hidden {recipe['hidden_size']}, {log['tokens_seen'] / 1e3:.0f}k tokens of "
        f"{' + '.join(recipe['train_domains'])}, final training loss {log['final_loss']:.2f}; held-out perplexity {ppl})"
    )


def run(args: argparse.Namespace) -> int:
    # the demo model is so small that thread start-up costs more than it saves (and on a shared
    # 2-core machine two busy-waiting threads can make a forward 50x slower): one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _token_windows(texts: list[str], tokenizer, max_tokens: int, seq_len: int = 128) -> list[list[int]]:
    """Consecutive `seq_len` windows of the texts' tokens (each text ends with eos), up to `max_tokens`."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    return [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]


def _routing_of_every_token(model, windows: list[list[int]], capture_routing) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """`capture_routing` of every window, the shorter last one too (it batches windows of one length)."""
    by_length: dict[int, list[list[int]]] = {}
    for window in windows:
        by_length.setdefault(len(window), []).append(window)
    parts = [capture_routing(model, np.array(group)) for group in by_length.values()]
    return {layer: tuple(np.concatenate([part[layer][i] for part in parts]) for i in (0, 1)) for layer in parts[0]}


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from occult_hf.patches.base import adapter_for
    from ..placement import available_planners
    from ..profile import RoutingProfile
    from ..training.shipped import demo_sources, tiny_checkpoint_path
    from ..training.evaluate import capture_routing, removed_weight
    from ..utils.atomic import atomic_write_json
    from ..utils.tables import markdown_table
    from . import check_output_dir
    from .report import plan_methods, print_report

    check_output_dir(args.out)
    os.makedirs(args.out, exist_ok=True)
    with resources.as_file(tiny_checkpoint_path()) if args.model is None else contextlib.nullcontext(args.model) as path:
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"--model {os.fspath(path)!r} is not a checkpoint directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, occult_config=None).eval()  # vanilla: the routing as trained
        tokenizer = AutoTokenizer.from_pretrained(path)
        about = describe_checkpoint(path, model)
        label = "the shipped tiny OLMoE" if args.model is None else f"the {type(model).__name__} at {path}"
    config = model.config
    sources = demo_sources()
    splits = {"plan": sources[0::2], "held_out": sources[1::2]}
    windows = {name: _token_windows(texts, tokenizer, args.tokens) for name, texts in splits.items()}
    profiles = {}
    for name, wins in windows.items():
        profile = RoutingProfile.collect(
            model, wins, batch_size=16, max_length=128, seed=args.seed,
            source=f"occult demo: {label} on the {'even' if name == 'plan' else 'odd'}-numbered occult_hf source files",
        )  # fmt: skip
        file = os.path.join(args.out, f"profile_{name}.safetensors")
        profile.save(file)
        profiles[name] = RoutingProfile.load(file, model=model)  # the file path users take
    placements = plan_methods(profiles["plan"], args.num_devices, available_planners(), {})
    for method, placement in placements.items():
        placement.save(os.path.join(args.out, f"placement_{method}.json"))
    tokens = {name: p.layer(min(p.layers)).token_count for name, p in profiles.items()}
    print(
        f"occult demo: {about}.\n"
        f"Its routing was profiled through its real routers on text it never trained on: occult_hf's own Python sources (a frozen snapshot). "
        f"Placements for D={args.num_devices} planned on {tokens['plan']} tokens (even-numbered files), measured below on "
        f"{tokens['held_out']} held-out tokens (odd-numbered files)."
    )
    print_report(profiles["held_out"], placements, None if args.no_plots else args.out)
    routing = _routing_of_every_token(model, windows["held_out"], capture_routing)
    k, num_devices = adapter_for(config).top_k(config), args.num_devices
    print(f"\nCollaboration pruning to N_d devices per token (D={num_devices}), held-out tokens, mean over layers: "
          f"routing weight removed / tokens that lose an expert")  # fmt: skip
    pruning, rows = {}, []
    for n_d in range(1, min(k, num_devices) + 1):
        cells = []
        for method, placement in placements.items():
            per_layer = [removed_weight(ids, w, placement.device_of(l), num_devices, n_d) for l, (ids, w) in routing.items()]
            removed, pruned = float(np.mean([r[0] for r in per_layer])), float(np.mean([r[1] for r in per_layer]))
            pruning[f"{method}/N_d={n_d}"] = {"removed_weight": removed, "tokens_pruned": pruned}
            cells.append(f"{removed:.3f} / {pruned:.3f}")
        rows.append([n_d, *cells])
    print(markdown_table(["N_d", *placements], rows, align="r" * (1 + len(placements))))
    atomic_write_json(os.path.join(args.out, "pruning.json"), pruning)
    print(f"profiles, placements and pruning.json in {args.out}/")
    return 0

