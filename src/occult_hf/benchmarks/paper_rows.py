"""The rows of `occult bench paper`: what each experiment runs (a stable key and its setup in words) and the record
one row leaves (`PaperRow`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from occult_hf.benchmarks.megablocks import MLP_IMPL

EXPERIMENTS = ("prefill", "finetune")


@dataclass
class PaperRow:
    experiment: str
    model: str
    key: str  # stable row id, e.g. "occult_nd1"
    setup: str  # what ran, in words
    routing: str
    tokens: int = 0  # group tokens per timed call (forward, or optimizer step)
    ms: float = float("nan")  # median ms per call, slowest rank
    tokens_per_s: float = float("nan")
    peak_gib: list = field(default_factory=list)  # per GPU, rank order ([] on CPU)
    ct: float | None = None  # mean devices per token (occult rows)
    max_rel_err: float | None = None  # last-position logits against the stock model on the same batch
    loss: float | None = None  # first step's loss, mean over ranks (fine-tuning)
    paper: str = "-"
    reason: str = ""  # why the row did not run ("" when it ran)

    @property
    def ran(self) -> bool:
        return not self.reason


#: the MegaBlocks rows (benchmarks/megablocks.py): its dMoE with the model's router and weights
MEGABLOCKS_SETUP = (
    f"MegaBlocks dMoE, dropless, mlp_impl={MLP_IMPL!r}, the model's router; per-expert rows, contiguous experts"
    " (DDP for the replicated parameters in fine-tuning)"
)
PREFILL_ROWS = (
    ("stock_1gpu", "stock transformers, one GPU (each GPU its own replica, no communication)"),
    ("device_map_auto", 'stock transformers, from_pretrained(device_map="auto") over {D} GPUs, one process'),
    ("hf_ep_all_to_all", "transformers EP, ep_implementation='all_to_all' (ep_size=fsdp_size={D}, each rank its batch)"),
    ("hf_ep_all_reduce", "transformers EP, ep_implementation='all_reduce' (tp_size=ep_size={D}, one shared batch)"),
    ("hf_ep_occult", "transformers EP, ep_implementation='occult' (occult_hf's; contiguous)"),
    ("occult_per_expert", "occult_hf EP, per-expert rows, contiguous (Tutel/Megatron-style baseline)"),
    ("occult_contiguous", "occult_hf EP, one row per device (dedup), contiguous placement"),
    ("occult_placed", "occult_hf EP, dedup, {method} placement"),
    ("occult_nd2", "occult_hf EP, dedup, {method} placement, pruned to N_d=2 (router)"),
    ("occult_nd1", "occult_hf EP, dedup, {method} placement, pruned to N_d=1 (router)"),
    ("megablocks", MEGABLOCKS_SETUP),
)
FINETUNE_ROWS = (
    ("occult_exact", "occult_hf EP, exact, {method} placement (DDP for replicated parameters)"),
    ("occult_pruned", "occult_hf EP, pruned to N_d=1 (router), {method} placement"),
    ("fsdp2", "FSDP2 (fully_shard per decoder layer + root)"),
    ("ddp", "DDP, a full replica per GPU"),
    ("megablocks", MEGABLOCKS_SETUP),
)
