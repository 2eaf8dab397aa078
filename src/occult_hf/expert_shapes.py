"""The expert layers of the real models that occult_hf measures and models: hidden size, expert width,
routed experts and top-k of each, by name.

One table, read by the benchmarks (`occult bench experts`, `ep`, `hf.native_ep`, `exchange`: the shapes they
time) and by the placement's slowest-device cost model (`placement.slowest.costs_from_bench` reads a
benchmark's row by its shape name and needs that shape's k and H). It lives here, below both, so the
planners do not import a benchmark.

Shape legend (docs/conventions.md): H hidden, I expert width, E routed experts, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertShape:
    """One model's expert layer; `family` picks transformers' experts module (`benchmarks.experts.HF_EXPERTS`)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    family: str

    def label(self) -> str:
        return f"{self.hidden}/{self.intermediate}/{self.num_experts}/{self.top_k}"


SHAPES: dict[str, ExpertShape] = {
    "olmoe-1b-7b": ExpertShape(2048, 1024, 64, 8, "olmoe"),
    "qwen1.5-moe-a2.7b": ExpertShape(2048, 1408, 60, 4, "qwen2_moe"),
    # DeepSeek-MoE-16B's native class (occult_hf.models.deepseek) reuses DeepseekV2Experts: the same
    # layout and math (SiLU experts, [E, 2I, H] / [E, H, I] weights).
    "deepseek-moe-16b": ExpertShape(2048, 1408, 64, 6, "deepseek_v2"),
}

__all__ = ["SHAPES", "ExpertShape"]
