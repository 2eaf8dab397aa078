"""Local expert computation: the layout, the PyTorch reference and the Triton kernels.

The Triton path (`occult_hf.kernels.triton_expert_mlp.expert_mlp_triton`) is imported from its module,
so that importing this package never needs triton.
"""

from .expert_mlp_reference import expert_mlp_grouped_mm, expert_mlp_reference
from .layout import ExpertSegments

__all__ = ["ExpertSegments", "expert_mlp_grouped_mm", "expert_mlp_reference"]
