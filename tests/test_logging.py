"""occult_hf's loggers follow transformers' verbosity (TRANSFORMERS_VERBOSITY, set_verbosity_*),
print through transformers' handler, and OCCULT_VERBOSITY / occult_hf.utils.logging.set_verbosity
override the level for occult_hf alone (issue 13: "logging goes through transformers.utils.logging")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from occult_hf.utils import logging as logging_utils
from occult_logs import RecordList


@pytest.fixture
def collected():
    """A handler on transformers' library root logger; restores the verbosities afterwards."""
    handler = RecordList()
    before = hf_logging.get_verbosity()
    hf_logging.add_handler(handler)
    try:
        yield handler
    finally:
        hf_logging.remove_handler(handler)
        hf_logging.set_verbosity(before)
        logging_utils.set_verbosity(None)


def test_occult_loggers_follow_transformers_set_verbosity(collected):
    log = logging_utils.get_logger("occult_hf.hf.apply")
    assert log is logging.getLogger("occult_hf.hf.apply")  # the module loggers themselves
    hf_logging.set_verbosity_warning()
    log.info("hidden at warning")
    log.warning("shown at warning")
    hf_logging.set_verbosity_info()  # a later change is followed: no re-configuration needed
    log.info("shown at info")
    assert [r.getMessage() for r in collected.records] == ["shown at warning", "shown at info"]
    assert logging_utils.get_verbosity() == logging.INFO
    hf_logging.set_verbosity_error()
    log.warning("hidden at error")
    assert len(collected.records) == 2


def test_occult_verbosity_overrides_for_occult_only(collected):
    hf_logging.set_verbosity_error()
    logging_utils.set_verbosity("debug")
    logging_utils.get_logger("occult_hf.x").debug("occult debug")
    hf_logging.get_logger("transformers.modeling_utils").warning("transformers warning stays hidden")
    assert [r.getMessage() for r in collected.records] == ["occult debug"]
    logging_utils.set_verbosity(None)  # back to following transformers (error)
    logging_utils.get_logger("occult_hf.x").warning("hidden again")
    assert len(collected.records) == 1
    with pytest.raises(ValueError, match="not a verbosity"):
        logging_utils.set_verbosity("loud")
    with pytest.raises(ValueError, match="must be 'occult_hf'"):
        logging_utils.get_logger("mypackage")


def test_occult_verbosity_environment_variable(monkeypatch, collected):
    root = logging.getLogger("occult_hf")
    monkeypatch.setenv("OCCULT_VERBOSITY", "error")
    root.parent = logging.root  # detached: the next get_logger attaches it again and reads the variable
    hf_logging.set_verbosity_info()
    logging_utils.get_logger("occult_hf.x").warning("hidden: OCCULT_VERBOSITY=error wins")
    assert collected.records == [] and logging_utils.get_verbosity() == logging.ERROR
    monkeypatch.setenv("OCCULT_VERBOSITY", "chatty")
    root.parent = logging.root
    with pytest.raises(ValueError, match="OCCULT_VERBOSITY='chatty' is not a verbosity"):
        logging_utils.get_logger("occult_hf.x")
    monkeypatch.delenv("OCCULT_VERBOSITY")
    logging_utils.get_logger()  # attached again, following transformers


def test_transformers_verbosity_variable_in_a_fresh_process():
    """TRANSFORMERS_VERBOSITY alone governs occult_hf's loggers (the module is loaded without the
    package, so that the process imports only transformers' logging)."""
    path = Path(logging_utils.__file__)
    code = (f"import importlib.util, logging; spec = importlib.util.spec_from_file_location('occult_logging', {str(path)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(logging.getLevelName(m.get_logger('occult_hf.hf.apply').getEffectiveLevel()))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OCCULT_VERBOSITY"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TRANSFORMERS_VERBOSITY": "info"},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "INFO"
