"""Issue 33's hostile cases, one parameter each: what a hostile user or a faulty peer does, and the clear answer
occult_hf owes (the error's type, and a short message naming the file, the setting or the rank).

    pytest tests/test_hostile_cases.py -q -rA      # every case by name: PASSED is fine, FAILED is bad
    OTHER/venv/bin/python -m pytest tests/test_hostile_cases.py -q   # another install of the same module layout

The fast cases live here: bad inputs in one process, and the multi-rank faults that end in an error in one
2-rank gloo world (`_world`, started once for all of them). The faults that need a process killed or a
training run are tested where they are built: `test_trainer_checkpoints.py` (a rank that stalls then is
SIGKILLed, or raises, while a Trainer checkpoint is written), `test_save_publish.py` (a crash between any two
publish steps of a sharded save), `test_faults.py` (stalled and dead peers in a forward and a save) and
`test_peer_waits.py` (torchrun stops the ranks when one exits before `apply_occult`).
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import time

import numpy as np
import pytest

from distributed import run_world
from tiny_models import tiny_batch, tiny_checkpoint, tiny_model

#: the longest message a clear error may have (a list in it shows 8 items and the count)
MAX_MESSAGE = 400
PLACEMENT = {"num_experts": 8, "num_devices": 2, "layers": {"0": [0, 0, 0, 0, 1, 1, 1, 1], "1": [0, 1] * 4}}
#: a placement whose device 1 holds no expert of layer 0
EMPTY_DEVICE = {"num_experts": 8, "num_devices": 2, "layers": {"0": [0] * 8, "1": [0, 1] * 4}}

#: one-process cases: name (the parameter id) -> check, whose arguments are pytest fixtures
CASES = {}
#: multi-rank cases: name -> check(each rank's outcome, the world's directory)
WORLD_CASES = {}
#: one pytest worker runs this module, so the multi-rank cases share one world (`world`)
pytestmark = pytest.mark.xdist_group("hostile_cases")


def _registrar(table: dict):
    """A decorator `@named("case")` that puts the function into `table` under that name."""

    def named(name: str):
        def register(check):
            table[name] = check
            return check

        return register

    return named


case, world_case = _registrar(CASES), _registrar(WORLD_CASES)


def refused(error_type, call, *names) -> str:
    """`call()` raises `error_type` with a message shorter than `MAX_MESSAGE` that holds every one of `names`."""
    with pytest.raises(error_type) as raised:
        call()
    message = str(raised.value)
    missing = [name for name in names if str(name) not in message]
    assert not missing and len(message) < MAX_MESSAGE, (missing, len(message), message[:1000])
    return message


def command_refused(capsys, argv: list, *names) -> str:
    """`occult argv` exits with code 2 and one last line naming every one of `names`, without a traceback."""
    from occult_hf.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([str(arg) for arg in argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    missing = [name for name in names if str(name) not in last]
    assert exit_.value.code == 2 and "Traceback" not in err and not missing and len(last) < MAX_MESSAGE, (exit_.value.code, missing, err[-1500:])
    return last


def _install():
    from occult_hf.hf.apply import install

    install()


def _layer(pairs, num_experts: int = 8):
    """The counts of tokens routed to the given (i, j) expert pairs (top_k=2)."""
    from occult_hf.profile import LayerRouting

    coactivation = np.zeros((num_experts, num_experts), dtype=np.int64)
    counts = np.zeros(num_experts, dtype=np.int64)
    for i, j in pairs:
        coactivation[i, j] += 1
        coactivation[j, i] += 1
        counts[[i, j]] += 1
    return LayerRouting(coactivation, counts, len(pairs), topk_sample=np.array(pairs, dtype=np.int64))


def _profile(model_type: str | None = "olmoe"):
    from occult_hf.profile import RoutingProfile

    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (1, 2)]
    return RoutingProfile(8, 2, {0: _layer(pairs), 1: _layer(pairs)}, model_type=model_type, meta={"source": model_type})


def _edited_profile(tmp_path, edit) -> str:
    """A good profile file, its layer-0 tensors changed by `edit(tensors)`, written as bad.safetensors."""
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


def _file(path, text: str):
    path.write_text(text)
    return path


def _placement_with_meta(tmp_path, meta_json: str):
    return _file(tmp_path / "occult_placement.json", json.dumps(PLACEMENT)[:-1] + f', "meta": {{"score": {meta_json}}}}}')


def _layers_json(layers) -> str:
    """A placement file's text naming `layers` (E=8, D=2)."""
    return '{"num_experts": 8, "num_devices": 2, "layers": {' + ", ".join(f'"{l}": [0,0,0,0,1,1,1,1]' for l in layers) + "}}"


