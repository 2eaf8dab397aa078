"""Expert placement: the `Placement` map and the planners that make one from a routing profile.

Planners are registered by name (`available_planners()`): `contiguous` (the framework default),
`occult` (the paper's Algorithm 1) and `refined` (exact CT under a load-balance limit; the default
of `plan_placement`), which can hold that limit on bootstrap resamples and on several profiles at
once and give hot experts replicas (`occult_hf.replicas.routing.resolve_homes` is the one routing rule for them);
`validation.cross_validate` estimates what a plan will do on tokens it has not seen.
"""

from .placement import PLACEMENT_FILENAME, Placement, check_devices_per_node
from .registry import (
    PlannerSpec,
    available_planners,
    balanced_capacities,
    get_planner,
    plan_profiles,
    pool_profiles,
    register_planner,
)

# planner modules register themselves on import
from . import contiguous, occult, refined  # noqa: E402,F401  (isort: skip)
from .refined import LayerPlan, RefinedOptions, refine_layer  # noqa: E402
from ..replicas.routing import resolve_homes  # noqa: E402
from .planning import plan_placement  # noqa: E402

__all__ = [
    "LayerPlan",
    "PLACEMENT_FILENAME",
    "Placement",
    "PlannerSpec",
    "RefinedOptions",
    "available_planners",
    "check_devices_per_node",
    "balanced_capacities",
    "get_planner",
    "plan_placement",
    "plan_profiles",
    "refine_layer",
    "register_planner",
]
