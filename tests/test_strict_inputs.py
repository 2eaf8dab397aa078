"""Every input parsed strictly the same way, as a hostile user gives it (issue 33's probe, one test per case).

- JSON anywhere (occult_config files, a checkpoint's config.json, placements, profile headers, trace meta):
  duplicate keys, NaN / Infinity, nesting past the interpreter's limit and integers past its digit limit are
  errors that name the file; files past a size limit are refused before they are read.
- Paths a file names are resolved against that file (a checkpoint's config.json, an occult_config file), never
  against the working directory.
- Placements that leave a device empty, name layers the model or profile lacks, or a 20-digit layer; profiles
  whose counts contradict each other or come from different models: short errors naming the file.
- Timeouts: finite seconds within `MAX_TIMEOUT_S`, naming the setting.
"""

from __future__ import annotations

import errno
import json
import os
import re

import numpy as np
import pytest

from occult_hf import OccultConfig, Placement
from occult_hf.profile import LayerRouting, RoutingProfile
from tiny_models import tiny_model

PLACEMENT = {"num_experts": 8, "num_devices": 2, "layers": {"0": [0, 0, 0, 0, 1, 1, 1, 1], "1": [0, 1] * 4}}


def _layer(pairs: list[tuple[int, int]], num_experts: int = 8) -> LayerRouting:
    """The counts of tokens routed to the given (i, j) expert pairs (top_k=2)."""
    coactivation = np.zeros((num_experts, num_experts), dtype=np.int64)
    counts = np.zeros(num_experts, dtype=np.int64)
    for i, j in pairs:
        coactivation[i, j] += 1
        coactivation[j, i] += 1
        counts[[i, j]] += 1
    sample = np.array(pairs, dtype=np.int64)
    return LayerRouting(coactivation, counts, len(pairs), topk_sample=sample)


def _profile(model_type: str | None = "olmoe") -> RoutingProfile:
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (1, 2)]
    return RoutingProfile(8, 2, {0: _layer(pairs), 1: _layer(pairs)}, model_type=model_type, meta={"source": model_type})


# ----- JSON: duplicate keys, NaN, depth, digits, size ------------------------------------------------


