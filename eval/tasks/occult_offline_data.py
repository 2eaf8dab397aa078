"""The documents of the `occult_offline` tasks, built from text occult_hf ships (no download).

The text is `occult_hf/data/demo_sources.json.xz`, the frozen snapshot of occult_hf's own Python sources
that `occult demo` profiles on. The odd-numbered files (the demo's held-out half) make both tasks:

- `occult_offline_ppl` (rolling log-likelihood, lm-eval's word/byte perplexity and bits per byte): the
  first `PPL_CHARS` characters of each of the first `PPL_DOCUMENTS` held-out files;
- `occult_offline_nextline` (multiple choice, acc / acc_norm): `NEXTLINE_QUESTIONS` questions, each
  `CONTEXT_LINES` consecutive non-blank lines of a file and four candidates for the line that follows:
  the true one and three lines drawn from other files (fixed seed).
"""

from __future__ import annotations

import random

PPL_DOCUMENTS, PPL_CHARS = 8, 1500
NEXTLINE_QUESTIONS, CONTEXT_LINES, CHOICES = 40, 6, 4
SEED = 0


def _held_out_files() -> list[str]:
    from occult_hf.training.shipped import demo_sources

    return demo_sources()[1::2]


def _dataset(rows: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(rows)})


def perplexity_documents(**metadata):
    """`{"text"}` rows for the rolling-perplexity task (`metadata`: lm-eval passes the task's)."""
    return _dataset([{"text": text[:PPL_CHARS]} for text in _held_out_files()[:PPL_DOCUMENTS]])


def next_line_questions(**metadata):
    """`{"context", "choices", "label"}` rows for the next-line multiple-choice task."""
    files = [[line for line in text.splitlines() if line.strip()] for text in _held_out_files()]
    files = [lines for lines in files if len(lines) > CONTEXT_LINES + 1]
    rng = random.Random(SEED)
    rows = []
    while len(rows) < NEXTLINE_QUESTIONS:
        source = rng.randrange(len(files))
        lines = files[source]
        start = rng.randrange(len(lines) - CONTEXT_LINES)
        answer = lines[start + CONTEXT_LINES]
        others = [rng.choice(files[f]) for f in rng.sample([f for f in range(len(files)) if f != source], CHOICES - 1)]
        if answer in others or len(set(others)) < len(others):
            continue
        label = rng.randrange(CHOICES)
        choices = others[:label] + [answer] + others[label:]
        rows.append({"context": "\n".join(lines[start : start + CONTEXT_LINES]) + "\n", "choices": choices, "label": label})
    return _dataset(rows)
