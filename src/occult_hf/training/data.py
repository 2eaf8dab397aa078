"""Corpus -> tokenizer -> packed token streams, through `datasets` and `tokenizers`.

A corpus directory holds one file per domain, the domain named by the file (`docs.txt` is domain `docs`):

- `<domain>.txt` or `<domain>.txt.gz`: UTF-8 text. By default (`separator=BLANK_LINE`) its documents are the
  blocks between blank lines; any other `separator` is a string that ends a document wherever it occurs (a
  corpus that separates documents by a line holding U+001E, the ASCII record separator: `separator="\x1e"`,
  `occult train --separator '\x1e'`). A text file that holds U+001E read with the blank-line
  default is an error that names it, not a corpus silently cut into paragraphs.
- `<domain>.jsonl` or `<domain>.jsonl.gz`: one document per line, a JSON object whose `text_field` (default
  `text`) is the document.

Other files in the directory (a README, say) are not read. `prepare_data` reads each file through `datasets`
(the `text` builder, `sample_by="document"`, or the `json` builder), splits it into documents, holds out the
**last** `heldout_fraction` of each domain's documents (files in a fixed shuffled order make this a random sample
that every run draws the same way), trains a byte-level BPE tokenizer with `tokenizers` on the training documents
only, and writes, per domain, the token stream of its training and held-out documents (each document followed by
`<eos>`) as `.npy`, plus the held-out documents' text as JSON lines (for the lm-eval tasks). Training,
perplexity and profiling read these files, so a machine without `datasets` (the GPU machine) trains from a
directory prepared elsewhere.

Files in a prepared directory:

    tokenizer/                 the tokenizer (`PreTrainedTokenizerFast.save_pretrained`)
    train_<domain>.npy         [N] uint16/uint32 token ids of the training documents
    heldout_<domain>.npy       [M] token ids of the held-out documents
    heldout_<domain>.jsonl     {"text": ...} per held-out document
    data.json                  documents, characters and tokens per split and domain; the settings, with each
                               corpus file's name, size and modification time

Shape legend (docs/conventions.md): N tokens of a stream, B windows (sequences), S sequence length.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..utils.checks import shown
from ..utils.dataset_errors import parsed
from ..utils.strict_json import parse_json, read_json_file

#: the default `separator`: documents are the blocks between blank lines
BLANK_LINE = "blank-line"
#: U+001E, the ASCII record separator: it separates the documents of the project's development corpora
RECORD_SEPARATOR = "\x1e"
#: corpus file suffixes -> the `datasets` builder that reads them
CORPUS_SUFFIXES = {".txt": "text", ".txt.gz": "text", ".jsonl": "json", ".jsonl.gz": "json"}
#: special tokens; their ids 0, 1, 2 are the model config's pad, bos and eos ids
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DATA_FORMAT = "occult_hf.training_data/1"
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


def is_datasets_available() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def _corpus_suffix(name: str) -> str | None:
    """The `CORPUS_SUFFIXES` entry `name` ends with (the longest), None for another file."""
    return next((s for s in sorted(CORPUS_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def corpus_files(corpus_dir: str | os.PathLike) -> dict[str, Path]:
    """`{domain: file}` of the corpus files in `corpus_dir` (`CORPUS_SUFFIXES`), in domain-name order."""
    root = Path(corpus_dir)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"corpus directory {os.fspath(corpus_dir)!r} is a file; give the directory that holds the corpus files")
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {os.fspath(corpus_dir)!r} does not exist")
    files: dict[str, Path] = {}
    for path in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        suffix = _corpus_suffix(path.name)
        if suffix is None:
            continue
        if not path.is_file():  # a pipe would hang the read; skipped, its domain would silently not train
            raise ValueError(f"corpus file {os.fspath(path)!r} is not a regular file (a directory, pipe or device?)")
        domain = path.name[: -len(suffix)]
        if domain in files:
            raise ValueError(f"corpus directory {os.fspath(corpus_dir)!r}: domain {domain!r} has two files, {files[domain].name} and {path.name}")
        files[domain] = path
    if not files:
        raise FileNotFoundError(
            f"corpus directory {os.fspath(corpus_dir)!r} holds no corpus file (one per domain: {', '.join('<domain>' + s for s in CORPUS_SUFFIXES)})"
        )
    return dict(sorted(files.items()))


def split_documents(text: str, separator: str = BLANK_LINE) -> list[str]:
    """Documents of one text file: the blocks between blank lines (`BLANK_LINE`), or the pieces between
    occurrences of `separator`; each without its surrounding line breaks, blank ones dropped. A leading byte-order
    mark (a file saved on Windows) is dropped, as the JSON Lines reader drops it: kept, it would open the first
    document and take a token of the vocabulary."""
    text = text.removeprefix("\ufeff")
    pieces = _BLANK_LINES.split(text) if separator == BLANK_LINE else text.split(separator)
    return [piece.strip("\n") for piece in pieces if piece.strip()]


def _read_domain(path: Path, separator: str, text_field: str, cache_dir):
    """One domain's documents: a `datasets.Dataset` with column `text`, one row per document."""
    from datasets import load_dataset

    if _reading(path, lambda: _is_empty(path)):
        raise ValueError(f"corpus file {os.fspath(path)!r} is empty")
    if CORPUS_SUFFIXES[_corpus_suffix(path.name)] == "json":
        records = _reading(path, lambda: load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir))
        if text_field not in records.column_names:
            raise ValueError(f"corpus file {os.fspath(path)!r} has no field {text_field!r} (its fields: {records.column_names}); set text_field")
        if records.features[text_field].dtype != "string":
            raise ValueError(f"corpus file {os.fspath(path)!r}: field {text_field!r} holds {records.features[text_field]}, not text")
        documents = records.select_columns([text_field])
        if text_field != "text":
            documents = documents.rename_column(text_field, "text")
        return _reading(path, lambda: documents.filter(lambda row: bool((row["text"] or "").strip())))  # decodes the text
    raw = _reading(path, lambda: load_dataset("text", data_files=str(path), split="train", sample_by="document", cache_dir=cache_dir))
    if separator == BLANK_LINE and any(RECORD_SEPARATOR in text for text in raw["text"]):
        raise ValueError(
            f"corpus file {os.fspath(path)!r} holds U+001E record separators but is read as blank-line blocks: "
            f"if they separate its documents (as in the project's corpora), pass separator '\\x1e' (occult train --separator '\\x1e')"
        )

    def to_documents(batch):
        return {"text": [doc for text in batch["text"] for doc in split_documents(text, separator)]}

    return raw.map(to_documents, batched=True, remove_columns=["text"], desc=f"splitting {path.name}")


