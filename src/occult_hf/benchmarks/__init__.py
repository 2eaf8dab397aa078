"""Benchmarks behind `occult bench <name>` (one module per benchmark; see `occult_hf.cli.bench`)."""


def measures_a_gpu(args) -> bool:
    """`needs_cuda` of a benchmark whose every run measures a GPU (all but `exchange --model`)."""
    return True
