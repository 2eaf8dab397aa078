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

Imported as a top-level `kernels`, this folder is only there by accident: the repository root is on `sys.path`
(`python -m ...` or `python -m pytest` run in the clone) ahead of site-packages, where it would hide Hugging Face's
`kernels` distribution, which transformers (5.25 on) imports with every model. That import gets the installed
distribution instead (`_installed_hub_kernels`); where none is installed it gets an empty module (transformers before
5.25 probes for `kernels` by importing whatever `sys.path` finds, and reads a module without a version as "not
installed"). Either way this folder's code runs only as `occult_hf.kernels`.
"""

import sys


def _installed_hub_kernels() -> None:
    """Execute the `kernels` that `sys.path` holds outside this repository, if any, into `sys.modules["kernels"]` (the
    import system returns what that entry holds once this module's code has run)."""
    import importlib.machinery
    import importlib.util
    import os

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != repo_root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _installed_hub_kernels()
else:
    from .expert_mlp_reference import expert_mlp_grouped_mm, expert_mlp_reference
    from .layout import ExpertSegments

    __all__ = ["ExpertSegments", "expert_mlp_grouped_mm", "expert_mlp_reference"]