def _checkpoint(tmp_path, edit_config_text=None, seed: int = 1):
    """A saved tiny OLMoE (with occult_hf applied, D=2) whose config.json text is changed by `edit_config_text`."""
    from occult_hf import OccultConfig, apply_occult

    _install()
    directory = tmp_path / "checkpoint"
    apply_occult(tiny_model("olmoe", seed=seed), OccultConfig(num_devices=2)).save_pretrained(directory)
    if edit_config_text is not None:
        config = directory / "config.json"
        config.write_text(edit_config_text(config.read_text()))
    return directory


def _load(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


# ===== bad inputs: duplicate keys, relative paths, empty devices, extra layers, pooled profiles ==================


@case("occult_config file with a key twice")
def _(tmp_path):
    from occult_hf import OccultConfig

    path = _file(tmp_path / "occult.json", '{"dispatch": "dedup", "dispatch": "per_expert"}')
    refused(ValueError, lambda: OccultConfig.load(path), path, "key 'dispatch' appears twice")


@case("occult_config file whose inline placement names a layer twice")
def _(tmp_path):
    from occult_hf import OccultConfig

    path = _file(tmp_path / "occult.json", '{"placement": {"num_experts": 8, "num_devices": 2, "layers": '
                 '{"0": [0,0,0,0,1,1,1,1], "1": [0,1,0,1,0,1,0,1], "0": [0,1,0,1,0,1,0,1]}}}')  # fmt: skip
    refused(ValueError, lambda: OccultConfig.load(path), path, "key '0' appears twice")


@case("checkpoint config.json whose occult_config has a key twice")
def _(tmp_path):
    directory = _checkpoint(tmp_path, lambda text: text.replace('"occult_config": {', '"occult_config": {"num_devices": 4, '))
    refused(ValueError, lambda: _load(directory), directory / "config.json", "key 'num_devices' appears twice")


@case("checkpoint config.json whose inline placement names a layer twice")
def _(tmp_path):
    twice = ('"placement": {"num_experts": 8, "num_devices": 2, "layers": {"0": [0,0,0,0,1,1,1,1], "1": [0,1,0,1,0,1,0,1], '
             '"0": [1,1,1,1,0,0,0,0]}}, ')  # fmt: skip
    directory = _checkpoint(tmp_path, lambda text: text.replace('"occult_config": {', '"occult_config": {' + twice))
    refused(ValueError, lambda: _load(directory), directory / "config.json", "key '0' appears twice")


@case("relative placement path in a checkpoint config.json, a file of that name in the working directory")
def _(tmp_path, monkeypatch):
    from occult_hf import Placement
    from occult_hf.hf.apply import occult_config_of

    def relative(text):
        config = json.loads(text)
        config["occult_config"] = {"placement": "my_placement.json", "num_devices": 2}
        return json.dumps(config)

    directory = _checkpoint(tmp_path, relative)
    own = Placement(8, 2, {0: [1, 0] * 4, 1: [0, 0, 1, 1] * 2})
    own.save(directory / "my_placement.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Placement.contiguous(8, 2, [0, 1]).save(elsewhere / "my_placement.json")
    monkeypatch.chdir(elsewhere)
    assert occult_config_of(_load(directory)).placement.layers == own.layers  # the checkpoint's file, not the cwd's
    os.remove(directory / "my_placement.json")
    refused(FileNotFoundError, lambda: _load(directory), directory / "config.json", "names 'my_placement.json', which is not in the checkpoint directory")


@case("relative placement path in an occult_config file, a file of that name in the working directory")
def _(tmp_path, monkeypatch):
    from occult_hf import OccultConfig, Placement

    folder = tmp_path / "configs"
    folder.mkdir()
    Placement.from_dict(PLACEMENT).save(folder / "p.json")
    _file(folder / "occult.json", json.dumps({"placement": "p.json", "num_devices": 2}))
    Placement.contiguous(8, 2, [0, 1]).save(tmp_path / "p.json")
    monkeypatch.chdir(tmp_path)
    assert OccultConfig.load(folder / "occult.json").placement == str(folder / "p.json")


@case("placement file that leaves a device without an expert")
def _(tmp_path):
    from occult_hf import Placement

    path = _file(tmp_path / "empty.json", json.dumps(EMPTY_DEVICE))
    refused(ValueError, lambda: Placement.load(path), path, "layer 0 leaves devices [1] without an expert")


@case("from_pretrained with a placement that leaves a device without an expert")
def _(tmp_path):
    from occult_hf import OccultConfig

    _install()
    path = _file(tmp_path / "empty.json", json.dumps(EMPTY_DEVICE))
    model = tiny_checkpoint("olmoe", tmp_path / "model")
    refused(ValueError, lambda: _load(model, occult_config=OccultConfig(placement=str(path))), path, "leaves devices [1] without an expert")


@case("occult report of a placement with a layer the profile lacks")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    path = _file(tmp_path / "extra.json", _layers_json([0, 1, 7]))
    command_refused(capsys, ["report", tmp_path / "profile.safetensors", path, "--no-plots"], path,
                    "names layers [7] that are not MoE layers of the routing profile")  # fmt: skip


@case("occult replan of a placement with a layer the profile lacks")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    path = _file(tmp_path / "extra.json", _layers_json([0, 1, 7]))
    command_refused(capsys, ["replan", path, tmp_path / "profile.safetensors", "--out", tmp_path / "r.json"], path,
                    tmp_path / "profile.safetensors", "has no routing for layers [7]")  # fmt: skip


@case("occult report of a placement with a 20-digit layer key")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    path = _file(tmp_path / "huge_key.json", _layers_json([0, 1, "9" * 20]))
    command_refused(capsys, ["report", tmp_path / "profile.safetensors", path, "--no-plots"], path,
                    "$.layers['99999999999999999999']: the index is larger than 65535")  # fmt: skip


@case("occult report of a placement with 2M layers")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    path = _file(tmp_path / "two_million.json", _layers_json(range(2_000_000)))
    start = time.monotonic()
    command_refused(capsys, ["report", tmp_path / "profile.safetensors", path, "--no-plots"], path,
                    f"is {path.stat().st_size} bytes, more than the 16777216 a placement file may have")  # fmt: skip
    assert time.monotonic() - start < 5  # refused before it is read


@case("from_pretrained with a placement of 200k extra layers")
def _(tmp_path):
    from occult_hf import OccultConfig, Placement

    _install()
    model = tiny_checkpoint("olmoe", tmp_path / "model")
    path = _file(tmp_path / "extra.json", _layers_json(range(200_000)))
    refused(ValueError, lambda: _load(model, occult_config=OccultConfig(placement=str(path))), path,
            "$.layers['65536']: the index is larger than 65535")  # fmt: skip
    extra = Placement(8, 2, {layer: [0, 0, 0, 0, 1, 1, 1, 1] for layer in range(10_000)})
    refused(ValueError, lambda: _load(model, occult_config=OccultConfig(placement=extra)),
            "names layers [2, 3, 4, 5, 6, 7, 8, 9, ... (9998 in all)] that are not MoE layers of the model")  # fmt: skip


@case("profiles of different models pooled by plan_placement")
def _():
    from occult_hf.placement import plan_placement

    refused(ValueError, lambda: plan_placement([_profile("olmoe"), _profile("qwen2_moe")], 2, "occult"),
            "routing profiles of different models cannot be pooled: olmoe is of model_type 'olmoe', qwen2_moe is of model_type 'qwen2_moe'")  # fmt: skip
    plan_placement([_profile("olmoe"), _profile(None)], 2, "occult")  # a trace's profile names no model: pooled


@case("profiles of different models pooled by occult place")
def _(tmp_path, capsys):
    _profile("olmoe").save(tmp_path / "a.safetensors")
    _profile("qwen2_moe").save(tmp_path / "b.safetensors")
    command_refused(capsys, ["place", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--num-devices", "2",
                             "--out", tmp_path / "p.json"], "cannot be pooled", tmp_path / "b.safetensors")  # fmt: skip
    assert not (tmp_path / "p.json").exists()


@case("profiles of different models merged")
def _():
    from occult_hf.profile import RoutingProfile

    refused(ValueError, lambda: RoutingProfile.merge([_profile("olmoe"), _profile("qwen2_moe")]), "cannot be pooled", "'qwen2_moe'")


@case("lm-eval results and prepared training data with a key twice")
def _(tmp_path):
    from occult_hf.eval.report import load_results
    from occult_hf.training.data import PreparedData

    results = _file(tmp_path / "results.json", '{"results": {"a": {"acc,none": NaN}}, "results": {}}')
    refused(ValueError, lambda: load_results(results), results, "key 'results' appears twice")
    _file(results, '{"results": {"a": {"acc_stderr,none": NaN}}}')  # lm-eval writes NaN: allowed there
    assert np.isnan(load_results(results)["results"]["a"]["acc_stderr,none"])
    _file(tmp_path / "data.json", '{"format": "x", "format": "y"}')
    refused(ValueError, lambda: PreparedData(tmp_path), tmp_path / "data.json", "key 'format' appears twice")


# ===== timeouts ====================================================================================================


def _exchange_timeout_refused(value):
    def check():
        from occult_hf import OccultConfig

        refused(ValueError, lambda: OccultConfig(exchange_timeout_s=value),
                f"OccultConfig.exchange_timeout_s={value!r} must be a number of seconds in (0, 86400]")  # fmt: skip

    return check


for _value in (float("inf"), 1e300, float("nan"), 0, -3, True, 2 * 86400):
    case(f"exchange_timeout_s={_value!r}")(_exchange_timeout_refused(_value))


@case("exchange_timeout_s=Infinity in an occult_config file")
def _(tmp_path):
    from occult_hf import OccultConfig

    path = _file(tmp_path / "occult.json", '{"exchange_timeout_s": Infinity}')
    refused(ValueError, lambda: OccultConfig.load(path), path, "Infinity is not a JSON number")


def _timeout_variable_refused(variable: str):
    def check(monkeypatch):
        from occult_hf.dispatch.base import resolve_timeout
        from occult_hf.distributed.agreement import join_timeout_s, save_timeout_s

        read = {"OCCULT_SAVE_TIMEOUT_S": save_timeout_s, "OCCULT_JOIN_TIMEOUT_S": join_timeout_s,
                "OCCULT_EXCHANGE_TIMEOUT_S": lambda: resolve_timeout(None)}[variable]  # fmt: skip
        for raw in ("inf", "1e300", "nan", "-1", "soon"):
            monkeypatch.setenv(variable, raw)
            refused(ValueError, read, f"{variable}={raw!r} must be a number of seconds in (0, 86400]")

    return check


for _variable in ("OCCULT_SAVE_TIMEOUT_S", "OCCULT_JOIN_TIMEOUT_S", "OCCULT_EXCHANGE_TIMEOUT_S"):
    case(f"{_variable}=inf, 1e300, nan, -1 or soon")(_timeout_variable_refused(_variable))


# ===== the minor half ================================================================================================


@case("a full disk under a placement write")
def _(tmp_path, monkeypatch):
    from occult_hf import Placement

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "occult_placement.json"
    refused(OSError, lambda: Placement.from_dict(PLACEMENT).save(path), "No space left on device", path)
    assert list(tmp_path.iterdir()) == []


@case("a full disk under save_pretrained")
def _(tmp_path, monkeypatch):
    """safetensors reports a full disk as `SafetensorError: Error while serializing: I/O error: No space left on
    device (os error 28)`, naming no file (seen on a 300 kB tmpfs)."""
    from safetensors import SafetensorError
    from transformers import modeling_utils

    from occult_hf import OccultConfig, apply_occult

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    target = tmp_path / "checkpoint"
    refused(OSError, lambda: model.save_pretrained(target), f"save_pretrained {str(target)!r}", "No space left on device")
    assert list(target.iterdir()) == []  # no staging directory left


@case("a full disk under a Trainer rank file")
def _(tmp_path, monkeypatch):
    """torch's writer reports a full disk as `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598`, naming no file (seen on a 300 kB tmpfs); the Trainer hook writes rank files through
    `atomic_torch_save` (the source scan in test_bad_inputs.py keeps it so)."""
    import torch

    from occult_hf.utils.atomic import atomic_torch_save

    def full(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full)
    path = tmp_path / "occult_rank1-of-2.pt"
    refused(OSError, lambda: atomic_torch_save({"x": 1}, path), path, "bytes left on its file system", "unexpected pos")
    assert list(tmp_path.iterdir()) == []


@case("placement meta nested past the interpreter's limit")
def _(tmp_path):
    from occult_hf import Placement

    path = _placement_with_meta(tmp_path, "[" * 100000 + "]" * 100000)
    refused(ValueError, lambda: Placement.load(path), path, "nested too deeply")


@case("placement meta with a 5000-digit integer")
def _(tmp_path):
    from occult_hf import Placement

    path = _placement_with_meta(tmp_path, "9" * 5000)
    refused(ValueError, lambda: Placement.load(path), path, "Exceeds the limit (4300 digits)")


@case("placement meta with NaN, refused at the read")
def _(tmp_path):
    from occult_hf import Placement

    path = _placement_with_meta(tmp_path, "NaN")
    refused(ValueError, lambda: Placement.load(path), path, "NaN is not a JSON number")


@case("occult_config file nested past the interpreter's limit, or with a 5000-digit integer")
def _(tmp_path):
    from occult_hf import OccultConfig

    deep = _file(tmp_path / "deep.json", '{"x": ' + "[" * 100000 + "]" * 100000 + "}")
    refused(ValueError, lambda: OccultConfig.load(deep), deep, "nested too deeply")
    digits = _file(tmp_path / "digits.json", '{"num_devices": ' + "9" * 5000 + "}")
    refused(ValueError, lambda: OccultConfig.load(digits), digits, "Exceeds the limit (4300 digits)")


@case("profile header with a key twice, trace meta with NaN")
def _(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from occult_hf.profile import RoutingProfile
    from occult_hf.profile.routing_profile import PROFILE_METADATA_KEY

    good = tmp_path / "good.safetensors"
    _profile().save(good)
    with safe_open(str(good), "np") as f:
        header = f.metadata()[PROFILE_METADATA_KEY]
    twice = tmp_path / "twice.safetensors"
    save_file(load_file(str(good)), str(twice), metadata={PROFILE_METADATA_KEY: header[:-1] + ', "top_k": 3}'})
    refused(ValueError, lambda: RoutingProfile.load(twice), twice, "key 'top_k' appears twice")
    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=np.array([[0, 1], [2, 3]]), meta=np.array('{"n_experts": NaN}'))
    refused(ValueError, lambda: RoutingProfile.from_trace(trace), trace, "NaN is not a JSON number")


def _asymmetric(tensors):
    tensors["layer.0.coactivation"][0, 1] += 1


def _no_tokens(tensors):
    tensors["layer.0.token_count"] = np.array(0, dtype=np.int64)


def _huge_pairs(tensors):
    tensors["layer.0.coactivation"][0, 1] = tensors["layer.0.coactivation"][1, 0] = 2**62


def _profile_refused(edit, words: str):
    """`occult report` of a profile file changed by `edit` (it printed a cut/tok from counts that contradict)."""

    def check(tmp_path, capsys):
        path = _edited_profile(tmp_path, edit)
        command_refused(capsys, ["report", path, "--num-devices", "2", "--no-plots"], path, words)

    return check


case("profile with an asymmetric co-activation")(_profile_refused(_asymmetric, "layer 0: coactivation must be symmetric with a zero diagonal"))
case("profile with token_count 0 beside real counts")(_profile_refused(_no_tokens, "layer 0: a count exceeds token_count=0"))
case("profile with co-activation entries of 2^62")(_profile_refused(_huge_pairs, "layer 0: a count exceeds token_count=5"))


@case("profile built in memory with co-activation entries of 2^62")
def _():
    from occult_hf.profile import RoutingProfile

    pairs = _layer([(0, 4), (1, 5)])
    pairs.coactivation[[0, 4, 1, 5], [4, 0, 5, 1]] = 2**62  # cut by a contiguous placement: 2^64 wraps to 0
    refused(ValueError, lambda: RoutingProfile(8, 2, {0: pairs}), "layer 0 coactivation sums to", "past 2^62")


@case("dispatcher that cannot serve one process")
def _():
    from occult_hf import OccultConfig, apply_occult

    config = OccultConfig(num_devices=2, dispatcher="all_to_all")
    message = refused(ValueError, lambda: apply_occult(tiny_model("olmoe"), config)(tiny_batch()),
                      "OccultConfig.dispatcher='all_to_all'", "use 'auto' or one of ['local']")  # fmt: skip
    assert "'padded'" not in message


@case("expert_backend='triton' or 'grouped_mm_fused' on CPU")
def _(monkeypatch):
    from occult_hf import OccultConfig, apply_occult

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend in ("triton", "grouped_mm_fused"):
        model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2, expert_backend=backend))
        refused(ValueError, lambda: model(tiny_batch()), f"OccultConfig.expert_backend={backend!r} runs on CUDA, but the experts are on cpu: use expert_backend='auto'")


