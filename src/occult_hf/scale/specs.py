"""The models the cost model predicts: the dimensions that set their FLOPs, bytes and parameter counts.

The three measured models are the configurations `occult bench paper` builds (`benchmarks.paper_models.PAPER_MODELS`,
checked equal in tests/test_scale.py); DeepSeek-V3 is the checkpoint's `config.json` (61 layers, the first 3
dense, 256 routed experts of width 2048, top-8, one shared expert, MLA attention), the shape the issue asks to
project past one node. Parameter counts are computed from the dimensions (OLMoE-1B-7B 6.92B, Qwen1.5-MoE-A2.7B
14.32B, DeepSeek-MoE-16B 16.38B, as the bench's rows print; DeepSeek-V3 671B without its MTP module).

Shape legend (docs/conventions.md): H hidden, I expert width, E routed experts, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..utils.checks import did_you_mean


@dataclass(frozen=True)
class ModelSpec:
    """One MoE model's dimensions.

    Attributes:
        name: the shape's name (`expert_shapes.SHAPES` for the measured three).
        hidden, expert_width, num_experts, top_k: H, I, E, k of the routed experts.
        shared_width: summed width of the shared experts (0: none), one dense MLP beside the routed ones.
        moe_layers, dense_layers: decoder layers with an MoE block / with a dense MLP of `dense_width`.
        dense_width: the dense layers' MLP width.
        vocab: vocabulary (untied input and output embeddings).
        attention_params: parameters of one layer's attention (projections, biases, norms).
        rest_like: the measured model whose rest-of-layer time per token this model takes
            (`parameters.Calibration.rest_ms_per_ktoken`), or None where none is comparable.
    """

    name: str
    hidden: int
    expert_width: int
    num_experts: int
    top_k: int
    shared_width: int
    moe_layers: int
    dense_layers: int
    dense_width: int
    vocab: int
    attention_params: int
    rest_like: str | None

    @property
    def layers(self) -> int:
        return self.moe_layers + self.dense_layers

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_width

    @property
    def routed_params(self) -> int:
        """Every routed expert of every MoE layer."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def other_params(self) -> int:
        """Everything but the routed experts: embeddings, attention, routers, shared experts, dense MLPs."""
        per_moe_layer = self.attention_params + self.hidden * self.num_experts + 3 * self.hidden * self.shared_width
        per_dense_layer = self.attention_params + 3 * self.hidden * self.dense_width
        return 2 * self.vocab * self.hidden + self.moe_layers * per_moe_layer + self.dense_layers * per_dense_layer

    @property
    def params(self) -> int:
        return self.routed_params + self.other_params


def _mha(hidden: int, bias: bool = False, qk_norm: bool = False) -> int:
    """Multi-head attention with H-wide q, k, v, o projections and two RMSNorms (plus q/k norms)."""
    return 4 * hidden * hidden + (3 * hidden if bias else 0) + 2 * hidden + (2 * hidden if qk_norm else 0)


def _mla(hidden: int, q_rank: int, kv_rank: int, heads: int, nope: int, rope: int, value: int) -> int:
    """DeepSeek-V3's multi-head latent attention: low-rank q and kv projections, the output projection, norms."""
    return (hidden * q_rank + q_rank * heads * (nope + rope) + hidden * (kv_rank + rope) + kv_rank * heads * (nope + value)
            + heads * value * hidden + q_rank + kv_rank + 2 * hidden)  # fmt: skip


MODEL_SPECS: dict[str, ModelSpec] = {
    "olmoe-1b-7b": ModelSpec("olmoe-1b-7b", 2048, 1024, 64, 8, 0, 16, 0, 0, 50304, _mha(2048, qk_norm=True), "olmoe-1b-7b"),
    "qwen1.5-moe-a2.7b": ModelSpec(
        "qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, 5632, 24, 0, 0, 151936, _mha(2048, bias=True) + 2048, "qwen1.5-moe-a2.7b"
    ),
    # DeepSeek-MoE-16B: Llama attention as Qwen1.5's (no bias): Qwen1.5's rest-of-layer time stands in
    "deepseek-moe-16b": ModelSpec("deepseek-moe-16b", 2048, 1408, 64, 6, 2 * 1408, 27, 1, 10944, 102400, _mha(2048), "qwen1.5-moe-a2.7b"),
    # DeepSeek-V3: MLA attention was never measured here: its rest of the layer is not modelled
    "deepseek-v3": ModelSpec("deepseek-v3", 7168, 2048, 256, 8, 2048, 58, 3, 18432, 129280, _mla(7168, 1536, 512, 128, 128, 64, 128), None),
}  # fmt: skip


def model_spec(name: str) -> ModelSpec:
    """The spec of `name`; an unknown name is an error that lists the known ones."""
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model {name!r}{did_you_mean([name], MODEL_SPECS)}; known: {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[name]


__all__ = ["MODEL_SPECS", "ModelSpec", "model_spec"]
