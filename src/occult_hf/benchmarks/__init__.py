"""Benchmarks behind `occult bench <name>` (one module per benchmark; see `occult_hf.cli.bench`)."""

#: the real Qwen1.5-MoE-A2.7B GSM8K trace (MoE layer 0) of the project's development routing data, relative to the
#: repository root: third-party data beside the repository, not in it; a benchmark replays it when present
QWEN15_TRACE = "../shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


def failure_text(error: BaseException) -> str:
    """A failed run's reason on one line of a table or log: the error's type and its first 300 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def measures_a_gpu(args) -> bool:
    """`needs_cuda` of a benchmark whose every run measures a GPU (all but `exchange --model`)."""
    return True
