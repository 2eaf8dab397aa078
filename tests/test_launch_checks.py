"""A launcher that started one process while `num_devices > 1` asked for more is an error on every
entry that builds an EP model (`apply_occult`, `from_pretrained(occult_config=...)`), not only in the
fine-tune entry point (issue 13: "a launch that would run fewer processes than num_devices is an
error, unless the user asks for logical devices explicitly"). A plain `python` process keeps its
logical devices, the documented one-process mode."""

from __future__ import annotations

import pytest
from tiny_models import tiny_checkpoint, tiny_model

from occult_hf import OccultConfig, apply_occult, occult_config_of
from occult_hf.hf.launch import LAUNCHER_ENV


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# what each launcher leaves in the environment of a lone process: torchrun --nproc-per-node 1, and
# accelerate launch --num_processes 2 --cpu falling back to one plain process
@pytest.mark.parametrize("launched", [{"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, {"ACCELERATE_USE_CPU": "True"}])
def test_one_launched_process_with_several_devices_is_an_error(no_launcher, launched):
    for name, value in launched.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ValueError, match=r"OccultConfig.num_devices=2 but this launch runs 1 process \(.*logical_devices=True"):
        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
    # asked for explicitly: logical devices, as in a plain process
    model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2, logical_devices=True))
    assert occult_config_of(model).num_devices == 2
    # one device needs no processes beyond this one
    apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=1))


def test_the_from_pretrained_path_checks_too(no_launcher, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoint("olmoe", tmp_path / "ckpt")
    no_launcher.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="this launch runs 1 process"):
        AutoModelForCausalLM.from_pretrained(checkpoint, occult_config={"num_devices": 2})
    no_launcher.delenv("LOCAL_RANK")  # a plain process: logical devices, no error
    model = AutoModelForCausalLM.from_pretrained(checkpoint, occult_config={"num_devices": 2})
    assert occult_config_of(model).num_devices == 2


def test_logical_devices_is_a_checked_json_field():
    config = OccultConfig(num_devices=4, logical_devices=True)
    assert OccultConfig.from_dict(config.to_dict()) == config and config.to_dict()["logical_devices"] is True
    with pytest.raises(TypeError, match="logical_devices must be True or False"):
        OccultConfig(logical_devices="yes")
