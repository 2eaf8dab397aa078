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
from occult_hf.utils.atomic import atomic_write_text, json_text, to_json_native

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
    ("typo in a key", _placement(num_device=2), "$ has unknown keys ['num_device'] (did you mean 'num_devices'?)"),
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


def test_a_placement_that_does_not_fit_names_its_file_and_what_it_was_checked_against(tmp_path):
    """A loaded placement's fit errors name its file, wherever they are raised (apply_occult, occult eval,
    occult report); measured on a profile, the error speaks of the routing profile, not of a model."""
    from occult_hf.metrics import evaluate_placement
    from occult_hf.profile import RoutingProfile

    path = tmp_path / "occult_placement.json"
    Placement.from_dict(GOOD_PLACEMENT).save(path)
    placement = Placement.load(path)
    with pytest.raises(ValueError, match=re.escape(f"placement {str(path)!r} is for num_experts=4 but the model has 8")):
        placement.validate_for(8, [0, 1])
    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=np.stack([np.arange(8) % 8, (np.arange(8) + 1) % 8], axis=1))
    with pytest.raises(ValueError, match=re.escape(f"placement {str(path)!r} is for num_experts=4 but the routing profile has 8")):
        evaluate_placement(RoutingProfile.from_trace(trace), placement)
    with pytest.raises(ValueError, match=re.escape("placement is for num_experts=4 but the model has 8")):
        Placement.from_dict(GOOD_PLACEMENT).validate_for(8, [0, 1])  # built in memory: no file to name


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_devices": True}, ValueError, "num_devices must be a positive integer, got True"),
        ({"num_devices": 2.0}, ValueError, "num_devices must be a positive integer, got 2.0"),
        ({"prune": "router", "max_devices_per_token": True}, ValueError, "max_devices_per_token must be an integer >= 1 or None, got True"),
        ({"deterministic": "no"}, TypeError, "OccultConfig.deterministic must be True or False, got str 'no'"),
        ({"deterministic": 1}, TypeError, "OccultConfig.deterministic must be True or False"),
        ({"profile": 3}, TypeError, "OccultConfig.profile must be None or a path"),
        ({"placement": {"num_experts": 4, "num_devices": 2.0, "layers": {"0": [0, 0, 1, 1]}}}, ValueError,
         "$.num_devices must be an integer, got float 2.0"),
        ({"dispatcher": "hierarchical", "dispatch_chunks": 2}, ValueError,
         "OccultConfig.dispatch_chunks=2 needs a dispatcher that overlaps chunks (['all_to_all']); "
         "dispatcher='hierarchical' runs one chunk"),
        ({"dispatcher": "padded", "dispatch_chunks": 4}, ValueError, "dispatcher='padded' runs one chunk"),
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


def test_json_readers_refuse_what_is_not_a_regular_file(tmp_path):
    """`OccultConfig.load` blocked forever on a FIFO, and gave a bare OSError for a directory or a symlink loop."""
    import os

    fifo, loop = tmp_path / "fifo.json", tmp_path / "loop.json"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    for path in (fifo, loop, tmp_path):
        with pytest.raises(FileNotFoundError, match=re.escape(f"occult_config {str(path)!r} is not a file")):
            OccultConfig.load(path)



@pytest.mark.parametrize("text, message", [
    ("[[0, 1]]", "must hold an object {layer: [expert ids]}, got list"),
    ('{"a": [0, 1]}', "entry 'a': [0, 1] is not a layer number with a list of expert ids"),
    ('{"0": [0, "1"]}', "entry '0': [0, '1'] is not a layer number"),
])  # fmt: skip
def test_a_damaged_expert_order_beside_a_native_ep_optimizer_is_named(tmp_path, text, message):
    """A damaged `occult_expert_order.json` gave a bare AttributeError or int() ValueError naming no file."""
    from occult_hf.hf.native_ep import EXPERT_ORDER_FILE, load_optimizer

    (tmp_path / EXPERT_ORDER_FILE).write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"expert order {str(tmp_path / EXPERT_ORDER_FILE)!r}") + ".*" + re.escape(message)):
        load_optimizer(None, None, tmp_path)


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
    from occult_hf.utils.atomic import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write("{")  # half a file
        raise RuntimeError("disk full")


