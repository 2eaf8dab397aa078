"""`contiguous` placement: expert e on device `e * D // E`, what every EP framework does (the baseline)."""

from __future__ import annotations

import numpy as np

from .placement import contiguous_devices
from .registry import NoOptions, check_layer_inputs, register_planner


@register_planner("contiguous", NoOptions, "expert e on device e*D//E (the framework default; ignores routing)")
def plan_contiguous_layer(
    coactivation_EE: np.ndarray,
    expert_counts_E: np.ndarray,
    topk_sample_Nk: np.ndarray | None,
    num_devices: int,
    options: NoOptions,
) -> np.ndarray:
    """`[E]` int64 device map `e * D // E` (capacities differ by at most one); the routing is only validated."""
    check_layer_inputs(coactivation_EE, expert_counts_E, topk_sample_Nk, num_devices)
    return contiguous_devices(len(expert_counts_E), num_devices)