@case("a config whose fields were set after it was built")
def _():
    from occult_hf import OccultConfig, apply_occult

    for name, value, message in (
        ("num_devices", 3.5, "OccultConfig.num_devices must be a positive integer, got 3.5"),
        ("placement", None, "OccultConfig.placement must be 'contiguous', a path, a Placement or a dict, got NoneType"),
        ("dispatcher", ["local"], "OccultConfig.dispatcher must be one of ['auto', 'all_to_all', 'hierarchical', 'local', 'padded', 'symm_mem'], got ['local']"),
    ):  # fmt: skip
        config = OccultConfig()
        setattr(config, name, value)
        refused((ValueError, TypeError), lambda: apply_occult(tiny_model("olmoe"), config), message)


@case("occult place usage errors exit 2")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    command_refused(capsys, ["place", tmp_path / "profile.safetensors"], "occult place: --num-devices D is required")
    command_refused(capsys, ["place", "--num-devices", "2"], "the following arguments are required: profile")


@case("occult report usage errors exit 2")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    command_refused(capsys, ["report"], "occult report: give a routing PROFILE")
    command_refused(capsys, ["report", tmp_path / "profile.safetensors"], "give placement files, or --num-devices")


@case("occult profile usage errors exit 2")
def _(tmp_path, capsys):
    command_refused(capsys, ["profile", "--out", tmp_path / "p.safetensors"], "one of the arguments --text --dataset --from-trace is required")
    _file(tmp_path / "docs.txt", "hello\n")
    command_refused(capsys, ["profile", "--text", tmp_path / "docs.txt", "--out", tmp_path / "p.safetensors"], "MODEL is required")


