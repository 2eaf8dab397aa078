"""Moved to `occult_hf.profile.collect`; this module keeps the old import path working."""

from .profile.collect import DEFAULT_SAMPLE_SIZE, ProfileCollector

__all__ = ["DEFAULT_SAMPLE_SIZE", "ProfileCollector"]
