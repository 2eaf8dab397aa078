"""Local expert computation: the layout, the PyTorch reference and the Triton kernels.

The Triton paths (`occult_hf.kernels.triton_expert_mlp.expert_mlp_triton`, and
`occult_hf.kernels.grouped_mm_fused.expert_mlp_grouped_mm_fused`: PyTorch's grouped GEMMs with Triton kernels
around them) are imported from their modules, so that importing this package never needs triton.

Every kernel is also a custom operator (namespace `occult`, what `torch.compile` traces: docs/kernels.md), defined in
the module of the function it serves: the layout's, the reference's, the row sum's and the replica rule's on import of
occult_hf, the Triton backends' when their modules are first imported (on first use).

Installed as `occult_hf.kernels`: setup.cfg's `package_dir` maps this top-level `kernels/` folder
into the package, so code in `src/occult_hf` imports it as `occult_hf.kernels`, never by a
relative path (tests/test_structure.py checks).
"""

from .expert_mlp_reference import expert_mlp_grouped_mm, expert_mlp_reference
from .layout import ExpertSegments

__all__ = ["ExpertSegments", "expert_mlp_grouped_mm", "expert_mlp_reference"]
