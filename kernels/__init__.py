"""Local expert computation: the layout, the PyTorch reference and the Triton kernels.

The Triton path (`occult_hf.kernels.triton_expert_mlp.expert_mlp_triton`) is imported from its module,
so that importing this package never needs triton.

Installed as `occult_hf.kernels`: setup.cfg's `package_dir` maps this top-level `kernels/` folder
into the package, so code in `src/occult_hf` imports it as `occult_hf.kernels`, never by a
relative path (tests/test_structure.py checks).
"""

from .expert_mlp_reference import expert_mlp_grouped_mm, expert_mlp_reference
from .layout import ExpertSegments

__all__ = ["ExpertSegments", "expert_mlp_grouped_mm", "expert_mlp_reference"]
