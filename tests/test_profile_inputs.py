"""`occult profile` and the profile makers given inputs they cannot use: each case is an error that names the file,
the flag, the document or the layer at fault, never a raw library error, a silently ignored flag or a profile that
only fails later (`occult place`)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
from pathlib import Path

import numpy as np
import pytest

import occult_hf
from occult_hf.cli import main
from occult_hf.profile import RoutingProfile

TINY_OLMOE = Path(occult_hf.__file__).parent / "data" / "tiny_olmoe"  # E=32, top-4, 4 MoE layers, with its tokenizer


def refused(capsys, argv: list, *words: str) -> str:
    """Run `occult ARGV`: a usage error (exit 2) whose one last line names `words`, no traceback; returns that line."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in err and last.startswith("occult profile"), err
    for word in words:
        assert str(word) in last, (word, last)
    return last


@contextlib.contextmanager
def memory_growth_at_most(extra_bytes: int):
    """Inside, this process's data segment grows by at most `extra_bytes`: a trace that would make an enormous
    profile fails its allocation here instead of drawing the OOM killer onto the machine."""
    from occult_hf.utils.host_memory import data_segment_bytes

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_segment_bytes() + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def pair_count_trace(path: Path, freq_ZE: np.ndarray) -> Path:
    """A pair-count trace of top-2 tokens: each row of `freq_ZE` a layer, its tokens pairing experts (0, 1), (2, 3)..."""
    num_layers, num_experts = freq_ZE.shape
    coact_ZEE = np.zeros((num_layers, num_experts, num_experts), dtype=np.int64)
    for i in range(0, num_experts, 2):
        coact_ZEE[:, i, i + 1] = coact_ZEE[:, i + 1, i] = freq_ZE[:, i]
    np.savez(path, coact=coact_ZEE, freq=freq_ZE, meta=np.array(json.dumps({"top_k": 2})))
    return path


def _no_model_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before its inputs were checked")


# ----- traces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, words",
    [
        (np.array([[0, 1], [1, 2], [3, 9999]]), ["largest expert id is 9999", "5 distinct ids", "--num-experts"]),
        (np.array([[0, 2**40], [1, 2]]), [f"largest expert id is {2**40}", "--num-experts"]),
        (np.zeros((5, 0), dtype=np.int64), ["shape [5, 0]", "no expert per token (k = 0)"]),
        (np.zeros((5, 0, 2), dtype=np.int64), ["shape [5, 0, 2]", "no layer"]),
    ],
    ids=["stray id 9999", "id 2^40", "k = 0", "no layer"],
)
def test_trace_whose_ids_make_no_plausible_profile_is_refused(tmp_path, capsys, ids, words):
    """A stray large id made E = 10000 (an 800 MB profile of 3 tokens) or overflowed torch; k = 0 failed in numpy."""
    path = tmp_path / "t.npz"
    np.savez(path, topk_ids=ids)
    with memory_growth_at_most(2**30), pytest.raises(ValueError) as error:
        RoutingProfile.from_trace(path)
    assert str(path) in str(error.value) and all(w in str(error.value) for w in words), str(error.value)
    with memory_growth_at_most(2**30):
        refused(capsys, ["profile", "--from-trace", path, "--out", tmp_path / "p.safetensors"], path, *words)


def test_trace_expert_count_is_bounded_but_real_ones_pass(tmp_path):
    """E inferred past 1024 stands when most ids occur (a real model's trace); any E is refused before its E x E x layers
    counts are allocated when they would pass 8 GiB."""
    many = tmp_path / "many.npz"
    np.savez(many, topk_ids=np.arange(1200).reshape(600, 2))
    assert RoutingProfile.from_trace(many).num_experts == 1200
    stray = tmp_path / "stray.npz"
    np.savez(stray, topk_ids=np.array([[0, 1], [1, 2], [3, 9999]]))
    with memory_growth_at_most(2**30), pytest.raises(ValueError, match=r"E=40000 experts over 1 layer needs 11\.9 GiB .* past the 8 GiB limit"):
        RoutingProfile.from_trace(stray, num_experts=40_000)


