"""The `occult` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib

#: subcommand modules of this package, in the order `occult --help` lists them
SUBCOMMANDS: tuple[str, ...] = ("demo", "profile", "place", "report", "eval", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="occult",
        description="Occult expert parallelism for Hugging Face MoE models: profile routing, place experts, "
        "report communication, benchmark and evaluate.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; bad input (a wrong file, an incompatible profile) ends in one clear line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as error:
        parser.exit(2, f"occult {args.command}: error: {error}\n")

