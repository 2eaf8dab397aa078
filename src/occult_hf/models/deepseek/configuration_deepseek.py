"""Configuration of DeepSeek-MoE (deepseek-ai/deepseek-moe-16b-base, -chat), `model_type "deepseek"`.

The published checkpoints' `config.json` is read as is: the field names and defaults are those of
the published `configuration_deepseek.py`. Everything that is not MoE is a Llama config (the
published attention, norms and rotary embedding are Llama's), so this class extends `LlamaConfig`;
the published `rope_theta` / `rope_scaling` become transformers 5's `rope_parameters` on load, and
`to_dict` writes them back beside it so that a saved `config.json` also configures the published
remote code correctly.

No `from __future__ import annotations` here: `@strict` checks each field against its annotation only when the
annotation is a type, not a string, and without the checks `norm_topk_prob="false"` would be true.
"""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


#: this package's DeepSeek-MoE classes -> the published `modeling_deepseek.py`'s
PUBLISHED_CLASS_NAMES = {"DeepseekMoeForCausalLM": "DeepseekForCausalLM", "DeepseekMoeModel": "DeepseekModel"}


@strict
class DeepseekMoeConfig(LlamaConfig):
    r"""DeepSeek-MoE: a Llama decoder whose MLPs are, from layer `first_k_dense_replace` on and then
    every `moe_layer_freq`-th layer, fine-grained MoE blocks with always-on shared experts.

    MoE fields (the published names):
        moe_intermediate_size: width of one routed expert (and of one shared expert).
        n_routed_experts: routed experts per MoE layer (E); None makes every layer dense.
        num_experts_per_tok: experts per token (k); required when `n_routed_experts` is set.
        n_shared_experts: shared experts, fused into one MLP of width
            `n_shared_experts * moe_intermediate_size`; None or 0 for none (the published code builds a zero-width
            MLP for 0, which adds nothing).
        first_k_dense_replace: the first layers that stay dense.
        moe_layer_freq: layer i >= first_k_dense_replace is MoE iff i % moe_layer_freq == 0.
        norm_topk_prob: divide the k softmax probabilities by their sum (only when k > 1).
        scoring_func: router scoring; the published code supports only "softmax".
        aux_loss_alpha: weight of the expert-balance loss added to the gradients in training (0: off).
        seq_aux: balance loss per sequence (averaged over the batch) instead of over the whole batch.
    """

    model_type = "deepseek"
    attribute_map = {"num_experts": "n_routed_experts"}
    # transformers' expert parallelism (`DistributedConfig(ep_size=...)`, transformers >= 5.23): the routed
    # experts are transformers' fused experts class (`DeepseekMoeExperts` is DeepseekV2's) at the same
    # module paths as DeepseekV2's, so its plan applies as is; dense layers and shared experts have no
    # `experts` and stay replicated
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 100000
    eos_token_id: int | list[int] | None = 100001
    moe_intermediate_size: int = 1407
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True

    def validate_architecture(self):
        """Part of `@strict` validation: the MoE fields must describe a model the published code builds."""
        super().validate_architecture()
        if self.scoring_func != "softmax":
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported: DeepSeek-MoE scores with 'softmax'")
        if (self.n_routed_experts is None) != (self.num_experts_per_tok is None):
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} and num_experts_per_tok={self.num_experts_per_tok}: "
                "set both (a MoE model) or neither (a dense model)"
            )
        if self.n_routed_experts is not None and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        if self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be >= 0")
        if self.n_shared_experts is not None and self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} must be >= 0 or None (0, None: no shared experts)")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` holds a MoE block (the published rule)."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    def to_dict(self) -> dict:
        """transformers' dict plus the published `rope_theta` / `rope_scaling`, which the published
        `configuration_deepseek.py` reads (it knows no `rope_parameters`), and the published class names in
        `architectures` (`save_pretrained` writes this class's; servers such as vLLM choose their model by it)."""
        output = super().to_dict()
        if output.get("architectures"):
            output["architectures"] = [PUBLISHED_CLASS_NAMES.get(name, name) for name in output["architectures"]]
        rope = dict(output.get("rope_parameters") or {})
        if "rope_theta" in rope:
            output["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            output["rope_scaling"] = {"type": rope_type, **{k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type")}}
        return output


__all__ = ["DeepseekMoeConfig"]
