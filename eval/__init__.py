"""occult_hf.eval: the lm-evaluation-harness hook (needs the `eval` extra: `pip install occult_hf[eval]`).

Installed as `occult_hf.eval`: setup.cfg's `package_dir` maps this top-level `eval/` folder into the
package; it imports the core as `occult_hf.*` and nothing in `src/occult_hf` imports it relatively
(tests/test_structure.py checks).

Importing this package has two documented effects, both needed for lm-eval to run Occult models:
- it registers the `occult-hf` model type in lm-eval's model registry (lm-eval 0.4.13 discovers
  plugin models by import only; it reads no entry points), so that
  `lm_eval.simple_evaluate(model="occult-hf", ...)` finds it;
- it makes `transformers.data.metrics.squad_metrics` importable again on transformers 5 (see
  `squad_metrics_shim`), which lm-eval's CoQA task imports.

The `occult23` suite is an lm-eval group in `TASKS_DIR`; `make_task_manager()` returns a
`TaskManager` that knows it. From the shell, `python -m occult_hf.eval ...` is lm-eval's own CLI with
both in place, and `occult eval` runs the suite and writes a results table.
"""

from __future__ import annotations

import importlib.util

_MISSING = [name for name in ("lm_eval", "datasets") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(
        f"occult_hf.eval needs {', '.join(_MISSING)}: install the eval extra with `pip install 'occult_hf[eval]'` "
        f"(lm-eval==0.4.13, datasets)"
    )

from .squad_metrics_shim import install_squad_metrics_shim  # noqa: E402

install_squad_metrics_shim()

from .model import OccultHFLM  # noqa: E402  (registers "occult-hf")
from .report import compare_table, headline_scores, load_results, markdown_table  # noqa: E402
from .suite import SUITE_NAME, TASKS_DIR, make_task_manager, parse_task_list, suite_tasks  # noqa: E402

__all__ = [
    "OccultHFLM",
    "SUITE_NAME",
    "TASKS_DIR",
    "make_task_manager",
    "parse_task_list",
    "suite_tasks",
    "headline_scores",
    "markdown_table",
    "compare_table",
    "load_results",
    "install_squad_metrics_shim",
]
