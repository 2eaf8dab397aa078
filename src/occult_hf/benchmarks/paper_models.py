"""The three models of `occult bench paper`: their checkpoints' configurations, the tiny stand-ins, and the paper's
figures for their prefill rows.

Shape legend: E routed experts, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from occult_hf.benchmarks.model import MODEL_SHAPES

#: the machine of the paper's figures
PAPER_HARDWARE = "4x A6000 PCIe"


@dataclass(frozen=True)
class PaperModel:
    """One model of the paper: its transformers config class and the checkpoint's `config.json` values."""

    name: str
    config_class: str  # a transformers class name, or "deepseek" (occult_hf's native class)
    full: dict
    #: the paper's figure for a row key (prefill), on PAPER_HARDWARE
    paper_prefill: dict = field(default_factory=dict)

    def config(self, scale: str):
        """The transformers config at `scale` ("full": the checkpoint's; "tiny": same E, k and layer kinds)."""
        kwargs = dict(self.full)
        if scale == "tiny":
            kwargs.update({key: value for key, value in TINY.items() if key in kwargs})
        if self.config_class == "deepseek":
            from occult_hf.models.deepseek import DeepseekMoeConfig

            return DeepseekMoeConfig(**kwargs)
        import transformers

        return getattr(transformers, self.config_class)(**kwargs)


#: what `--scale tiny` overrides (E, k, the router rule and which layers are MoE stay the real ones)
TINY = dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=256,
            num_hidden_layers=2)  # fmt: skip

PAPER_MODELS = {
    "olmoe-1b-7b": PaperModel(
        "olmoe-1b-7b", "OlmoeConfig",
        dict(MODEL_SHAPES["olmoe-1b-7b"][1], num_hidden_layers=16, rms_norm_eps=1e-5, norm_topk_prob=False,
             tie_word_embeddings=False),
        {"occult_contiguous": "15.93 s (contiguous)", "occult_placed": "12.53 s (Occult placement)",
         "occult_nd2": "9.22 s (N_d=2 of 4 devices)", "occult_nd1": "5.82 s (N_d=1)",
         "occult_per_expert": "Occult 8.66x faster than Tutel", "megablocks": "Occult 1.70x faster than MegaBlocks"},
    ),
    "qwen1.5-moe-a2.7b": PaperModel(
        "qwen1.5-moe-a2.7b", "Qwen2MoeConfig",
        dict(MODEL_SHAPES["qwen1.5-moe-a2.7b"][1], num_hidden_layers=24, rms_norm_eps=1e-6, rope_theta=1e6,
             norm_topk_prob=False, tie_word_embeddings=False),
        {"occult_nd2": "Occult (N_d=2 of 4) 0.71x MegaBlocks", "megablocks": "Occult (N_d=2 of 4) 0.71x MegaBlocks"},
    ),
    "deepseek-moe-16b": PaperModel(
        "deepseek-moe-16b", "deepseek",
        dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
             num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, vocab_size=102400,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False,
             aux_loss_alpha=0.001, seq_aux=True, tie_word_embeddings=False),
        {"occult_nd2": "Occult (N_d=2 of 4) 0.66x MegaBlocks", "megablocks": "Occult (N_d=2 of 4) 0.66x MegaBlocks"},
    ),
}  # fmt: skip

#: `--dtype` -> the weights' dtype (None: bf16 on GPU, fp32 on CPU)
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: per-scale defaults of the sizes (`--prefill-tokens` ... left unset take these)
SCALE_DEFAULTS = {
    "full": dict(prefill_tokens=2**14, prefill_seq=4096, finetune_batch=8, finetune_seq=1024, iterations=3, steps=3),
    "tiny": dict(prefill_tokens=64, prefill_seq=32, finetune_batch=4, finetune_seq=16, iterations=1, steps=1),
}
