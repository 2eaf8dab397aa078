"""Issue 33's hostile probe as a rerunnable count: every case is a test of the files below (one test, or one
parametrized case, per thing a hostile user or a faulty peer does), and the probe reports per case whether
occult_hf answered as promised (the test passes) or not.

    python tests/hostile_probe.py                      # this tree
    python tests/hostile_probe.py --python OLD/.venv/bin/python --tests-from .    # another install, these tests

With `--python`, that interpreter's occult_hf is probed with this tree's tests: a case that fails there
and passes here is one this change fixed. Prints one line per case, then "tried N, fine F, bad B" and
the bad ones by name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: the test files that hold the probe's cases
CASE_FILES = (
    "test_strict_inputs.py",      # parsers, paths, placements, profiles, timeouts, a full disk
    "test_bad_inputs.py",         # the command line and every input file, one case per bad input
    "test_save_publish.py",       # a crash between the publish steps of a save
    "test_minor_cases.py",        # messages and defaults
    "test_pruned_checkpoints.py",  # a pruned checkpoint says what it is (issue 32 item 2)
    "test_faults.py",             # disagreeing, stalled and dead peers (2 gloo ranks)
    "test_peer_waits.py",         # ranks that never arrive, a rank-0-only save, a launcher
    "test_weight_agreement.py",   # ranks that loaded different weights
    "test_trainer_checkpoints.py",  # a rank that stalls, dies or raises while a Trainer checkpoint is written
)  # fmt: skip


def run(python: str, tests: Path) -> list[tuple[str, bool, str]]:
    """`(case, fine, first line of the failure)` for every case, run with `python`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        files = [str(tests / name) for name in CASE_FILES]
        env = {**os.environ, "PYTHONPATH": str(tests)}
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files],
                       cwd=tests.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        cases = []
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if case.find("skipped") is not None:
                continue
            message = "" if problem is None else (problem.get("message") or "")
            detail = message.splitlines()[0][:160] if message else ""
            cases.append((f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}", problem is None, detail))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose occult_hf is probed")
    parser.add_argument("--tests-from", default=str(Path(__file__).resolve().parents[1]), help="the tree whose tests/ run")
    args = parser.parse_args(argv)
    cases = run(args.python, Path(args.tests_from).resolve() / "tests")
    for name, fine, detail in cases:
        print(f"{'fine' if fine else 'BAD '}  {name}" + (f"  -- {detail}" if detail else ""))
    bad = [name for name, fine, _ in cases if not fine]
    print(f"tried {len(cases)}, fine {len(cases) - len(bad)}, bad {len(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
