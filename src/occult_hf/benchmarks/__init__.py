"""Benchmarks behind `occult bench <name>` (one module per benchmark; see `occult_hf.cli.bench`)."""


def failure_text(error: BaseException) -> str:
    """A failed run's reason on one line of a table or log: the error's type and its first 300 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def measures_a_gpu(args) -> bool:
    """`needs_cuda` of a benchmark whose every run measures a GPU (all but `exchange --model`)."""
    return True