@case("occult profile --from-trace --model-type bogus")
def _(tmp_path, capsys):
    np.savez(tmp_path / "trace.npz", topk_ids=np.array([[0, 1], [2, 3]]))
    command_refused(capsys, ["profile", "--from-trace", tmp_path / "trace.npz", "--model-type", "bogus", "--out", tmp_path / "p.safetensors"],
                    "occult_hf does not support model_type 'bogus'; supported model types: ")  # fmt: skip
    assert not (tmp_path / "p.safetensors").exists()


@case("occult place --option of 5000 digits")
def _(tmp_path, capsys):
    _profile().save(tmp_path / "profile.safetensors")
    command_refused(capsys, ["place", tmp_path / "profile.safetensors", "--num-devices", "2", "--option", "seed=" + "9" * 5000],
                    "argument --option: 'seed=9999", "has 5005 characters, more than the 200")  # fmt: skip


@case("a rank file missing from a partial Trainer checkpoint")
def _(tmp_path, monkeypatch):
    import occult_hf.hf.trainer as trainer

    (tmp_path / "occult_rank0-of-2.pt").write_bytes(b"")
    monkeypatch.setattr(trainer, "_ep_rank_world", lambda model: (1, 2))
    monkeypatch.setattr(trainer, "_rank_file", lambda directory, model: str(tmp_path / "occult_rank1-of-2.pt"))
    message = refused(FileNotFoundError, lambda: trainer._read_rank_file(str(tmp_path), model=None), tmp_path,
                      "holds ['occult_rank0-of-2.pt']: rank 1's save of it did not finish")  # fmt: skip
    assert "another EP layout" not in message
    (tmp_path / "occult_rank0-of-2.pt").rename(tmp_path / "occult_rank0-of-4.pt")
    refused(FileNotFoundError, lambda: trainer._read_rank_file(str(tmp_path), model=None), "holds ['occult_rank0-of-4.pt'] (written by another EP layout)")


