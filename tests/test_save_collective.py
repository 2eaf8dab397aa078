"""A `save_pretrained` every EP rank makes returns on every rank once EP rank 0 has written the files (2 gloo ranks).

Rank 1 returned as soon as it had handed its experts over, while rank 0 was still writing: a rank that loaded the
directory right after its own call found it missing or half written. Rank 0's failure to write is named on rank 1 at
once, and `is_main_process=False` on rank 0 (no files) lets every rank go.
"""

from __future__ import annotations

import time

import pytest

from distributed import run_world
from tiny_models import tiny_model

SLOW_WRITE_S = 2.0


def _save_then_look(rank, world_size, directory):
    from transformers import OlmoeForCausalLM

    from occult_hf import OccultConfig, apply_occult

    model = apply_occult(tiny_model("olmoe", seed=4), OccultConfig(num_devices=world_size))
    real_save = OlmoeForCausalLM.save_pretrained

    def slow_save(self, *args, **kwargs):  # rank 0's write takes a while
        time.sleep(SLOW_WRITE_S)
        return real_save(self, *args, **kwargs)

    OlmoeForCausalLM.save_pretrained = slow_save
    report = {}
    model.save_pretrained(f"{directory}/saved")
    report["files after the call"] = sorted(p.name for p in __import__("pathlib").Path(f"{directory}/saved").glob("*.json"))

    def failing_save(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    OlmoeForCausalLM.save_pretrained = failing_save
    start = time.monotonic()
    try:
        model.save_pretrained(f"{directory}/full_disk")
        report["full disk"] = "returned"
    except Exception as error:  # noqa: BLE001 - what each rank sees is the point
        report["full disk"] = f"{type(error).__name__}: {error}"
    report["full disk seconds"] = time.monotonic() - start
    OlmoeForCausalLM.save_pretrained = real_save
    model.save_pretrained(f"{directory}/not_written", is_main_process=False)  # returns on every rank
    return report


@pytest.mark.world_size(2)
def test_every_rank_returns_once_the_files_are_written(tmp_path):
    rank0, rank1 = run_world(_save_then_look, 2, str(tmp_path), timeout_s=200)
    for report in (rank0, rank1):
        assert {"config.json", "occult_placement.json"} <= set(report["files after the call"]), report
    assert rank0["full disk"].startswith("OSError: save_pretrained") and "writing the checkpoint failed" in rank0["full disk"]
    assert rank1["full disk"].startswith("EPConfigMismatchError: occult_hf: rank 0 of the expert-parallel group failed at "
                                         "save_pretrained's files (OSError"), rank1["full disk"]  # fmt: skip
    assert rank1["full disk seconds"] < 30
    assert not (tmp_path / "not_written").exists()
