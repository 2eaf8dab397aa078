"""`import occult_hf` imports neither peft nor transformers' Trainer (issue 32: 8.0-8.3 s against
transformers' 6.6 s, because both were imported eagerly); the wrappers occult_hf puts on the Trainer
go on when the Trainer is imported, and `uninstall()` cancels them (`utils.after_import`). The import
check runs in a fresh interpreter: the test process has imported everything already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from occult_hf.utils.after_import import cancel, when_imported

HEAVY = ("peft", "transformers.trainer", "transformers.trainer_utils", "datasets", "lm_eval")


def test_import_occult_hf_leaves_peft_and_the_trainer_unimported():
    code = f"""
        import sys
        import occult_hf
        heavy = [name for name in {HEAVY!r} if name in sys.modules]
        assert not heavy, heavy
        assert occult_hf.OccultCallback.__name__ == "OccultCallback"  # on first use
        occult_hf.uninstall()  # before the Trainer is imported: nothing is wrapped when it is
        from transformers import Trainer
        assert getattr(Trainer.save_model, "__occult_original__", None) is None
        occult_hf.install()  # the Trainer is there now: wrapped at once
        assert getattr(Trainer.save_model, "__occult_original__", None) is not None
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_hook_runs_once_after_the_import_or_at_once(tmp_path, monkeypatch):
    (tmp_path / "occult_probe_module.py").write_text("VALUE = 41\n")
    (tmp_path / "occult_probe_cancelled.py").write_text("VALUE = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("occult_probe_module", lambda module: seen.append(module.VALUE + 1))
    when_imported("occult_probe_cancelled", lambda module: seen.append("cancelled hook ran"))
    cancel("occult_probe_cancelled")
    assert seen == []
    import occult_probe_cancelled  # noqa: F401
    import occult_probe_module  # noqa: F401

    assert seen == [42]  # after the module's code ran, before the import returned
    import occult_probe_module  # noqa: F401, F811  (already imported: the hook does not run again)

    when_imported("occult_probe_module", lambda module: seen.append("at once"))
    assert seen == [42, "at once"]
    for name in ("occult_probe_module", "occult_probe_cancelled"):
        sys.modules.pop(name)
