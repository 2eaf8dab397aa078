"""occult_hf.patches: one adapter per supported model family, registered on import.

Installed as `occult_hf.patches` (setup.cfg `package_dir` maps this top-level `patches/` folder
into the package), so code inside `src/occult_hf` imports it as `occult_hf.patches`, never by a
relative path (tests/test_structure.py checks). Every module of this folder whose name does not start with `_` (and is not `base`)
is a family file and is imported here, which registers its adapter: adding a family is adding
`patches/<family>.py` and nothing else (docs/models.md). `adapter_for(model_or_config)` finds the
adapter by `config.model_type`.
"""

import importlib
import pkgutil

from .base import MoEAdapter, RouterOutput, adapter_for, register_adapter, registered_adapters

for _family in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_") and m.name != "base"):
    importlib.import_module(f"{__name__}.{_family}")

__all__ = ["MoEAdapter", "RouterOutput", "adapter_for", "register_adapter", "registered_adapters"]