@case("the finetune script at its default flags in one process")
def _(tmp_path, monkeypatch):
    """Its default N_d (2) exceeded the one device of a one-process run: it is now min(2, D)."""
    import datasets
    from transformers import AutoConfig

    from occult_hf.hf.finetune import main as finetune
    from tiny_models import save_tiny_tokenizer, tiny_sentences

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = save_tiny_tokenizer(tiny_checkpoint("olmoe", tmp_path / "model", seed=4, output_router_logits=False))
    datasets.Dataset.from_dict({"text": tiny_sentences(20, seed=1)}).to_json(tmp_path / "train.jsonl")
    assert finetune(["--model_name_or_path", str(model), "--train_file", str(tmp_path / "train.jsonl"), "--seq_len", "16",
                     "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "1",
                     "--output_dir", str(tmp_path / "out")]) == 0  # fmt: skip
    saved = AutoConfig.from_pretrained(tmp_path / "out").occult_config
    assert saved["prune"] == "router" and saved["max_devices_per_token"] == 1 and saved["num_devices"] == 1


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_case(name, request):
    check = CASES[name]
    check(**{fixture: request.getfixturevalue(fixture) for fixture in inspect.signature(check).parameters})


# ===== faults of the ranks: one 2-rank gloo world for every case ==================================================

