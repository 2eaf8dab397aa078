"""Run a function once a module has been imported, without importing it: `when_imported(name, hook)`.

occult_hf wraps a few methods of transformers' `Trainer` and of peft's `PeftModel` (`hf.compat`,
`hf.peft_support`). Importing either costs seconds (peft alone about 3 s on 2 cores, the Trainer pulls
in `datasets`), which a user who loads a model for inference should not pay at `import occult_hf`. So
the wrappers go on when the module itself is imported, by whoever imports it: the hook runs at once
when the module is already there, else right after it has executed, before the import returns to the
importer. This is the post-import hook of the withdrawn PEP 369 (as `wrapt.register_post_import_hook`):
a finder first in `sys.meta_path` that, for a watched name only, asks the other finders for the spec
and lets the loader run the hooks after `exec_module`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

Hook = Callable[[ModuleType], None]


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module, the spec the other finders give, with its hooks attached."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Hook]] = {}
        self._searching = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks or getattr(self._searching, "name", None) == fullname:
            return None
        self._searching.name = fullname  # the other finders answer; this one stays out of its own search
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for hook in self.hooks.pop(fullname, []):
                hook(module)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


_FINDER = _AfterImportFinder()


def when_imported(name: str, hook: Hook) -> None:
    """Call `hook(module)` now if module `name` is imported, else once it has been (once per registration)."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _FINDER.hooks.setdefault(name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def cancel(name: str) -> None:
    """Forget every hook on module `name` that has not run yet (the module's wrappers are one owner's)."""
    _FINDER.hooks.pop(name, None)


__all__ = ["cancel", "when_imported"]
