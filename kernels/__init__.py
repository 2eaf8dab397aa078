"""Local expert computation: the layout, the PyTorch reference and the Triton kernels."""

from .expert_mlp_reference import expert_mlp_reference
from .layout import ExpertSegments

__all__ = ["ExpertSegments", "expert_mlp_reference"]