#: the bounds in the world: long for waits the cases do not test, short for those they do, and all shorter than the
#: barriers' (the process group's) timeout, so that a case that waits too long fails alone, not the whole world
WORLD_ENV = {"OCCULT_SAVE_TIMEOUT_S": "20", "OCCULT_JOIN_TIMEOUT_S": "2", "OCCULT_TEST_COLLECTIVE_TIMEOUT_S": "60"}
EARLY_CHECK = "a rank that fails from_pretrained's early check"
LOAD_FAILS = "a rank whose from_pretrained fails reading its copy of the checkpoint"
USER_CODE = "a rank that fails in the user's code before apply_occult"
RANK0_SAVE = "save_pretrained on rank 0 only"
OTHER_CHECKPOINTS = "ranks that loaded different checkpoints"
OTHER_EXPERTS = "ranks whose checkpoints differ in the routed experts only"
OTHER_CHECKPOINTS_NATIVE = "ranks that loaded different checkpoints under transformers' EP (apply_occult_ep)"
EMPTY_ON_RANKS = "a placement that leaves a device without an expert, on 2 ranks"
SAME_CHECKPOINT = "one checkpoint at two paths"  # the control of the two above: it runs


def _outcome(call) -> dict:
    """What this rank saw: `{"error": type name or None, "message", "seconds"}`."""
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as raised:  # noqa: BLE001 - what each rank sees is the point
        error = raised
    return {"error": type(error).__name__ if error else None, "message": str(error) if error else "", "seconds": time.monotonic() - start}


