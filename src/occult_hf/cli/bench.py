"""`occult bench <benchmark>`: GPU benchmarks that print a table (and write it, with a plot).

Each benchmark is a module `occult_hf.benchmarks.<name>` with `HELP` (one line), `DESCRIPTION`,
`add_arguments(parser)` and `run(args) -> int`; adding one means adding that module and its name to
`BENCHMARKS` below, nothing else.
"""

from __future__ import annotations

import argparse
import importlib

#: benchmark modules of `occult_hf.benchmarks`, in the order `occult bench --help` lists them
BENCHMARKS: tuple[str, ...] = ("experts", "ep", "model", "realsize", "exchange", "paper", "replicas")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="GPU benchmarks (expert kernels, ...) that print a table",
        description="Benchmarks measured on the GPU of this machine; each prints a table and writes it "
        "(markdown, JSON) with a PNG plot.",
    )
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        module = importlib.import_module(f"occult_hf.benchmarks.{name}")
        sub = benchmarks.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(sub)
        sub.set_defaults(func=_runner(module))


def _runner(module):
    def run(args: argparse.Namespace) -> int:
        return module.run(args)

    return run