def test_pair_count_trace_refuses_layer_sample_size_and_empty_layers(tmp_path, capsys):
    """--layer and --sample-size were ignored for pair counts; a valid layer without tokens made a profile `occult place`
    could not plan."""
    path = pair_count_trace(tmp_path / "pairs.npz", np.full((2, 4), 3, dtype=np.int64))
    assert RoutingProfile.from_trace(path).layer(1).token_count == 6
    for flag, value in (("--layer", "1"), ("--sample-size", "10")):
        refused(capsys, ["profile", "--from-trace", path, flag, value, "--out", tmp_path / "p.safetensors"],
                f"{flag} does not apply to {str(path)!r}, a pair-count trace")  # fmt: skip
    with pytest.raises(ValueError, match="not per-token expert ids: sample_size=10 does not apply"):
        RoutingProfile.from_trace(path, sample_size=10)
    empty = pair_count_trace(tmp_path / "empty.npz", np.array([[3, 3, 3, 3], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"pair-count trace '.*empty\.npz': layer 1 counts no tokens"):
        RoutingProfile.from_trace(empty)


# ----- data files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, data, words",
    [
        ("empty.jsonl", b"", "data file {path!r} is empty"),
        ("broken.jsonl", b'{"text": "hello"\n', "data file {path!r} cannot be read (ArrowInvalid: JSON parse error"),
        ("blank.jsonl", b"\n\n\n", "data file {path!r} cannot be read (ValueError: Instruction \"train\" corresponds to no data!)"),
        ("latin1.txt", b"hello \xff\xfe world\n",
         "data file {path!r} cannot be read (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
        ("latin1.jsonl", b'{"text": "hello \xff\xfe world"}\n',
         "text column 'text' of {path!r} cannot be read (In chunk 0: Invalid: Invalid UTF8 sequence"),
    ],
)
def test_dataset_file_that_cannot_be_parsed_is_named(tmp_path, capsys, monkeypatch, name, data, words):
    """Was `StopIteration()` and datasets' bare "An error occurred while generating the dataset", after the model
    loaded."""
    import transformers

    from occult_hf.hf.text_data import load_text_dataset

    path = tmp_path / name
    path.write_bytes(data)
    words = words.format(path=str(path))
    with pytest.raises(ValueError) as error:
        load_text_dataset(path)
    assert words in str(error.value), str(error.value)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_model_loading)
    with pytest.raises(SystemExit) as exit_:  # datasets logs the parser's error on stderr before the last line
        main(["profile", str(TINY_OLMOE), "--dataset", str(path), "--out", str(tmp_path / "p.safetensors")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and last.startswith(f"occult profile: error: {words}"), last


def test_a_local_data_path_that_does_not_exist_is_named_at_once(tmp_path):
    """A path without a data file's extension went to the Hub and ended, after 30 s of retries, in its connection
    error."""
    import time

    from occult_hf.hf.text_data import load_text_dataset

    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"data '.*/no_such_data' does not exist \(and it is not a Hub dataset name\)"):
        load_text_dataset(tmp_path / "no_such_data")
    assert time.monotonic() - start < 5


def test_text_file_that_is_no_utf8_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Was "'utf-8' codec can't decode byte 0xff ..." after the model loaded, naming no file; a directory was said not to
    exist."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_model_loading)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"hello \xff\xfe world\n")
    out = tmp_path / "p.safetensors"
    refused(capsys, ["profile", TINY_OLMOE, "--text", latin1, "--out", out], f"--text {str(latin1)!r} is not UTF-8: byte 6 (0xff)")
    refused(capsys, ["profile", TINY_OLMOE, "--text", tmp_path, "--out", out], f"--text {str(tmp_path)!r} is a directory")
    fifo = tmp_path / "pipe.txt"  # said not to exist
    os.mkfifo(fifo)
    refused(capsys, ["profile", TINY_OLMOE, "--text", fifo, "--out", out], f"--text {str(fifo)!r} is not a regular file")


def test_utf8_check_reads_in_chunks_and_counts_bytes_across_them(tmp_path):
    from occult_hf.utils.text_files import check_utf8

    path = tmp_path / "t.txt"
    path.write_bytes("abé€𝄞\n".encode() * 3)  # characters of 2, 3 and 4 bytes across 4-byte chunks
    check_utf8(str(path), "t.txt", chunk_bytes=4)
    path.write_bytes("abé€".encode() + b"x\xc3(")  # a 2-byte character cut by "(" at byte 8
    with pytest.raises(ValueError, match=r"is not UTF-8: byte 8 \(0xc3\) invalid continuation byte"):
        check_utf8(str(path), "t.txt", chunk_bytes=4)
    path.write_bytes("abcd€".encode()[:-1])  # the file ends inside a character that starts at byte 4
    with pytest.raises(ValueError, match=r"is not UTF-8: byte 4 \(0xe2\) unexpected end of data"):
        check_utf8(str(path), "t.txt", chunk_bytes=4)


def test_collect_names_a_text_file_that_is_no_utf8_file(tmp_path):
    from tiny_models import tiny_model

    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello \xff\xfe world\n")
    with pytest.raises(ValueError, match=rf"text file {str(path)!r} is not UTF-8: byte 6 \(0xff\) invalid start byte"):
        RoutingProfile.collect(tiny_model("olmoe"), path)


@pytest.mark.parametrize(
    "values, words",
    [
        ([[3, 4], None], "document 1 of column 'text' is None"),
        ([5], "document 0 of column 'text' is int 5"),
        ([[1.9, 2.7, 3.5]], "document 0 of column 'text' holds float 1.9 at position 0"),
        ([[True, False]], "document 0 of column 'text' holds bool True at position 0"),
    ],
    ids=["null", "a number", "floats", "a bool"],
)
def test_dataset_value_that_is_neither_text_nor_token_ids_is_named(values, words):
    """None and 5 failed as "'NoneType' object is not iterable"; floats were cut to other token ids without a word."""
    import datasets
    from tiny_models import tiny_model

    data = datasets.Dataset.from_dict({"text": values})
    with pytest.raises(ValueError, match="expected a string or a sequence of integer token ids") as error:
        RoutingProfile.collect(tiny_model("olmoe"), data)
    assert words in str(error.value), str(error.value)


def test_token_ids_may_be_numpy_integers():
    from tiny_models import tiny_model

    model = tiny_model("olmoe")
    as_lists = RoutingProfile.collect(model, [[5, 17, 9], [3, 4]], progress=False)
    as_arrays = RoutingProfile.collect(model, [np.array([5, 17, 9], dtype=np.int32), (np.int64(3), 4)], progress=False)
    np.testing.assert_array_equal(as_arrays.layer(0).coactivation, as_lists.layer(0).coactivation)


# ----- flags ----------------------------------------------------------------------------------------


def test_separator_decodes_backslash_escapes(tmp_path, capsys):
    """`--separator '\\x1e'` was taken as four characters (one document); `--separator ''` failed as "empty separator"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "records.txt"
    text.write_text("def f(x):\n    return x\x1eclass A:\n    pass\x1eimport os\n")
    out = tmp_path / "p.safetensors"
    assert main(["profile", str(TINY_OLMOE), "--text", str(text), "--separator", "\\x1e", "--out", str(out), "--no-progress"]) == 0
    model, tokenizer = AutoModelForCausalLM.from_pretrained(TINY_OLMOE), AutoTokenizer.from_pretrained(TINY_OLMOE)
    expected = RoutingProfile.collect(model, text, tokenizer, separator="\x1e", progress=False)
    profile = RoutingProfile.load(out)
    assert profile.layer(0).token_count == expected.layer(0).token_count
    np.testing.assert_array_equal(profile.layer(3).coactivation, expected.layer(3).coactivation)
    capsys.readouterr()
    refused(capsys, ["profile", TINY_OLMOE, "--text", text, "--separator", "", "--out", out],
            "argument --separator: the separator must not be empty")  # fmt: skip


def test_dtype_must_be_a_torch_dtype(tmp_path, capsys):
    """`--dtype nn` (an attribute of torch, not a dtype) failed as "cannot pickle 'module' object"."""
    text = tmp_path / "docs.txt"
    text.write_text("hello world\n")
    refused(capsys, ["profile", TINY_OLMOE, "--text", text, "--dtype", "nn", "--out", tmp_path / "p.safetensors"],
            "argument --dtype: expected 'auto' or a torch dtype name (float32, bfloat16, float16), got 'nn'")  # fmt: skip


@pytest.mark.parametrize(
    "source, flags, words",
    [
        ("text", ["--num-experts", "99"], "--num-experts does not apply with --text (only with --from-trace)"),
        ("text", ["--trace-key", "foo"], "--trace-key does not apply with --text"),
        ("text", ["--layer", "2"], "--layer does not apply with --text"),
        ("text", ["--model-type", "olmoe"], "--model-type does not apply with --text"),
        ("text", ["--split", "baz"], "--split does not apply with --text (only with --dataset)"),
        ("text", ["--dataset-config", "bar"], "--dataset-config does not apply with --text"),
        ("text", ["--text-column", "body"], "--text-column does not apply with --text"),
        ("dataset", ["--separator", ";"], "--separator does not apply with --dataset (only with --text)"),
        ("dataset", ["--num-experts", "99"], "--num-experts does not apply with --dataset"),
        ("trace", ["--max-tokens", "10"], "--max-tokens does not apply with --from-trace (only with --text and --dataset)"),
        ("trace", ["--device", "cpu"], "--device does not apply with --from-trace"),
        ("trace", ["--split", "test"], "--split does not apply with --from-trace"),
        ("trace", ["--trust-remote-code"], "--trust-remote-code does not apply with --from-trace"),
    ],
)
def test_options_that_cannot_apply_are_usage_errors(tmp_path, capsys, source, flags, words):
    """Each was ignored (exit 0): a profile of something other than what was asked for."""
    (tmp_path / "docs.txt").write_text("hello world\n")
    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n')
    np.savez(tmp_path / "t.npz", topk_ids=np.array([[0, 1], [2, 3]]))
    given = {
        "text": [TINY_OLMOE, "--text", tmp_path / "docs.txt"],
        "dataset": [TINY_OLMOE, "--dataset", tmp_path / "docs.jsonl"],
        "trace": ["--from-trace", tmp_path / "t.npz"],
    }[source]
    refused(capsys, ["profile", *given, *flags, "--out", tmp_path / "p.safetensors"], words)


# ----- layers without tokens or samples ---------------------------------------------------------------


def _edited(tmp_path: Path, edit) -> Path:
    """A profile file of 3 id-trace layers whose tensors `edit` changed."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from occult_hf.profile.routing_profile import PROFILE_METADATA_KEY

    trace = tmp_path / "t.npz"
    np.savez(trace, topk_ids=np.array([[[0, 1], [2, 3], [0, 2]], [[2, 3], [0, 1], [1, 3]]]))
    good = tmp_path / "good.safetensors"
    RoutingProfile.from_trace(trace).save(good)
    with safe_open(str(good), "np") as f:
        metadata = f.metadata()
    tensors = load_file(str(good))
    edit(tensors)
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path), metadata={PROFILE_METADATA_KEY: metadata[PROFILE_METADATA_KEY]})
    return path