def _world(rank, world_size, root):
    """Every multi-rank case in turn, separated by barriers; returns `{case: this rank's outcome}`."""
    import torch.distributed as dist

    from occult_hf import OccultConfig, Placement, apply_occult

    _install()
    seen = {}
    # rank 1's from_pretrained fails its early check of occult_config; rank 0 loads and reaches apply_occult
    config = OccultConfig() if rank == 0 else {"num_device": 2}
    seen[EARLY_CHECK] = _outcome(lambda: _load(f"{root}/seed0", occult_config=config))
    dist.barrier()

    # rank 1's copy of the checkpoint has a truncated weight file
    seen[LOAD_FAILS] = _outcome(lambda: _load(f"{root}/{('seed0', 'seed0_truncated')[rank]}", occult_config=OccultConfig()))
    dist.barrier()

    # rank 1 fails in the user's code before apply_occult and goes on to a barrier
    os.environ["OCCULT_SAVE_TIMEOUT_S"] = "2"
    if rank == 0:
        seen[USER_CODE] = _outcome(lambda: apply_occult(tiny_model("olmoe", seed=2), OccultConfig()))
    os.environ["OCCULT_SAVE_TIMEOUT_S"] = WORLD_ENV["OCCULT_SAVE_TIMEOUT_S"]
    dist.barrier()

    # `if rank == 0: model.save_pretrained(...)`; then both ranks save together
    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig())
    if rank == 0:
        seen[RANK0_SAVE] = _outcome(lambda: model.save_pretrained(f"{root}/rank0_only"))
    dist.barrier()
    model.save_pretrained(f"{root}/together")
    dist.barrier()

    placement = Placement(8, 2, {0: [1, 0, 0, 1, 1, 0, 1, 0], 1: [0, 1, 1, 0, 0, 1, 0, 1]})
    load = lambda name: _load(f"{root}/{name}", occult_config=OccultConfig(placement=placement))  # noqa: E731
    seen[OTHER_CHECKPOINTS] = _outcome(lambda: load(f"seed{rank}"))
    seen[OTHER_EXPERTS] = _outcome(lambda: load(("seed0", "seed0_other_experts")[rank]))
    seen[SAME_CHECKPOINT] = _outcome(lambda: load(("seed0", "seed0_copy")[rank])(tiny_batch(seed=rank)))
    seen[EMPTY_ON_RANKS] = _outcome(lambda: _load(f"{root}/seed0", occult_config=OccultConfig(placement=f"{root}/empty_device.json")))

    from occult_hf import apply_occult_ep
    from occult_hf.hf.native_ep import transformers_ep_available

    if transformers_ep_available():
        from transformers.distributed import DistributedConfig

        native = DistributedConfig(ep_implementation="occult", ep_size=2, fsdp_size=2)
        seen[OTHER_CHECKPOINTS_NATIVE] = _outcome(lambda: apply_occult_ep(_load(f"{root}/seed{rank}", distributed_config=native), OccultConfig()))
    return seen


