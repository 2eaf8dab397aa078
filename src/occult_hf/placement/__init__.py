"""Expert placement: the `Placement` map and the planners that make one from a routing profile."""

from .placement import PLACEMENT_FILENAME, Placement

__all__ = ["Placement", "PLACEMENT_FILENAME"]
