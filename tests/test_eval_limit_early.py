"""`occult eval --limit <fraction>` under expert parallelism. lm-eval scores the first ceil(documents x fraction) of
each task and gives rank r of W the documents r, r + W, ... of them, so a fraction that scores fewer than W
documents of a task leaves the last ranks without one; lm-eval found that only after the model loaded, on those
ranks alone. It must be refused before the load, on every rank, naming `--limit`, the value, the task and the fix.

The runs use `occult_offline` (occult_offline_ppl: 8 documents, occult_offline_nextline: 40; no download) and the
shipped tiny OLMoE, with lm-eval's `simple_evaluate` (where lm-eval loads the model) replaced by an error.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval", reason="occult eval needs the eval extra: pip install 'occult_hf[eval]'")

from distributed import run_world  # noqa: E402

WORLD_SIZE = 2
EVAL_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: what the replaced `simple_evaluate` raises: the model would load from here on
LOADED = "AssertionError: the evaluation started (lm-eval loads the model there)"


def limit_runs(rank: int, world_size: int, output_root: str) -> dict[str, tuple]:
    """`occult eval --tasks occult_offline --limit L` on this rank of the world, per L its (exit code, stderr,
    seconds)."""
    import contextlib
    import io
    import time

    import lm_eval
    from lm_eval.tasks import TaskManager

    import occult_hf.eval as occult_eval
    from occult_hf.cli import main

    own_tasks = TaskManager(include_path=str(occult_eval.TASKS_DIR), include_defaults=False)
    occult_eval.make_task_manager = lambda include_path: own_tasks

    def evaluation(**kwargs):
        raise AssertionError("the evaluation started (lm-eval loads the model there)")

    lm_eval.simple_evaluate = evaluation
    outcomes = {}
    for limit in ("0.1", "0.2"):
        stderr, start = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(stderr):
            try:
                code = main(["eval", "--tasks", "occult_offline", "--device", "cpu", "--limit", limit,
                             "--output_path", f"{output_root}/rank{rank}"])  # fmt: skip
            except SystemExit as exit_:
                code = exit_.code
        outcomes[limit] = (code, stderr.getvalue(), time.monotonic() - start)
    return outcomes


@pytest.mark.world_size(WORLD_SIZE)
def test_a_fraction_that_leaves_a_rank_no_document_is_refused_before_the_model_loads(tmp_path):
    """--limit 0.1 scores 1 of occult_offline_ppl's 8 documents, none for rank 1: every rank must stop before the
    model loads, naming the flag, the value, the task and the fix; --limit 0.2 scores 2 and the evaluation starts."""
    env = {**EVAL_ENV, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    reports = run_world(limit_runs, WORLD_SIZE, str(tmp_path / "runs"), env=env, timeout_s=240)
    for report in reports:
        code, err, seconds = report["0.1"]
        assert code == 2 and LOADED not in err
        assert ("occult eval: --limit 0.1 leaves ranks [1] of the 2 without a document of occult_offline_ppl (1 of 8 "
                "documents scored)") in err  # fmt: skip
        assert "give --limit 0.25 or more, or an integer --limit 2 or more" in err
        assert seconds < 60
        code, err, _ = report["0.2"]
        assert code == 2 and LOADED in err and "--limit 0.2 leaves" not in err


def test_the_fix_names_a_fraction_that_works():
    """The fraction the error offers gives every rank a document of every task; none is offered where the only
    fraction left is 1, and a task with fewer documents than ranks is named as one that no --limit helps."""
    from occult_hf.cli.eval_checks import check_fraction_for_ranks

    for limit, world_size, sizes, fix in (
        (0.01, 8, {"a": 300, "b": 1000}, "give --limit 0.027 or more, or an integer --limit 8 or more"),
        (0.3, 2, {"a": 2}, "give an integer --limit 2 or more"),
        (0.5, 3, {"a": 2, "b": 30}, "['a'] have fewer documents than ranks: leave them out of --tasks or run on fewer ranks"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=f"--limit {limit} leaves ranks") as refused:
            check_fraction_for_ranks(limit, world_size, sizes)
        assert str(refused.value).endswith(fix)
    check_fraction_for_ranks(0.027, 8, {"a": 300, "b": 1000})
    check_fraction_for_ranks(0.01, 1, {"a": 1})  # one process: rank 0 always gets the first document
