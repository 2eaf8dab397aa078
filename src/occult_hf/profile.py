"""Routing profiles: per-layer co-activation statistics of a real router (DESIGN.md §2, §6).

Shape legend: E routed experts, k experts per token, N sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class LayerRouting:
    """Routing statistics of one MoE layer.

    Attributes:
        coactivation: `[E, E]` int64, tokens whose top-k holds both i and j; symmetric, zero diagonal.
        expert_counts: `[E]` int64, tokens routed to each expert.
        token_count: tokens observed.
        logit_gram: `[E, E]` float64 Gram matrix of the router logits (sum over tokens of l l^T), or None.
        topk_sample: `[N, k]` int64 uniform sample of real per-token expert sets, or None (pair counts only).
    """

    coactivation: np.ndarray
    expert_counts: np.ndarray
    token_count: int
    logit_gram: np.ndarray | None = None
    topk_sample: np.ndarray | None = None


@dataclass
class RoutingProfile:
    """Per-layer `LayerRouting` for one model, keyed by decoder-layer index."""

    num_experts: int
    top_k: int
    layers: dict[int, LayerRouting]
    model_type: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