OCCULT_CONFIG_FILES = [
    ("a key twice", '{"dispatch": "dedup", "dispatch": "per_expert"}', "key 'dispatch' appears twice"),
    ("an inline placement naming layer 0 twice",
     '{"placement": {"num_experts": 8, "num_devices": 2, "layers": {"0": [0,0,0,0,1,1,1,1], "0": [0,1,0,1,0,1,0,1]}}}',
     "key '0' appears twice"),
    ("Infinity as the exchange timeout", '{"exchange_timeout_s": Infinity}', "Infinity is not a JSON number"),
    ("1e300 as the exchange timeout", '{"exchange_timeout_s": 1e300}', "exchange_timeout_s=1e+300 must be a number of seconds in (0, 86400]"),
    ("nested past the interpreter's limit", '{"x": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    ("an integer of 5000 digits", '{"num_devices": ' + "9" * 5000 + "}", "is not valid JSON: Exceeds the limit"),
]


@pytest.mark.parametrize("case, text, words", OCCULT_CONFIG_FILES, ids=[c[0] for c in OCCULT_CONFIG_FILES])
def test_occult_config_files_are_read_strictly(tmp_path, case, text, words):
    path = tmp_path / "occult.json"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        OccultConfig.load(path)
    message = str(error.value)
    assert str(path) in message and words in message and len(message) < 400, (case, message[:500])


PLACEMENT_METAS = [
    ("NaN in meta (read, not later at the write)", "NaN", "NaN is not a JSON number"),
    ("deeply nested meta", "[" * 100000 + "]" * 100000, "nested too deeply"),
    ("a 5000-digit integer in meta", "9" * 5000, "Exceeds the limit"),
]


@pytest.mark.parametrize("case, meta, words", PLACEMENT_METAS, ids=[c[0] for c in PLACEMENT_METAS])
def test_placement_meta_that_json_reads_leniently_is_refused_at_the_read(tmp_path, case, meta, words):
    path = tmp_path / "occult_placement.json"
    path.write_text(json.dumps(PLACEMENT)[:-1] + f', "meta": {{"score": {meta}}}}}')
    with pytest.raises(ValueError) as error:
        Placement.load(path)
    assert str(path) in str(error.value) and words in str(error.value) and len(str(error.value)) < 400, case


def test_a_placement_file_past_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import occult_hf.placement.placement as placement_module

    path = tmp_path / "big.json"
    Placement.from_dict(PLACEMENT).save(path)
    monkeypatch.setattr(placement_module, "MAX_PLACEMENT_BYTES", 64)
    with pytest.raises(ValueError, match=re.escape(f"placement {str(path)!r} is {path.stat().st_size} bytes, more than the 64")):
        Placement.load(path)


def test_profile_header_and_trace_meta_are_read_strictly(tmp_path):
    from safetensors.numpy import load_file, save_file

    from occult_hf.profile.routing_profile import PROFILE_METADATA_KEY

    good = tmp_path / "good.safetensors"
    _profile().save(good)
    from safetensors import safe_open

    with safe_open(str(good), "np") as f:
        header = f.metadata()[PROFILE_METADATA_KEY]
    twice = tmp_path / "twice.safetensors"
    save_file(load_file(str(good)), str(twice), metadata={PROFILE_METADATA_KEY: header[:-1] + ', "top_k": 3}'})
    with pytest.raises(ValueError, match=re.escape(f"routing profile {str(twice)!r}: metadata 'occult_profile': key 'top_k' appears twice")):
        RoutingProfile.load(twice)

    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=np.array([[0, 1], [2, 3]]), meta=np.array('{"n_experts": NaN}'))
    with pytest.raises(ValueError, match=re.escape(f"trace file {str(trace)!r}: its 'meta' array: NaN is not a JSON number")):
        RoutingProfile.from_trace(trace)


# ----- paths resolved against the file that names them -------------------------------------------------


def _checkpoint_with(tmp_path, occult_config: dict):
    """A saved tiny OLMoE whose config.json holds `occult_config` as given (JSON text, not re-validated)."""
    from occult_hf import apply_occult

    directory = tmp_path / "checkpoint"
    apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=2)).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["occult_config"] = occult_config
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_relative_placement_path_in_a_checkpoint_config_names_the_checkpoint_file(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from occult_hf.hf.apply import install, occult_config_of

    install()
    directory = _checkpoint_with(tmp_path, {"placement": "my_placement.json", "num_devices": 2})
    in_checkpoint = Placement(8, 2, {0: [1, 0, 1, 0, 1, 0, 1, 0], 1: [0, 0, 1, 1, 0, 0, 1, 1]})
    in_checkpoint.save(directory / "my_placement.json")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    Placement.contiguous(8, 2, [0, 1]).save(cwd / "my_placement.json")  # the same name in the working directory
    monkeypatch.chdir(cwd)
    assert occult_config_of(AutoModelForCausalLM.from_pretrained(directory)).placement.layers == in_checkpoint.layers

    os.remove(directory / "my_placement.json")  # only the working directory's file is left: an error, not that file
    with pytest.raises(FileNotFoundError, match=re.escape(f"names 'my_placement.json', which is not in the checkpoint directory {str(directory)!r}")):
        AutoModelForCausalLM.from_pretrained(directory)


def test_a_checkpoint_config_whose_inline_placement_names_a_layer_twice_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf.hf.apply import install

    install()
    directory = _checkpoint_with(tmp_path, {"num_devices": 2})
    text = (directory / "config.json").read_text()
    twice = '"placement": {"num_experts": 8, "num_devices": 2, "layers": {"0": [0,0,0,0,1,1,1,1], "1": [0,1,0,1,0,1,0,1], "0": [1,1,1,1,0,0,0,0]}}, '
    (directory / "config.json").write_text(text.replace('"occult_config": {', '"occult_config": {' + twice))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint config {str(directory / 'config.json')!r}: key '0' appears twice")):
        AutoModelForCausalLM.from_pretrained(directory)


def test_a_relative_path_in_an_occult_config_file_names_a_file_beside_it(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    Placement.from_dict(PLACEMENT).save(folder / "p.json")
    (folder / "occult.json").write_text(json.dumps({"placement": "p.json", "num_devices": 2}))
    monkeypatch.chdir(tmp_path)
    assert OccultConfig.load(folder / "occult.json").placement == str(folder / "p.json")


# ----- placements: empty devices, extra and huge layers ------------------------------------------------


def test_a_placement_that_leaves_a_device_empty_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from occult_hf.hf.apply import install

    install()
    empty = {"num_experts": 8, "num_devices": 3, "layers": {"0": [0, 0, 0, 0, 1, 1, 1, 1], "1": [0, 1, 2] * 2 + [0, 1]}}
    with pytest.raises(ValueError, match=re.escape("Placement layer 0 leaves devices [2] without an expert")):
        Placement.from_dict(empty)
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(empty))
    directory = tmp_path / "model"
    tiny_model("olmoe").save_pretrained(directory)
    with pytest.raises(ValueError, match=re.escape(f"placement {str(path)!r}: Placement layer 0 leaves devices [2] without an expert")):
        AutoModelForCausalLM.from_pretrained(directory, occult_config=OccultConfig(placement=str(path)))


def test_layer_keys_are_bounded_and_errors_about_many_layers_are_short():
    huge = {**PLACEMENT, "layers": {**PLACEMENT["layers"], "9" * 20: [0, 1] * 4}}
    with pytest.raises(ValueError, match=re.escape("$.layers['99999999999999999999']: the index is larger than 65535")):
        Placement.from_dict(huge)
    many = Placement(4, 2, {layer: [0, 0, 1, 1] for layer in range(200_000)})
    with pytest.raises(ValueError) as error:
        many.validate_for(4, [0, 1])
    assert "names layers [2, 3, 4, 5, 6, 7, 8, 9, ... (199998 in all)]" in str(error.value) and len(str(error.value)) < 300


def test_report_refuses_a_placement_with_a_layer_the_profile_lacks():
    from occult_hf.report import evaluate_placements

    extra = Placement(8, 2, {0: [0, 1] * 4, 1: [0, 1] * 4, 7: [0, 1] * 4})
    with pytest.raises(ValueError, match=re.escape("names layers [7] that are not MoE layers of the routing profile")):
        evaluate_placements(_profile(), {"extra": extra})


# ----- profiles: counts that contradict each other, profiles of different models ---------------------


def _saved_profile(tmp_path, edit) -> str:
    """A good profile, its layer-0 tensors changed by `edit(tensors)`, written under another name."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    _profile().save(good)
    tensors = load_file(str(good))
    edit(tensors)
    with safe_open(str(good), "np") as f:
        metadata = f.metadata()
    save_file(tensors, str(bad), metadata=metadata)
    return str(bad)


def _asymmetric(tensors):
    tensors["layer.0.coactivation"][0, 1] += 1


def _no_tokens(tensors):
    tensors["layer.0.token_count"] = np.array(0, dtype=np.int64)


def _huge_counts(tensors):
    tensors["layer.0.coactivation"][0, 1] = tensors["layer.0.coactivation"][1, 0] = 2**62


PROFILE_EDITS = [
    ("asymmetric co-activation", _asymmetric, "layer 0: coactivation must be symmetric with a zero diagonal"),
    ("token_count 0 beside real counts", _no_tokens, "layer 0: a count exceeds token_count=0"),
    ("co-activation entries of 2^62 (an int64 overflow in the cut)", _huge_counts, "layer 0: a count exceeds token_count=5"),
]


@pytest.mark.parametrize("case, edit, words", PROFILE_EDITS, ids=[c[0] for c in PROFILE_EDITS])
def test_profile_counts_that_contradict_each_other_are_refused(tmp_path, case, edit, words):
    path = _saved_profile(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(f"routing profile {path!r}: {words}")):
        RoutingProfile.load(path)


def test_profiles_of_different_models_are_not_pooled():
    from occult_hf.placement import plan_placement

    with pytest.raises(ValueError, match=re.escape("routing profiles of different models cannot be pooled: olmoe is of model_type 'olmoe', qwen2_moe is of model_type 'qwen2_moe'")):
        plan_placement([_profile("olmoe"), _profile("qwen2_moe")], 2, "occult")
    with pytest.raises(ValueError, match="routing profiles of different models cannot be pooled"):
        RoutingProfile.merge([_profile("olmoe"), _profile("qwen2_moe")])
    plan_placement([_profile("olmoe"), _profile(None)], 2, "occult")  # a trace's profile says no model: pooled


def test_a_trace_profile_of_an_unknown_model_type_is_refused(tmp_path):
    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=np.array([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="occult_hf does not support model_type 'bogus'; supported model types: "):
        RoutingProfile.from_trace(trace, model_type="bogus")


# ----- timeouts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), 1e300, float("nan"), 0, -3, True, 86401])
def test_the_exchange_timeout_is_finite_positive_seconds_within_a_day(value):
    with pytest.raises(ValueError, match=re.escape(f"OccultConfig.exchange_timeout_s={value!r} must be a number of seconds in (0, 86400]")):
        OccultConfig(exchange_timeout_s=value)


@pytest.mark.parametrize("variable", ["OCCULT_SAVE_TIMEOUT_S", "OCCULT_EXCHANGE_TIMEOUT_S"])
@pytest.mark.parametrize("raw", ["inf", "1e300", "nan", "-1", "soon"])
def test_timeout_variables_are_finite_positive_seconds_within_a_day(monkeypatch, variable, raw):
    from occult_hf.dispatch.base import resolve_timeout
    from occult_hf.distributed.agreement import save_timeout_s

    monkeypatch.setenv(variable, raw)
    read = save_timeout_s if variable == "OCCULT_SAVE_TIMEOUT_S" else lambda: resolve_timeout(None)
    with pytest.raises(ValueError, match=re.escape(f"{variable}={raw!r} must be a number of seconds in (0, 86400]")):
        read()


# ----- writes ---------------------------------------------------------------------------------------------


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "occult_placement.json"
    with pytest.raises(OSError) as error:
        Placement.from_dict(PLACEMENT).save(path)
    assert error.value.errno == errno.ENOSPC and str(path) in str(error.value), str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_every_json_reader_refuses_a_key_given_twice(tmp_path):
    """The readers of other JSON the project reads: lm-eval results (NaN allowed: lm-eval writes it), the prepared
    training data's meta."""
    from occult_hf.eval.report import load_results
    from occult_hf.training.data import PreparedData

    results = tmp_path / "results.json"
    results.write_text('{"results": {"a": {"acc,none": NaN}}, "results": {}}')
    with pytest.raises(ValueError, match=re.escape(f"lm-eval results {str(results)!r}: key 'results' appears twice")):
        load_results(results)
    results.write_text('{"results": {"a": {"acc_stderr,none": NaN}}}')
    assert np.isnan(load_results(results)["results"]["a"]["acc_stderr,none"])
    (tmp_path / "data.json").write_text('{"format": "x", "format": "y"}')
    with pytest.raises(ValueError, match="prepared data .*data.json': key 'format' appears twice"):
        PreparedData(tmp_path)
