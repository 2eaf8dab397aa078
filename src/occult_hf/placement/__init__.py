"""Expert placement: the `Placement` map and the planners that make one from a routing profile.

Planners are registered by name (`available_planners()`): `contiguous` (the framework default),
`occult` (the paper's Algorithm 1) and `refined` (exact CT under a load-balance limit; the default
of `plan_placement`).
"""

from .placement import PLACEMENT_FILENAME, Placement
from .registry import (
    PlannerSpec,
    available_planners,
    balanced_capacities,
    get_planner,
    plan_placement,
    register_planner,
)

# planner modules register themselves on import
from . import contiguous, occult, refined  # noqa: E402,F401  (isort: skip)
from .refined import LayerPlan, RefinedOptions, refine_layer  # noqa: E402

__all__ = [
    "LayerPlan",
    "PLACEMENT_FILENAME",
    "Placement",
    "PlannerSpec",
    "RefinedOptions",
    "available_planners",
    "balanced_capacities",
    "get_planner",
    "plan_placement",
    "refine_layer",
    "register_planner",
]
