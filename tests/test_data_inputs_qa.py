"""Hostile text inputs of profiling and training (`utils.text_files`, `hf.text_data`, `training.data`): a file saved on
Windows reads as the same text, a pipe or device is refused before it is opened, a text column that holds no text
fails before the model loads, and a limit of 0 or less is an error, not an empty or rounded-up stream."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

import occult_hf

TINY_OLMOE = Path(occult_hf.__file__).parent / "data" / "tiny_olmoe"  # with its BPE tokenizer (no BOS added)
DOCUMENTS = ["def f(x):\n    return x + 1", "Routing profiles count tokens.", "A third document, longer than the others."]
BOM = b"\xef\xbb\xbf"


def windows_file(path: Path, text: str) -> Path:
    """`text` as a file saved on Windows: a byte-order mark and "\r\n" line ends."""
    path.write_bytes(BOM + text.replace("\n", "\r\n").encode("utf-8"))
    return path


def test_read_utf8_reads_a_windows_file_as_python_text_mode(tmp_path):
    from occult_hf.utils.text_files import read_utf8

    path = tmp_path / "w.txt"
    path.write_bytes(BOM + b"one\r\ntwo\rthree\n")
    with open(path, encoding="utf-8-sig") as f:  # Python's universal newlines, the reference
        assert read_utf8(str(path), "x") == f.read() == "one\ntwo\nthree\n"


def test_profile_of_a_windows_text_file_counts_the_same_tokens(tmp_path):
    """`RoutingProfile.collect` on a text file (`occult profile --text`): the tokens profiled are the documents' own,
    counted independently with the tokenizer, whether the file has "\r\n" line ends and a byte-order mark or not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from occult_hf.profile import RoutingProfile

    text = "\n".join(line for doc in DOCUMENTS for line in doc.split("\n")) + "\n"
    unix = tmp_path / "unix.txt"
    unix.write_text(text, encoding="utf-8")
    windows = windows_file(tmp_path / "windows.txt", text)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(TINY_OLMOE), AutoTokenizer.from_pretrained(TINY_OLMOE)
    expected = sum(len(tokenizer(line)["input_ids"]) for line in text.split("\n") if line.strip())
    counts = {}
    for path in (unix, windows):
        profile = RoutingProfile.collect(model, str(path), tokenizer, max_length=16, progress=False)
        counts[path.name] = {record.token_count for record in profile.layers.values()}
    assert counts == {"unix.txt": {expected}, "windows.txt": {expected}}


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_load_text_dataset_drops_the_byte_order_mark(tmp_path, suffix):
    from occult_hf.hf.text_data import load_text_dataset

    raw = BOM + "first line\r\nsecond line\r\n".encode("utf-8")
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    assert load_text_dataset(str(path))["text"][:] == ["first line", "second line"]


def test_load_text_dataset_refuses_a_pipe_or_a_device(tmp_path):
    from occult_hf.hf.text_data import load_text_dataset

    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)  # opening it would wait for a writer
    for path in (str(fifo), "/dev/zero", "/dev/null"):
        with pytest.raises(ValueError, match="is not a regular file"):
            load_text_dataset(path)


@pytest.mark.parametrize(
    "rows, holds",
    [
        ([{"text": 1}, {"text": 2}], "int64"),
        ([{"text": {"a": 1}}], "'a'"),
        ([{"text": ["a", "b"]}], "List"),
    ],
)
def test_load_text_dataset_refuses_a_column_without_text(tmp_path, rows, holds):
    """A column of numbers, records or lists of strings would fail only in `collect_routing`, after the model loaded."""
    from occult_hf.hf.text_data import load_text_dataset

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=f"holds .*{holds}.*not text or token-id lists"):
        load_text_dataset(str(path))


def test_load_text_dataset_refuses_null_rows_and_keeps_token_ids(tmp_path):
    from occult_hf.hf.text_data import load_text_dataset

    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": "a"}\n{"text": null}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"null \(no value\) in 2 row\(s\), the first of them row 1"):
        load_text_dataset(str(nulls))
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"text": [1, 2, 3]}\n')
    assert load_text_dataset(str(ids))["text"][:] == [[1, 2, 3]]


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_corpus_file_that_is_not_a_regular_file_is_an_error(tmp_path, kind):
    """Skipped, the domain would silently not be trained on."""
    from occult_hf.training.data import corpus_files

    (tmp_path / "docs.txt").write_text("one\n\ntwo\n")
    odd = tmp_path / "code.txt"
    {"fifo": os.mkfifo, "directory": os.mkdir, "device": lambda p: os.symlink("/dev/zero", p)}[kind](odd)
    with pytest.raises(ValueError, match="code.txt' is not a regular file"):
        corpus_files(tmp_path)


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_prepared_corpus_of_a_windows_file_is_the_same(tmp_path, suffix):
    """The same documents and token streams as the file saved without a byte-order mark and with "\n" line ends."""
    from occult_hf.training.data import PreparedData, prepare_data

    text = "\n\n".join(DOCUMENTS * 4) + "\n"
    streams = {}
    for name, raw in (("unix", text.encode("utf-8")), ("windows", BOM + text.replace("\n", "\r\n").encode("utf-8"))):
        corpus = tmp_path / name
        corpus.mkdir()
        (corpus / f"docs{suffix}").write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
        out = prepare_data(corpus, tmp_path / f"{name}_data", vocab_size=300, heldout_fraction=0.25,
                           cache_dir=tmp_path / "cache")  # fmt: skip
        data = PreparedData(out)
        streams[name] = (data.meta["domains"], data.stream("train", "docs").tolist(), data.heldout_texts("docs"))
    assert streams["windows"] == streams["unix"]
    assert streams["unix"][2] == DOCUMENTS  # the last 3 of the 12 documents held out


@pytest.mark.parametrize("limit", [0, -5, True, 2.5])
def test_limits_below_one_are_errors(tmp_path, limit):
    from occult_hf.training.data import pack, prepare_data

    with pytest.raises(ValueError, match="max_tokens must be None .* or a positive integer"):
        pack(np.arange(100), 10, max_tokens=limit)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.txt").write_text("\n\n".join(DOCUMENTS * 4))
    with pytest.raises(ValueError, match="max_chars_per_domain must be None .* or a positive integer"):
        prepare_data(corpus, tmp_path / "data", vocab_size=300, heldout_fraction=0.25, max_chars_per_domain=limit)
    assert not (tmp_path / "data").exists()


def test_pack_counts_windows_within_max_tokens():
    from occult_hf.training.data import pack

    stream_N = np.arange(100)
    assert pack(stream_N, 10, max_tokens=35).tolist() == stream_N[:30].reshape(3, 10).tolist()
    assert pack(stream_N, 10, max_tokens=5).shape == (1, 10)  # at least one window
    assert pack(stream_N, 10).shape == (10, 10)
    with pytest.raises(ValueError, match="holds no window of seq_len 128: give the domain more text, or train with"):
        pack(stream_N, 128)


def test_token_stream_needs_an_eos_token():
    from datasets import Dataset
    from transformers import AutoTokenizer

    from occult_hf.training.data import token_stream

    tokenizer = AutoTokenizer.from_pretrained(TINY_OLMOE)
    documents = Dataset.from_dict({"text": DOCUMENTS})
    stream_N = token_stream(documents, tokenizer)
    assert stream_N.tolist() == [i for doc in DOCUMENTS for i in tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]]
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token"):
        token_stream(documents, tokenizer)
