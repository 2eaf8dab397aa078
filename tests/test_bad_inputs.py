"""Bad input files and settings, as a hostile user gives them: one table per entry point.

Every case says what the user did and what the error must name (the file, the JSON path, the
setting). Library calls must raise `ValueError`/`TypeError`/`FileNotFoundError`; the command line
must exit with a non-zero code and print one line (no traceback) that names the file.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from occult_hf import OccultConfig, Placement
from occult_hf.atomic import atomic_write_text, json_text, to_json_native

GOOD_PLACEMENT = {"num_experts": 4, "num_devices": 2, "layers": {"0": [0, 0, 1, 1], "1": [0, 1, 0, 1]}}


def _placement(**changes):
    data = json.loads(json.dumps(GOOD_PLACEMENT))
    for key, value in changes.items():
        if value is _DROP:
            data.pop(key)
        else:
            data[key] = value
    return data


_DROP = object()

# (what the user did, file text, words the error must contain)
PLACEMENT_FILES = [
    ("float device id is not truncated", _placement(layers={"0": [0, 0.9, 1, 1.7], "1": [0, 1, 0, 1]}),
     "$.layers['0'][1] must be an integer, got float 0.9"),
    ("float device count", _placement(num_devices=2.7), "$.num_devices must be an integer, got float 2.7"),
    ("boolean device count", _placement(num_devices=True), "$.num_devices must be an integer, got a boolean"),
    ("boolean device id", _placement(layers={"0": [0, True, 1, 1], "1": [0, 1, 0, 1]}),
     "$.layers['0'][1] must be an integer, got a boolean"),
    ("non-canonical layer key", _placement(layers={"00": [0, 0, 1, 1], "1": [0, 1, 0, 1]}),
     "$.layers['00']: layer key must be a decimal layer index in canonical form"),
    ("negative layer key", _placement(layers={"-1": [0, 0, 1, 1]}), "$.layers['-1']: layer key"),
    ("device id out of range", _placement(layers={"0": [0, 0, 1, 2], "1": [0, 1, 0, 1]}),
     "$.layers['0'][3] is 2, outside [0, num_devices=2)"),
    ("too few experts", _placement(layers={"0": [0, 1, 1], "1": [0, 1, 0, 1]}), "$.layers['0'] maps 3 experts"),
    ("missing key", _placement(num_devices=_DROP), "$ lacks keys ['num_devices']"),
    ("typo in a key", _placement(num_device=2), "$ has unknown keys ['num_device']"),
    ("layers not an object", _placement(layers=[[0, 0, 1, 1]]), "$.layers must be a non-empty JSON object"),
    ("meta not an object", _placement(meta=[1]), "$.meta must be a JSON object"),
    ("top level a list", [GOOD_PLACEMENT], "$ must be a JSON object, got an array"),
    ("replica on the primary device", _placement(replicas={"0": {"1": [0]}}), "$.replicas['0']['1'] repeats"),
    ("replica of an unknown layer", _placement(replicas={"5": {"1": [1]}}), "$.replicas['5']: layer 5 is not in"),
    ("float slots_per_device", _placement(slots_per_device=2.0), "$.slots_per_device must be an integer"),
]


@pytest.mark.parametrize("case, data, message", PLACEMENT_FILES, ids=[c[0] for c in PLACEMENT_FILES])
def test_placement_files_are_parsed_strictly(tmp_path, case, data, message):
    path = tmp_path / "occult_placement.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        Placement.load(path)
    assert str(path) in str(error.value) and message in str(error.value), case


@pytest.mark.parametrize(
    "case, text, message",
    [
        ("duplicate layer key", '{"num_experts": 4, "num_devices": 2, "layers": {"0": [0,0,1,1], "0": [0,1,0,1]}}',
         "key '0' appears twice"),
        ("truncated file", '{"num_experts": 4, "num_devi', "is not valid JSON"),
        ("empty file", "", "is not valid JSON"),
        ("binary garbage", "\udcff\udcfe", "is not valid JSON"),
    ],
)
def test_placement_files_that_are_not_json(tmp_path, case, text, message):
    path = tmp_path / "p.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        Placement.load(path)
    assert str(path) in str(error.value), case


def test_placement_names_exactly_the_model_layers():
    placement = Placement.from_dict(GOOD_PLACEMENT)
    with pytest.raises(ValueError, match=re.escape("names layers [1] that are not MoE layers of the model")):
        placement.validate_for(4, [0])
    placement.validate_for(4, [0], exact=False)  # a profile may cover some layers only
    with pytest.raises(FileNotFoundError, match="is not a file"):
        Placement.load("/nonexistent/occult_placement.json")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_devices": True}, ValueError, "num_devices must be a positive integer, got True"),
        ({"num_devices": 2.0}, ValueError, "num_devices must be a positive integer, got 2.0"),
        ({"prune": "router", "max_devices_per_token": True}, ValueError, "max_devices_per_token (N_d) must be an integer"),
        ({"deterministic": "no"}, TypeError, "OccultConfig.deterministic must be True or False, got str 'no'"),
        ({"deterministic": 1}, TypeError, "OccultConfig.deterministic must be True or False"),
        ({"profile": 3}, TypeError, "OccultConfig.profile must be None or a path"),
        ({"placement": {"num_experts": 4, "num_devices": 2.0, "layers": {"0": [0, 0, 1, 1]}}}, ValueError,
         "$.num_devices must be an integer, got float 2.0"),
    ],
)
def test_occult_config_rejects_lenient_values(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        OccultConfig(**kwargs)


def test_occult_config_files(tmp_path):
    path = tmp_path / "occult.json"
    path.write_text('{"dispatch": "dedup",')
    with pytest.raises(ValueError, match=re.escape(f"occult_config {str(path)!r} is not valid JSON")):
        OccultConfig.coerce(str(path))
    path.write_text('{"deterministic": "no"}')
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        OccultConfig.coerce(str(path))


# ----- atomic writes ------------------------------------------------------------------------------


def test_numpy_metadata_is_written_as_json_numbers(tmp_path):
    meta = {"ct": np.float64(1.5), "tokens": np.int64(7), "ok": np.bool_(True), "per_layer": np.arange(2), 3: (1, 2)}
    assert to_json_native(meta) == {"ct": 1.5, "tokens": 7, "ok": True, "per_layer": [0, 1], "3": [1, 2]}
    placement = Placement(4, 2, {0: [0, 0, 1, 1]}, meta=meta)
    placement.save(tmp_path)
    assert Placement.load(tmp_path).meta["tokens"] == 7
    assert OccultConfig(placement=placement).to_json_string()  # the config that holds it serialises too


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "occult_placement.json"
    good = Placement.from_dict(GOOD_PLACEMENT)
    good.save(path)
    before = path.read_bytes()
    for bad_meta, error in [({"x": object()}, TypeError), ({"x": float("nan")}, ValueError), ({1.5: 1}, TypeError)]:
        with pytest.raises(error, match=r"at JSON path \$\.meta"):
            Placement(4, 2, {0: [0, 0, 1, 1]}, meta=bad_meta).save(path)
        assert path.read_bytes() == before
    with pytest.raises(RuntimeError, match="disk full"):
        _failing_write(path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["occult_placement.json"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_text(tmp_path / "missing" / "x.json", "{}")
    assert json_text({"a": np.int32(1)}) == '{\n "a": 1\n}\n'


def _failing_write(path):
    from occult_hf.atomic import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write("{")  # half a file
        raise RuntimeError("disk full")