def _raised(outcome: dict, error: str | None, *words) -> None:
    """The outcome is `error` (a type name) with a short message holding every one of `words`."""
    assert outcome["error"] == error and all(word in outcome["message"] for word in words), outcome
    assert len(outcome["message"]) < 2 * MAX_MESSAGE, len(outcome["message"])  # an agreement error lists each rank


@world_case(EARLY_CHECK)
def _(seen, root):
    _raised(seen[0], "EPConfigMismatchError", "rank 1 of the expert-parallel group failed at from_pretrained (ValueError: OccultConfig got unknown keys ['num_device']")
    _raised(seen[1], "ValueError", "OccultConfig got unknown keys ['num_device']")
    assert seen[0]["seconds"] < 10, seen[0]  # at once, not after OCCULT_SAVE_TIMEOUT_S (20 s here)


@world_case(LOAD_FAILS)
def _(seen, root):
    _raised(seen[0], "EPConfigMismatchError", "rank 1 of the expert-parallel group failed at from_pretrained (")
    assert seen[1]["error"] is not None and seen[1]["message"] in seen[0]["message"], seen
    assert seen[0]["seconds"] < 10, seen[0]  # at once, not after OCCULT_SAVE_TIMEOUT_S (20 s here)


@world_case(USER_CODE)
def _(seen, root):
    _raised(seen[0], "EPPeerError", "apply_occult on rank 0: EP ranks [1] did not reach it within 2 s (OCCULT_SAVE_TIMEOUT_S)")
    assert seen[0]["seconds"] < 10, seen[0]


@world_case(RANK0_SAVE)
def _(seen, root):
    _raised(seen[0], "EPPeerError", "save_pretrained on rank 0: EP ranks [1] did not reach it within 2 s (OCCULT_JOIN_TIMEOUT_S)")
    assert seen[0]["seconds"] < 10, seen[0]
    assert not os.path.exists(f"{root}/rank0_only/model.safetensors") and os.path.isfile(f"{root}/together/model.safetensors")


@world_case(OTHER_CHECKPOINTS)
def _(seen, root):
    for outcome in seen:
        _raised(outcome, "EPConfigMismatchError", "disagree at apply_occult on", "checkpoint (rank 0 'sha256:",
                "the replicated weights (they differ in ['lm_head.weight', 'model.embed_tokens.weight', ")  # fmt: skip


@world_case(OTHER_EXPERTS)
def _(seen, root):
    for outcome in seen:
        _raised(outcome, "EPConfigMismatchError", "checkpoint (rank 0 'sha256:")
        assert "replicated weights" not in outcome["message"], outcome


@world_case(OTHER_CHECKPOINTS_NATIVE)
def _(seen, root):
    if not seen:
        pytest.skip("transformers < 5.23 has no EPImplementationInterface")
    for outcome in seen:  # FSDP shards the dense weights: the checkpoints' identities differ
        _raised(outcome, "EPConfigMismatchError", "disagree at apply_occult_ep on", "checkpoint (rank 0 'sha256:")


@world_case(SAME_CHECKPOINT)
def _(seen, root):
    for outcome in seen:
        _raised(outcome, None)


@world_case(EMPTY_ON_RANKS)
def _(seen, root):
    for outcome in seen:
        _raised(outcome, "ValueError", f"{root}/empty_device.json", "layer 0 leaves devices [1] without an expert")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """`({case: [each rank's outcome]}, the world's directory)`, from one 2-rank world."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hostile_world")
    for name, seed in (("seed0", 0), ("seed1", 1), ("seed0_copy", 0), ("seed0_other_experts", 0), ("seed0_truncated", 0)):
        tiny_checkpoint("olmoe", root / name, seed=seed)
    truncated = root / "seed0_truncated" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    weights_file = root / "seed0_other_experts" / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:  # an experts-only fine-tune: every routed expert changed, nothing else
        if ".mlp.experts." in name:
            weights[name] += 1e-3
    save_file(weights, weights_file, metadata={"format": "pt"})
    (root / "empty_device.json").write_text(json.dumps(EMPTY_DEVICE))
    reports = run_world(_world, 2, str(root), env=WORLD_ENV, timeout_s=200)
    return {name: [report.get(name) for report in reports] for name in WORLD_CASES}, str(root)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(WORLD_CASES))
def test_hostile_multi_rank_case(name, world):
    outcomes, root = world
    WORLD_CASES[name]([outcome for outcome in outcomes[name] if outcome is not None], root)
