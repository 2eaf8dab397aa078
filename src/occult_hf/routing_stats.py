"""Moved to `occult_hf.profile.stats`; this module keeps the old import path working."""

from .profile.stats import LayerAccumulator, LayerRouting, ReservoirSample

__all__ = ["LayerAccumulator", "LayerRouting", "ReservoirSample"]
