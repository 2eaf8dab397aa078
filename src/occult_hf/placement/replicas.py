"""Kept for the old import path: the replica routing rule lives in `occult_hf.replica_routing`.

It moved below the placement package because the metrics and the dispatch plan use it too, and the
planners use the metrics (an import of `occult_hf.placement.replicas` runs `occult_hf.placement`
first, which imports the planners: a cycle).
"""

from ..replica_routing import home_table_from, resolve_homes, resolve_homes_np

__all__ = ["home_table_from", "resolve_homes", "resolve_homes_np"]
