"""Corpus -> tokenizer -> packed token streams, through `datasets` and `tokenizers`.

A corpus directory holds one file per domain, `<domain>.txt.gz` (or `.txt`): UTF-8 text whose
documents are separated by a line holding the single character U+001E (the layout of the project's
development corpora). `prepare_data` reads each file with the `datasets` `text` builder
(`sample_by="document"`), splits it into documents, holds out the **last** `heldout_fraction` of each
domain's documents (the files are in a fixed shuffled order, so this is a random sample that every
run draws the same way), trains a byte-level BPE tokenizer with `tokenizers` on the training
documents only, and writes, per domain, the token stream of its training and held-out documents
(each document followed by `<eos>`) as `.npy`, plus the held-out documents' text as JSON lines (for
the lm-eval tasks). Training, perplexity and profiling read these files, so a machine without
`datasets` (the GPU machine) trains from a directory prepared elsewhere.

Files in a prepared directory:

    tokenizer/                 the tokenizer (`PreTrainedTokenizerFast.save_pretrained`)
    train_<domain>.npy         [N] uint16/uint32 token ids of the training documents
    heldout_<domain>.npy       [M] token ids of the held-out documents
    heldout_<domain>.jsonl     {"text": ...} per held-out document
    data.json                  documents, characters and tokens per split and domain; the settings

Shape legend (docs/conventions.md): N tokens of a stream, B windows (sequences), S sequence length.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..utils.strict_json import parse_json, read_json_file

#: the document separator of the corpus files: a line holding U+001E
SEPARATOR = "\x1e"
#: special tokens; their ids 0, 1, 2 are the model config's pad, bos and eos ids
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DATA_FORMAT = "occult_hf.training_data/1"


def is_datasets_available() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def corpus_file(corpus_dir: str | os.PathLike, domain: str) -> Path:
    """The file of `domain` in `corpus_dir` (`.txt.gz` or `.txt`)."""
    for suffix in (".txt.gz", ".txt"):
        path = Path(corpus_dir) / f"{domain}{suffix}"
        if path.is_file():
            return path
    raise FileNotFoundError(f"corpus directory {os.fspath(corpus_dir)!r} has no {domain}.txt.gz or {domain}.txt")


def split_documents(text: str) -> list[str]:
    """Documents of one corpus file: split on lines holding U+001E, blank documents dropped."""
    return [doc.strip("\n") for doc in text.split(f"\n{SEPARATOR}\n") if doc.strip()]


def load_documents(corpus_dir: str | os.PathLike, domains: list[str], cache_dir: str | os.PathLike | None = None):
    """A `datasets.DatasetDict` with one split per domain, one row (column `text`) per document."""
    if not is_datasets_available():
        raise ImportError("preparing training data needs `datasets`: pip install 'occult_hf[eval]'")
    from datasets import load_dataset

    files = {domain: str(corpus_file(corpus_dir, domain)) for domain in domains}
    raw = load_dataset("text", data_files=files, sample_by="document", cache_dir=cache_dir)

    def to_documents(batch):
        return {"text": [doc for text in batch["text"] for doc in split_documents(text)]}

    return raw.map(to_documents, batched=True, remove_columns=["text"], desc="splitting documents")


def split_heldout(documents, heldout_fraction: float, max_chars: int | None):
    """(train, held_out) of one domain's documents: the last `ceil(n * fraction)` documents are held out;
    each part is cut to its first `max_chars` characters (whole documents, the last one truncated)."""
    n = len(documents)
    held = max(1, math.ceil(n * heldout_fraction))
    if n - held < 1:
        raise ValueError(f"a domain with {n} document(s) cannot be split with heldout_fraction {heldout_fraction}")
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
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Write the tokenizer and token streams of every domain in `corpus_dir` to `out_dir` (module docstring).

    The tokenizer is trained on the training documents of every domain (never on held-out ones), so
    that a domain the model itself does not train on is still tokenized well.
    """
    from ..utils.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
    from .recipes import DOMAINS

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not Path(corpus_dir).is_dir():
        raise FileNotFoundError(f"corpus directory {os.fspath(corpus_dir)!r} does not exist")
    if domains is None:
        domains = tuple(d for d in DOMAINS if any((Path(corpus_dir) / f"{d}{s}").is_file() for s in (".txt.gz", ".txt")))
        if not domains:
            raise FileNotFoundError(f"corpus directory {os.fspath(corpus_dir)!r} holds none of {[d + '.txt.gz' for d in DOMAINS]}")
    per_domain = load_documents(corpus_dir, list(domains), cache_dir=cache_dir)
    splits = {d: split_heldout(per_domain[d], heldout_fraction, max_chars_per_domain) for d in domains}
    tokenizer = train_tokenizer((t for d in domains for t in splits[d][0]["text"]), vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    summary = {"format": DATA_FORMAT, "corpus_dir": os.path.abspath(corpus_dir), "vocab_size": len(tokenizer),
               "heldout_fraction": heldout_fraction, "max_chars_per_domain": max_chars_per_domain, "domains": {}}  # fmt: skip
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
        if self.meta.get("format") != DATA_FORMAT:
            raise ValueError(f"{meta}: format {self.meta.get('format')!r} is not {DATA_FORMAT!r}")

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
        return np.load(self.path / f"{split}_{domain}.npy").astype(np.int64)

    def windows(self, split: str, domain: str, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
        """`[B, S]` non-overlapping windows of the stream (the remainder shorter than S dropped)."""
        return pack(self.stream(split, domain), seq_len, max_tokens)

    def heldout_texts(self, domain: str) -> list[str]:
        path = self.path / f"heldout_{domain}.jsonl"
        with open(path, encoding="utf-8") as f:
            return [parse_json(line, f"{os.fspath(path)!r} line {number}")["text"] for number, line in enumerate(f, 1)]


def pack(stream_N: np.ndarray, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    """`[B, S]` consecutive windows of `stream_N` (B = N // S, or fewer under `max_tokens`)."""
    count = len(stream_N) // seq_len
    if max_tokens is not None:
        count = min(count, max(1, max_tokens // seq_len))
    if count == 0:
        raise ValueError(f"a stream of {len(stream_N)} tokens holds no window of seq_len {seq_len}")
    return np.ascontiguousarray(stream_N[: count * seq_len].reshape(count, seq_len))
