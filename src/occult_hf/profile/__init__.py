"""Routing profiles: what a model's routers decide, counted per MoE layer (docs/design.md §2, §6).

Modules, in import order (each imports only the ones above it, so the package has no cycle):

* `stats`: `LayerRouting` (one layer's statistics) and `LayerAccumulator`, the one place where
  routing decisions become statistics;
* `collect`: `ProfileCollector` (forward hooks on a model's routers) and the driver over text;
* `trace`: reading recorded `.npz` routing traces;
* `routing_profile`: `RoutingProfile` (validation, queries, similarity, merge, safetensors file),
  whose `collect`, `from_collector` and `from_trace` constructors call the two makers above.
"""

from .collect import DEFAULT_SAMPLE_SIZE, ProfileCollector
from .routing_profile import PROFILE_FORMAT, PROFILE_METADATA_KEY, RoutingProfile
from .stats import LayerAccumulator, LayerRouting, ReservoirSample

__all__ = [
    "DEFAULT_SAMPLE_SIZE",
    "LayerAccumulator",
    "LayerRouting",
    "PROFILE_FORMAT",
    "PROFILE_METADATA_KEY",
    "ProfileCollector",
    "ReservoirSample",
    "RoutingProfile",
]