# ----- the command line: one line naming the file, exit code 2, no traceback ---------------------

PROFILE_TRACE = {"topk_ids": np.array([[0, 1], [2, 3], [1, 2]], dtype=np.int64)}


def _write_inputs(tmp_path):
    """The bad files the command-line cases point at, by name."""
    files = {
        "empty.safetensors": b"",
        "garbage.safetensors": b"\x13\x00\x00\x00\x00\x00\x00\x00{not a header at all",
        "corrupt.npz": b"PK\x03\x04 this zip is cut short",
        "existing_file": b"x",
        "bad_placement.json": json.dumps(_placement(num_devices=2.7)).encode(),
        "docs.txt": b"hello world\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    np.savez(tmp_path / "negative.npz", topk_ids=-np.ones((4, 2), dtype=np.int64))
    np.savez(tmp_path / "good.npz", **PROFILE_TRACE)
    from occult_hf.profile import RoutingProfile

    RoutingProfile.from_trace(tmp_path / "good.npz").save(tmp_path / "good.safetensors")


# (what the user did, argv with {tmp} for the temporary directory, words the one line must contain)
CLI_CASES = [
    ("profile from an empty .safetensors", ["place", "{tmp}/empty.safetensors", "--num-devices", "2", "--out", "{tmp}/p.json"],
     "{tmp}/empty.safetensors"),
    ("garbage .safetensors profile", ["report", "{tmp}/garbage.safetensors", "--num-devices", "2", "--no-plots"],
     "{tmp}/garbage.safetensors"),
    ("corrupt .npz trace", ["profile", "--from-trace", "{tmp}/corrupt.npz", "--out", "{tmp}/p.safetensors"],
     "{tmp}/corrupt.npz"),
    ("trace whose ids are all negative", ["profile", "--from-trace", "{tmp}/negative.npz", "--out", "{tmp}/p.safetensors"],
     "{tmp}/negative.npz"),
    ("negative --layer", ["profile", "--from-trace", "{tmp}/good.npz", "--layer", "-3", "--out", "{tmp}/p.safetensors"],
     "layer"),
    ("--out in a missing directory, before the run",
     ["profile", "{tmp}", "--text", "{tmp}/docs.txt", "--out", "{tmp}/missing/p.safetensors"], "{tmp}/missing"),
    ("a model directory that does not exist",
     ["profile", "{tmp}/no_such_model", "--text", "{tmp}/docs.txt", "--out", "{tmp}/p.safetensors"],
     "{tmp}/no_such_model"),
    ("demo --out at an existing file", ["demo", "--out", "{tmp}/existing_file"], "{tmp}/existing_file"),
    ("placement with a float device count", ["report", "{tmp}/good.safetensors", "{tmp}/bad_placement.json", "--no-plots"],
     "$.num_devices must be an integer"),
    ("bench ep --tokens 0", ["bench", "ep", "--tokens", "0"], "--tokens"),
    ("--device that is no torch device, said once and before the model loads",
     ["profile", "{tmp}", "--text", "{tmp}/docs.txt", "--device", "gpu0", "--out", "{tmp}/p.safetensors"],
     "occult profile: error: --device 'gpu0' is not a torch device"),
    ("demo --tokens 0, before the model loads", ["demo", "--tokens", "0", "--out", "{tmp}/demo"], "--tokens"),
    ("--text naming a missing .jsonl", ["profile", "{tmp}", "--text", "{tmp}/absent.jsonl", "--out", "{tmp}/p.safetensors"],
     "{tmp}/absent.jsonl' does not exist"),
    ("profile with MODEL and --from-trace", ["profile", "{tmp}", "--from-trace", "{tmp}/good.npz", "--out", "{tmp}/p.safetensors"],
     "give MODEL or --from-trace, not both"),
]


@pytest.mark.parametrize("case, argv, words", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_command_line_bad_inputs(tmp_path, capsys, case, argv, words):
    from occult_hf.cli import main

    _write_inputs(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, (case, err)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("occult "), (case, err)  # argparse adds a usage line
    assert words.replace("{tmp}", str(tmp_path)) in lines[-1], (case, lines[-1])


def test_debug_shows_the_traceback(tmp_path, capsys):
    from occult_hf.cli import main

    _write_inputs(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "good.safetensors"), str(tmp_path / "bad_placement.json"), "--no-plots", "--debug"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback (most recent call last)" in err and "$.num_devices" in err


# ----- remote code ---------------------------------------------------------------------------------


def test_a_config_auto_map_never_runs_remote_code(tmp_path):
    """`RoutingProfile.load(path, model=config)` builds a skeleton of the config's model; a checkpoint's
    `auto_map` must not make that import the checkpoint's own Python."""
    import transformers

    from occult_hf.profile import RoutingProfile
    from tiny_models import tiny_config

    marker = tmp_path / "REMOTE_CODE_RAN"
    checkpoint = tmp_path / "checkpoint"
    config = tiny_config("olmoe")
    config.auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    config.save_pretrained(checkpoint)
    (checkpoint / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import OlmoeConfig as EvilConfig, OlmoeForCausalLM as EvilModel\n"
    )
    loaded = transformers.AutoConfig.from_pretrained(checkpoint)  # the native class: no code runs here
    assert loaded.auto_map and not marker.exists()

    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=np.stack([np.arange(8) % 8, (np.arange(8) + 1) % 8], axis=1))
    profile_path = tmp_path / "profile.safetensors"
    profile = RoutingProfile.from_trace(trace)
    profile.layers = {0: profile.layers[0], 1: profile.layers[0]}  # the tiny OLMoE's two MoE layers
    profile.save(profile_path)
    RoutingProfile.load(profile_path, model=loaded)
    assert not marker.exists(), "occult_hf ran a checkpoint's remote code without trust_remote_code"


def test_similarity_profile_with_extra_layers_is_rejected_by_apply_occult(tmp_path):
    from occult_hf.hf.apply import apply_occult
    from occult_hf.profile import LayerRouting, RoutingProfile
    from tiny_models import tiny_model

    def layer():  # 4 tokens routed to experts (0, 1), (2, 3), (4, 5), (6, 7)
        coactivation = np.kron(np.eye(4, dtype=np.int64), np.array([[0, 1], [1, 0]], dtype=np.int64))
        return LayerRouting(coactivation, np.ones(8, dtype=np.int64), 4, logit_gram=np.eye(8))

    path = tmp_path / "similarity.safetensors"
    RoutingProfile(8, 2, {0: layer(), 1: layer(), 5: layer()}, model_type="olmoe").save(path)
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=re.escape(f"routing profile {str(path)!r} has layers [5] that are not MoE layers of the model")):
        apply_occult(model, OccultConfig(prune="similarity", max_devices_per_token=1, num_devices=2, profile=str(path)))
    assert not hasattr(model.config, "occult_config")  # the model is left as it was


def test_every_file_the_package_writes_goes_through_occult_hf_atomic():
    """A source scan: direct writers (`open(..., "w")`, `.write_text`, `savefig`, `json.dump`, `np.savez`,
    safetensors' `save_file`, `torch.save`) appear only in `occult_hf/utils/atomic.py` or where the code writes a
    temporary file and renames it itself (listed here with the reason)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {
        "src/occult_hf/utils/atomic.py": "the atomic writers themselves",
        "src/occult_hf/benchmarks/hf_ep_load.py": "writes /proc/self/clear_refs, a kernel control file, not an output",
        "eval/studies/tiny_routing.py": "np.savez into an in-memory buffer that atomic_write_bytes writes",
    }
    writer = re.compile(r"""open\([^)]*["'][wax]b?["']|\.write_text\(|\.write_bytes\(|\.savefig\(|json\.dump\(|np\.savez|"""
                        r"""\bsave_file\(|torch\.save\(""")
    offenders = []
    for folder in ("src/occult_hf", "eval", "patches", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative in allowed:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if writer.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "write these through occult_hf.utils.atomic:\n" + "\n".join(offenders)
