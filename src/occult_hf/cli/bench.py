"""`occult bench <benchmark>`: GPU benchmarks that print a table (and write it, with a plot).

Each benchmark is a module `occult_hf.benchmarks.<name>` with `HELP` (one line), `DESCRIPTION`,
`add_arguments(parser)`, `needs_cuda(args) -> bool` (whether this run measures a GPU) and
`run(args) -> int`, and `CPU_CHECK = False` where it cannot run on the CPU at all (then it has no `--cpu`);
adding one means adding that module and its name to `BENCHMARKS` below, nothing else.

A run that measures a GPU fails at once on a machine without CUDA, on every rank under torchrun (at
the real shapes a CPU run takes minutes and its timings mean nothing); `--cpu` runs it on the CPU
anyway, as a check of the script at small sizes (what the tests do), in every benchmark but `experts`.
"""

from __future__ import annotations

import argparse
import functools
import importlib


#: benchmark modules of `occult_hf.benchmarks`, in the order `occult bench --help` lists them
BENCHMARKS: tuple[str, ...] = ("experts", "ep", "model", "decode", "realsize", "exchange", "paper", "replicas")


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
        if _has_cpu_check(module):
            sub.add_argument(
                "--cpu", action="store_true",
                help="run on the CPU although no CUDA device is there: a check of the script at small sizes, not a measurement",
            )  # fmt: skip
        sub.set_defaults(cpu=False, func=functools.partial(_run, name, module))


def _has_cpu_check(module) -> bool:
    """Whether benchmark `module` offers `--cpu`: all but those whose kernels need CUDA (`CPU_CHECK = False`), so that
    the help does not offer a flag the run refuses."""
    return getattr(module, "CPU_CHECK", True)


def _run(name: str, module, args: argparse.Namespace) -> int:
    """Run benchmark `name`; fail at once when a run that measures a GPU starts on a machine without CUDA (unless `--cpu`).
    On the CPU the run may use what the machine has free and no more: one that needs more ends in an error naming the
    benchmark and its size flags, where the kernel would kill it with no message (`utils.host_memory`)."""
    import torch

    from ..utils.host_memory import capped_at_free_memory, is_out_of_memory

    if not args.cpu and torch.cuda.is_available():
        return module.run(args)
    if module.needs_cuda(args) and not args.cpu:
        hint = ("--cpu runs it on the CPU anyway, as a check of the script at small sizes (its timings mean nothing)"
                if _has_cpu_check(module) else "it has no --cpu check: its kernels need CUDA")  # fmt: skip
        raise SystemExit(
            f"occult bench {name}: this run measures a GPU and this machine has no CUDA device "
            f"(torch.cuda.is_available() is False); {hint}"
        )
    with capped_at_free_memory() as growth:
        try:
            return module.run(args)
        except (RuntimeError, MemoryError) as error:
            if growth is None or not is_out_of_memory(error):
                raise
            raise SystemExit(
                f"occult bench {name}: ran out of memory: the {growth / 2**30:.1f} GiB this machine had free at the start "
                f"were not enough ({(str(error).strip() or type(error).__name__).splitlines()[-1]}); pass smaller sizes (`occult bench {name} --help` "
                f"lists them)"
            ) from error