def _no_tokens_at_layer_1(tensors):
    for name in ("coactivation", "expert_counts", "token_count"):
        tensors[f"layer.1.{name}"] = np.zeros_like(tensors[f"layer.1.{name}"])
    tensors["layer.1.topk_sample"] = np.zeros((0, 2), dtype=np.int64)


def _no_sample_rows_at_layer_2(tensors):
    tensors["layer.2.topk_sample"] = np.zeros((0, 2), dtype=np.int64)


def test_profile_layer_without_tokens_is_refused_at_load(tmp_path, capsys):
    """It loaded, and `occult place` then failed with "load_balance needs a positive total load" (no file, no layer)."""
    path = _edited(tmp_path, _no_tokens_at_layer_1)
    with pytest.raises(ValueError, match=rf"routing profile {str(path)!r}: layer 1 counts no tokens"):
        RoutingProfile.load(path)
    with pytest.raises(SystemExit) as exit_:
        main(["place", str(path), "--num-devices", "2", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"routing profile {str(path)!r}: layer 1 counts no tokens" in err, err


def test_profile_layer_without_sample_rows_is_refused_at_load(tmp_path):
    """One layer's empty sample turned exact CT off for every layer (`has_samples` is all layers or none)."""
    path = _edited(tmp_path, _no_sample_rows_at_layer_2)
    with pytest.raises(ValueError, match=rf"routing profile {str(path)!r}: layers \[2\] hold no top-k sample rows but layers \[0, 1\] do"):
        RoutingProfile.load(path)


def test_a_forward_that_raised_partway_counts_at_no_layer():
    """A forward that stopped inside the model (out of memory in a later layer) left its earlier layers' tokens counted:
    with later forwards the layers described different tokens (32 against 16), saved and planned on without a word."""
    import torch
    from tiny_models import tiny_model

    from occult_hf.patches import adapter_for
    from occult_hf.profile import ProfileCollector

    model = tiny_model("olmoe")
    blocks = list(adapter_for(model.config).iter_moe_blocks(model))
    last_block = blocks[-1][2]

    def stop(module, args):
        raise RuntimeError("out of memory")

    with ProfileCollector(model) as collector, torch.no_grad():
        handle = last_block.register_forward_pre_hook(stop)
        with pytest.raises(RuntimeError, match="out of memory"):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        handle.remove()
        with pytest.raises(ValueError, match="ProfileCollector has counted no tokens"):
            RoutingProfile.from_collector(collector)
        model(input_ids=torch.tensor([[4, 5]]))
    profile = RoutingProfile.from_collector(collector)
    assert {index: routing.token_count for index, routing in profile.layers.items()} == {index: 2 for index, _, _ in blocks}


def test_a_collector_whose_forwards_skipped_a_moe_layer_names_it():
    import torch
    from tiny_models import tiny_model

    from occult_hf.profile import ProfileCollector

    model = tiny_model("olmoe")
    last = model.model.layers[-1]
    with ProfileCollector(model) as collector, torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
        last.forward = lambda hidden_states, *args, **kwargs: hidden_states  # a forward that skips the last layer
        model(input_ids=torch.tensor([[4, 5]]))
    with pytest.raises(ValueError, match=r"counted 5 tokens at MoE layer 0 but \[3\] at layers \[1\]: its forwards did not run every MoE layer"):
        RoutingProfile.from_collector(collector)


def test_a_negative_sample_size_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_model_loading)
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    refused(capsys, ["profile", TINY_OLMOE, "--text", text, "--out", tmp_path / "p.safetensors", "--sample-size", "-3"], "--sample-size", "-3")


def test_a_padded_token_id_dataset_is_profiled_without_its_padding():
    """Its `attention_mask` column was ignored: the pad ids of a dataset padded to a fixed length were profiled as
    tokens (16 counted, 8 real)."""
    import datasets
    from tiny_models import tiny_model

    model = tiny_model("olmoe", seed=1)
    rows = [[5, 6, 7, 0, 0, 0, 0, 0], [0, 0, 9, 10, 11, 12, 13, 0]]
    padded = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[int(t != 0) for t in r] for r in rows]})
    plain = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [9, 10, 11, 12, 13]]})
    profiles = [RoutingProfile.collect(model, data, text_column="input_ids", progress=False) for data in (padded, plain)]
    for layer in profiles[1].layers:
        assert profiles[0].layer(layer).token_count == 8
        assert np.array_equal(profiles[0].layer(layer).expert_counts, profiles[1].layer(layer).expert_counts)
        assert np.array_equal(profiles[0].layer(layer).coactivation, profiles[1].layer(layer).coactivation)
    short_mask = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1]]})
    with pytest.raises(ValueError, match="row 0: column 'input_ids' holds 3 token ids but 'attention_mask' 2 entries"):
        RoutingProfile.collect(model, short_mask, text_column="input_ids", progress=False)


def test_a_training_only_collector_leaves_forwards_it_does_not_count_alone():
    """`OccultCallback`'s drift window (`training_only=True`) checked the mask of every forward first: an evaluation
    with a 4-D mask, which stock transformers takes, failed inside the Trainer."""
    import torch
    from tiny_models import tiny_model

    from occult_hf.profile import ProfileCollector

    model = tiny_model("olmoe", seed=1, output_router_logits=False).eval()  # the aux loss itself takes only 2-D masks
    ids = torch.randint(3, 100, (1, 6))
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with ProfileCollector(model, training_only=True) as collector:
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
    assert collector.accumulators[0].token_count == 0
    with ProfileCollector(model) as counting, pytest.raises(ValueError, match="needs a 2-D \\[batch, seq\\] attention_mask"):
        model(input_ids=ids, attention_mask=mask)  # a forward it counts still needs the 2-D mask
    assert counting.accumulators[0].token_count == 0
