"""A generated three-domain corpus in the layout of the project's corpora (`<domain>.txt.gz`, documents separated by
a line holding U+001E: read with `separator=RECORD_SEPARATOR`), small and deterministic, for the training and study
tests."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

from occult_hf.training.data import RECORD_SEPARATOR

VOCABS = {
    "python_docs": "the function returns a list of values when called with an argument see also module class".split(),
    "python_stdlib_code": "def return self if else for in import from class None True False raise yield lambda".split(),
    "kernel_docs": "the driver registers a device interrupt memory page kernel module bus clock power".split(),
}


def write_corpus(directory: Path, docs: int = 24, seed: int = 0, lines: tuple[int, int] = (3, 8)) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for domain, words in VOCABS.items():
        documents = []
        for d in range(docs):
            text = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) for _ in range(rng.randint(*lines))]
            documents.append(f"{domain} document {d}\n" + "\n".join(text))
        with gzip.open(directory / f"{domain}.txt.gz", "wt", encoding="utf-8") as f:
            f.write(f"\n{RECORD_SEPARATOR}\n".join(documents) + "\n")
    return directory