def _reading(path: Path, read):
    """`read()`, a step that reads the corpus file `path`: a file that is not gzip, cut short, not UTF-8 or not JSON
    Lines is a `ValueError` naming it and the cause (`utils.dataset_errors.parsed`)."""
    return parsed(read, f"corpus file {os.fspath(path)!r}", also=(ValueError, EOFError, gzip.BadGzipFile, zlib.error))


def _is_empty(path: Path) -> bool:
    """Whether the file holds no bytes (a `.gz` one: none once decompressed); `datasets` reads an empty `.jsonl` with a
    bare `StopIteration`."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return not f.read(1)
    return path.stat().st_size == 0


def load_documents(
    corpus_dir: str | os.PathLike,
    domains: list[str] | None = None,
    *,
    separator: str = BLANK_LINE,
    text_field: str = "text",
    cache_dir: str | os.PathLike | None = None,
) -> dict:
    """`{domain: datasets.Dataset}` of `domains` (default: every corpus file) in `corpus_dir`, one row (column
    `text`) per document (module docstring)."""
    if not is_datasets_available():
        raise ImportError("preparing training data needs `datasets`: pip install 'occult_hf[eval]'")
    if not separator:
        raise ValueError("separator must be a non-empty string (or 'blank-line')")
    files = corpus_files(corpus_dir)
    missing = [d for d in domains or () if d not in files]
    if missing:
        raise FileNotFoundError(f"corpus directory {os.fspath(corpus_dir)!r} has no file for domain(s) {missing}; its domains: {list(files)}")
    cache = None if cache_dir is None else os.fspath(cache_dir)
    return {domain: _read_domain(files[domain], separator, text_field, cache) for domain in (domains or files)}


def split_heldout(documents, heldout_fraction: float, max_chars: int | None, domain: str = "a domain"):
    """(train, held_out) of one domain's documents: the last `ceil(n * fraction)` documents are held out;
    each part is cut to its first `max_chars` characters (whole documents, the last one truncated)."""
    _check_limit("max_chars", max_chars, "characters of each split")
    n = len(documents)
    held = max(1, math.ceil(n * heldout_fraction))
    if n - held < 1:
        raise ValueError(
            f"{domain} has {n} document(s), too few to split with heldout_fraction {heldout_fraction} "
            f"(are its documents separated as the separator says?)"
        )
    train, heldout = documents.select(range(n - held)), documents.select(range(n - held, n))
    if max_chars is not None:
        train, heldout = _first_chars(train, max_chars), _first_chars(heldout, max_chars)
    return train, heldout


def _first_chars(documents, max_chars: int):
    """The documents up to `max_chars` characters in all (whole documents, the last one truncated)."""
    from datasets import Dataset

    kept, total = [], 0
    for text in documents["text"]:
        if total >= max_chars:
            break
        kept.append(text[: max_chars - total])
        total += len(kept[-1])
    return Dataset.from_dict({"text": kept})


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts` (an iterable of strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2]
    )


def token_stream(documents, tokenizer) -> np.ndarray:
    """`[N]` token ids of `documents` (a dataset with column `text`), each followed by `<eos>`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token to end each document with (train_tokenizer's has one)")

    def encode(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"], verbose=False)["input_ids"]]}

    encoded = documents.map(encode, batched=True, remove_columns=documents.column_names, desc="tokenizing")
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    ids = encoded["input_ids"]
    return np.fromiter((i for doc in ids for i in doc), dtype=dtype) if len(ids) else np.zeros(0, dtype)


def prepare_data(
    corpus_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    vocab_size: int,
    heldout_fraction: float,
    max_chars_per_domain: int | None = None,
    domains: tuple[str, ...] | None = None,
    separator: str = BLANK_LINE,
    text_field: str = "text",
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Write the tokenizer and token streams of `domains` (default: every corpus file) in `corpus_dir` to
    `out_dir` (module docstring; `separator` and `text_field` as there).

    The tokenizer is trained on the training documents of every domain (never on held-out ones), so
    that a domain the model itself does not train on is still tokenized well.
    """
    from ..utils.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text

    _check_limit("max_chars_per_domain", max_chars_per_domain, "characters of each domain")
    # the corpus files as they are before the read: one edited during it differs from the record next time
    settings = preparation_settings(corpus_dir, vocab_size, heldout_fraction, max_chars_per_domain, separator, text_field)
    per_domain = load_documents(corpus_dir, None if domains is None else list(domains), separator=separator,
                                text_field=text_field, cache_dir=cache_dir)  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {d: split_heldout(docs, heldout_fraction, max_chars_per_domain, d) for d, docs in per_domain.items()}
    tokenizer = train_tokenizer((t for train, _ in splits.values() for t in train["text"]), vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    summary = {"format": DATA_FORMAT, "vocab_size": len(tokenizer), "settings": settings, "domains": {}}
    for domain, (train, heldout) in splits.items():
        row = {}
        for split, docs in (("train", train), ("heldout", heldout)):
            stream_N = token_stream(docs, tokenizer)
            buffer = io.BytesIO()
            np.save(buffer, stream_N)
            atomic_write_bytes(out / f"{split}_{domain}.npy", buffer.getvalue())
            row[split] = {"documents": len(docs), "chars": int(sum(len(t) for t in docs["text"])), "tokens": int(len(stream_N))}
        atomic_write_text(out / f"heldout_{domain}.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in heldout["text"]))
        summary["domains"][domain] = row
    atomic_write_json(out / "data.json", summary, indent=2)
    return out


def preparation_settings(corpus_dir, vocab_size, heldout_fraction, max_chars_per_domain, separator, text_field) -> dict:
    """The settings of a preparation, as `data.json` records them (`PreparedData.check_settings`); without a
    `corpus_dir` (a directory prepared elsewhere, its corpus not at hand) only the recipe's.

    The corpus is its directory and each corpus file's name, size and modification time (`corpus_file_stats`), so a
    file added, removed or edited since makes the prepared data stale without hashing gigabytes of text."""
    settings = {"vocab_size": vocab_size, "heldout_fraction": heldout_fraction, "max_chars_per_domain": max_chars_per_domain}
    if corpus_dir is not None:
        settings |= {"corpus_dir": os.path.realpath(corpus_dir), "separator": separator, "text_field": text_field,
                     "corpus_files": corpus_file_stats(corpus_dir)}  # fmt: skip
    return settings


def corpus_file_stats(corpus_dir: str | os.PathLike) -> dict[str, dict[str, int]]:
    """`{file name: {"size": bytes, "mtime_ns": modification time}}` of the corpus files in `corpus_dir`."""
    stats = {path.name: path.stat() for path in corpus_files(corpus_dir).values()}
    return {name: {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns} for name, stat in sorted(stats.items())}


def _corpus_change(recorded: dict | None, current: dict) -> str:
    """What differs between two `corpus_file_stats`, in words."""
    if not isinstance(recorded, dict):
        return "its corpus files are not recorded"
    added, removed = sorted(current.keys() - recorded.keys()), sorted(recorded.keys() - current.keys())
    modified = sorted(name for name in current.keys() & recorded.keys() if current[name] != recorded[name])
    changes = (("added", added), ("removed", removed), ("modified (size or modification time)", modified))
    return "corpus files changed since it was prepared: " + ", ".join(f"{what} {shown(names)}" for what, names in changes if names)


@dataclass
class PreparedData:
    """A directory written by `prepare_data`."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        meta = self.path / "data.json"
        if not meta.is_file():
            raise FileNotFoundError(f"{os.fspath(self.path)!r} is not a prepared data directory (no data.json)")
        self.meta = read_json_file(meta, "prepared data")
        _check_meta(self.meta, meta)

    def check_settings(self, settings: dict) -> None:
        """Raise unless this directory was prepared with `settings` (`preparation_settings`): a directory reused
        after a change of corpus, separator or vocabulary would silently train on the old data."""
        recorded = self.meta.get("settings")
        if recorded is None:
            raise ValueError(f"{os.fspath(self.path)!r} records no preparation settings: remove it to prepare it again")
        changed = [
            _corpus_change(recorded.get(key), value) if key == "corpus_files" else f"{key} {recorded.get(key)!r} (asked: {value!r})"
            for key, value in settings.items()
            if recorded.get(key) != value
        ]
        if changed:
            raise ValueError(
                f"{os.fspath(self.path)!r} was prepared with other settings: {'; '.join(changed)}. Remove it to prepare "
                f"it again, or give another --data-dir (or --out)"
            )

    @property
    def domains(self) -> list[str]:
        return list(self.meta["domains"])

    def tokenizer(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer")

    def stream(self, split: str, domain: str) -> np.ndarray:
        """`[N]` int64 token ids of one split (`train`, `heldout`) of one domain."""
        if domain not in self.meta["domains"]:
            raise KeyError(f"domain {domain!r} is not in {os.fspath(self.path)!r}; it has {self.domains}")
        return read_stream(self.path / f"{split}_{domain}.npy", self.meta["vocab_size"], self._recorded_tokens(split, domain))

    def _recorded_tokens(self, split: str, domain: str) -> int:
        """The length of a stream as `data.json` records it: a stream of another length is not the one prepared."""
        row = self.meta["domains"][domain]
        counts = row.get(split) if isinstance(row, dict) else None
        tokens = counts.get("tokens") if isinstance(counts, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            meta = os.fspath(self.path / "data.json")
            raise ValueError(f"prepared data {meta!r} records no token count for the {split} split of {domain}")
        return tokens

    def windows(self, split: str, domain: str, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
        """`[B, S]` non-overlapping windows of the stream (the remainder shorter than S dropped)."""
        return pack(self.stream(split, domain), seq_len, max_tokens)

    def heldout_texts(self, domain: str) -> list[str]:
        path = self.path / f"heldout_{domain}.jsonl"
        with open(path, encoding="utf-8") as f:
            return [parse_json(line, f"{os.fspath(path)!r} line {number}")["text"] for number, line in enumerate(f, 1)]


def _check_meta(meta, path: Path) -> None:
    """Raise unless `data.json` (`meta`, read from `path`) is an object of this format with the fields the streams are
    checked against: a hand-edited or foreign file would otherwise fail later in an error that does not name it."""
    label = f"prepared data {os.fspath(path)!r}"
    if not isinstance(meta, dict):
        raise ValueError(f"{label} is not a JSON object (it holds a {type(meta).__name__})")
    if meta.get("format") != DATA_FORMAT:
        raise ValueError(f"{label}: format {meta.get('format')!r} is not {DATA_FORMAT!r}")
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"{label}: vocab_size {vocab_size!r} is not a positive integer")
    if not isinstance(meta.get("domains"), dict):
        raise ValueError(f"{label}: domains is not a JSON object")


def read_stream(path: Path, vocab_size: int, tokens: int) -> np.ndarray:
    """`[N]` int64 token ids of the prepared stream `path`, checked to be what `prepare_data` wrote: a 1-D integer
    array of the `tokens` ids `data.json` records, each in `[0, vocab_size)`. A float array would be truncated to ids,
    and an id outside the vocabulary fails deep in the embedding without naming the file (the streams are copied
    between machines: docs/quality.md)."""
    label = f"prepared token stream {os.fspath(path)!r}"
    try:
        ids_N = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{label} does not exist: prepare the data again") from None
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"{label} is not a readable .npy file ({error}): prepare the data again") from None
    if not isinstance(ids_N, np.ndarray):
        raise ValueError(f"{label} is not a readable .npy file (it holds an archive of arrays): prepare the data again")
    if ids_N.ndim != 1:
        raise ValueError(f"{label} is a {ids_N.ndim}-D array of shape {ids_N.shape}, not a 1-D stream of token ids")
    if ids_N.dtype.kind not in "iu":
        raise ValueError(f"{label} holds {ids_N.dtype} values, not integer token ids")
    if len(ids_N) != tokens:
        raise ValueError(f"{label} holds {len(ids_N)} token ids; data.json records {tokens}")
    outside = ids_N[(ids_N < 0) | (ids_N >= vocab_size)]
    if len(outside):
        raise ValueError(f"{label} holds token id {outside[0]}, outside [0, {vocab_size}) (the vocabulary in data.json)")
    return ids_N.astype(np.int64)


def pack(stream_N: np.ndarray, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    """`[B, S]` consecutive windows of `stream_N` (B = N // S, or fewer under `max_tokens`: at least one window)."""
    _check_limit("max_tokens", max_tokens, "tokens")
    count = len(stream_N) // seq_len
    if max_tokens is not None:
        count = min(count, max(1, max_tokens // seq_len))
    if count == 0:
        raise ValueError(
            f"a stream of {len(stream_N)} tokens holds no window of seq_len {seq_len}: give the domain more text, or "
            f"train with a smaller seq_len"
        )
    return np.ascontiguousarray(stream_N[: count * seq_len].reshape(count, seq_len))


def _check_limit(name: str, value, what: str) -> None:
    """Raise unless `value` is None (no limit) or a positive integer: 0 or a negative limit would silently give empty
    token streams (found only when training packs them) or round up to a whole window."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be None (no limit) or a positive integer number of {what}, got {value!r}")
