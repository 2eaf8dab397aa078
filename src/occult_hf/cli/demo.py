"""`occult demo`: the main job, end to end on an embedded default (no download, no GPU).

It builds a real `OlmoeForCausalLM` from a small config in-process, profiles its routing over
the bytes of an embedded text snippet through the same router hooks `occult profile` uses,
saves and reloads the profile, plans placements with every registered method on the even lines
and measures them on the odd lines (held-out tokens), then prints the per-layer table and writes
the plots. The model's weights are random except for its router rows, which are drawn around
`E / group_size` shared directions (experts shuffled), so that routing has co-activation groups
for placement to find, as real routers do. The numbers show the code path at work, not what a
real checkpoint saves; for that, profile a real model or import a real trace.
"""

from __future__ import annotations

import argparse
import os
from importlib import resources

import numpy as np
import torch
from .devices import add_num_devices_argument

#: embedded text: one document per line, written for occult_hf (Apache-2.0, like the package)
DEMO_TEXT = "demo_text.npz"
#: token ids 0-2 are pad/bos/eos; byte b is token b + 3
_BYTE_OFFSET = 3


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: profile a tiny in-process OLMoE, plan placements, print the report (no download)",
        description=__doc__.split("\n\n")[0],
    )
    add_num_devices_argument(parser, help="devices D to plan for (default: 8)", default=8)
    parser.add_argument("--out", default="occult_demo", help="directory for profiles, placements and plots")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights and token samples")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.set_defaults(func=run)


def load_demo_documents() -> list[str]:
    """The embedded snippet's non-blank lines."""
    with resources.as_file(resources.files("occult_hf") / "data" / DEMO_TEXT) as path:
        with np.load(path, allow_pickle=False) as data:
            text = str(data["text"])
    return [line for line in text.split("\n") if line.strip()]


def byte_token_ids(document: str) -> list[int]:
    """UTF-8 bytes as token ids (the demo model has no tokenizer to download)."""
    return [b + _BYTE_OFFSET for b in document.encode("utf-8")]


def build_demo_model(
    seed: int = 0, num_experts: int = 32, top_k: int = 4, group_size: int = 4, num_layers: int = 4
) -> torch.nn.Module:
    """A small random `OlmoeForCausalLM` whose router rows form co-activation groups.

    At every layer, expert e's router row is `direction[group(e)] + 0.6 * noise`, with `group` a
    seeded shuffle of `E / group_size` equal groups: experts of one group score alike and are
    chosen together, and contiguous placement does not line up with the groups.
    """
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if num_experts % group_size:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of group_size ({group_size})")
    config = OlmoeConfig(
        vocab_size=256 + _BYTE_OFFSET,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OlmoeForCausalLM(config).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            group_E = torch.randperm(num_experts, generator=generator) // group_size
            directions = torch.randn(num_experts // group_size, hidden, generator=generator)
            noise = torch.randn(num_experts, hidden, generator=generator)
            layer.mlp.gate.weight.copy_((directions[group_E] + 0.6 * noise) / hidden**0.5)
    return model


def run(args: argparse.Namespace) -> int:
    # the demo model is so small that thread start-up costs more than it saves (and on a shared
    # 2-core machine two busy-waiting threads can make a forward 50x slower): one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from ..profile import RoutingProfile
    from .report import plan_methods, print_report
    from ..placement import available_planners
    from . import check_output_dir

    check_output_dir(args.out)
    os.makedirs(args.out, exist_ok=True)
    documents = load_demo_documents()
    model = build_demo_model(seed=args.seed)
    config = model.config
    splits = {"plan": documents[0::2], "held_out": documents[1::2]}
    profiles = {}
    for name, docs in splits.items():
        profile = RoutingProfile.collect(
            model,
            [byte_token_ids(d) for d in docs],
            batch_size=8,
            max_length=256,
            seed=args.seed,
            source=f"occult demo: tiny OLMoE on the {'even' if name == 'plan' else 'odd'} lines of the embedded snippet",
        )
        path = os.path.join(args.out, f"profile_{name}.safetensors")
        profile.save(path)
        profiles[name] = RoutingProfile.load(path, model=model)  # the file path users take
    placements = plan_methods(profiles["plan"], args.num_devices, available_planners(), {})
    for method, placement in placements.items():
        placement.save(os.path.join(args.out, f"placement_{method}.json"))
    tokens = {name: p.layer(min(p.layers)).token_count for name, p in profiles.items()}
    print(
        f"occult demo: a random OlmoeForCausalLM built in-process (E={config.num_experts}, k={config.num_experts_per_tok}, "
        f"{config.num_hidden_layers} MoE layers, hidden {config.hidden_size}) whose router rows were drawn in "
        f"{config.num_experts // 4} groups of 4 (shuffled), fed the bytes of an embedded "
        f"{sum(len(d) for d in documents)}-character snippet through its real routers.\n"
        f"Placements for D={args.num_devices} planned on {tokens['plan']} tokens (even lines), measured below on "
        f"{tokens['held_out']} held-out tokens (odd lines). The routing structure is planted: these numbers show the "
        f"code path, not the savings on a real checkpoint (profile one with `occult profile MODEL --text FILE` or "
        f"import a trace with `occult profile --from-trace`)."
    )
    print_report(profiles["held_out"], placements, None if args.no_plots else args.out)
    print(f"profiles and placements in {args.out}/")
    return 0
