"""Local lm-eval tasks built from held-out text, and one lm-eval run of them through `occult-hf`.

The studies score a model trained here on text it never trained on, with no hub dataset: the tasks
are written as lm-eval task YAML beside a JSON-lines file of items, built by code from the held-out
split of a prepared data directory (`occult train --prepare-only`), deterministically from a seed:

- `nextline_items` (multiple choice, 4 choices, chance 0.25): the true next line of a held-out
  document after up to `context_lines` lines of it, among three lines drawn from other held-out
  documents of the same domain, with about the true line's length (so length alone tells nothing);
- `cloze_items` (multiple choice, 4 choices, chance 0.25): in code, a line cut right before an
  identifier that already occurs in the context; the choices are that identifier and three other
  identifiers of the same context, so that copying from the context does not give the answer away;
- `write_perplexity_task`: rolling-loglikelihood perplexity over whole held-out documents.

`run_lm_eval` runs such tasks with lm-eval's `simple_evaluate` on the `occult-hf` model type, offline.
"""

from __future__ import annotations

import json
import keyword
import os
import random
import re
from pathlib import Path

from occult_hf.utils.atomic import atomic_write_text

#: the environment of an offline lm-eval run (nothing is downloaded: the tasks are local files)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: a line counts as a line of text (a next-line answer or distractor) from this many non-blank characters
MIN_LINE_CHARS = 12
#: identifiers of the cloze: Python names of at least this many characters, keywords and builtins' constants excluded
MIN_IDENTIFIER_CHARS = 3
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_NOT_IDENTIFIERS = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)


def first_lines(text: str, max_chars: int) -> str:
    """The first whole lines of `text` that fit in `max_chars` characters (at least one line)."""
    out, total = [], 0
    for line in text.split("\n"):
        if total + len(line) + 1 > max_chars and out:
            break
        out.append(line)
        total += len(line) + 1
    return "\n".join(out)


def _is_text_line(line: str) -> bool:
    return len(line.strip()) >= MIN_LINE_CHARS


def nextline_items(texts: list[str], count: int, rng: random.Random, context_lines: int = 6,
                   max_context_chars: int = 400) -> list[dict]:  # fmt: skip
    """`count` next-line items `{context, choices, label}` from the documents `texts` (module docstring).

    Each answer line is used once; a distractor is a line of another document whose length is within
    a factor 1.5 of the answer's (the closest lengths when fewer qualify); an item's three distractors are
    distinct texts (a line common to several documents could be drawn twice, and the item was no longer
    four choices at chance 0.25).
    """
    spots = [(d, i) for d, text in enumerate(texts) for i, line in enumerate(text.split("\n")) if i >= 3 and _is_text_line(line)]
    pool = sorted({(len(line), line, d) for d, text in enumerate(texts) for line in text.split("\n") if _is_text_line(line)})
    if len(spots) < count or len({p[1] for p in pool}) < 4:
        raise ValueError(f"nextline_items: {len(spots)} answer lines in {len(texts)} documents, {count} items asked for")
    items = []
    for d, i in rng.sample(spots, count):
        lines = texts[d].split("\n")
        answer = lines[i]
        others = [p for p in pool if p[2] != d and p[1] != answer]
        near = [p for p in others if len(answer) / 1.5 <= p[0] <= len(answer) * 1.5]
        if len(near) < 3:
            near = sorted(others, key=lambda p: abs(p[0] - len(answer)))[:3]
        distractors = [p[1] for p in rng.sample(near, 3)]
        if len(set(distractors)) < 3:  # one line text in several documents: draw among distinct texts instead
            distinct = list({p[1]: p for p in near}.values())
            if len(distinct) < 3:
                distinct = list({p[1]: p for p in sorted(others, key=lambda p: abs(p[0] - len(answer)))}.values())[:3]
            distractors = [p[1] for p in rng.sample(distinct, 3)]
        items.append(_shuffled("\n".join(lines[max(0, i - context_lines) : i])[-max_context_chars:] + "\n", answer, distractors, rng))
    return items


def cloze_items(texts: list[str], count: int, rng: random.Random, context_lines: int = 10,
                max_context_chars: int = 600) -> list[dict]:  # fmt: skip
    """`count` identifier-cloze items `{context, choices, label}` from code documents (module docstring).

    A spot is an identifier on a line (comment lines excluded) that also occurs in the context before
    it, where that context holds at least three other identifiers; one spot per line, drawn from the
    line's qualifying identifiers.
    """
    spots = []
    for text in texts:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if i < 1 or line.lstrip().startswith("#"):
                continue
            before = "\n".join(lines[max(0, i - context_lines) : i]) + "\n"
            on_line = []
            for match in IDENTIFIER.finditer(line):
                context = (before + line[: match.start()])[-max_context_chars:]
                names = _identifiers(context)
                if match.group() in names and len(names - {match.group()}) >= 3:
                    on_line.append((context, match.group(), sorted(names - {match.group()})))
            if on_line:
                spots.append(rng.choice(on_line))
    if len(spots) < count:
        raise ValueError(f"cloze_items: {len(spots)} identifier spots in {len(texts)} documents, {count} items asked for")
    return [_shuffled(context, answer, rng.sample(others, 3), rng) for context, answer, others in rng.sample(spots, count)]


def _identifiers(text: str) -> set[str]:
    return {name for name in IDENTIFIER.findall(text) if len(name) >= MIN_IDENTIFIER_CHARS and name not in _NOT_IDENTIFIERS}


def _shuffled(context: str, answer: str, distractors: list[str], rng: random.Random) -> dict:
    choices = [answer, *distractors]
    order = list(range(len(choices)))
    rng.shuffle(order)
    return {"context": context, "choices": [choices[j] for j in order], "label": order.index(0)}


def _json_lines(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def _task_yaml(name: str, data_file: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file.resolve()}\n"
            f"test_split: test\n{body}")  # fmt: skip


def write_multiple_choice_task(directory: Path, name: str, items: list[dict]) -> str:
    """`<name>.yaml` + `<name>.jsonl` in `directory`: lm-eval multiple choice scored by `acc` and `acc_norm`
    (the choice's loglikelihood after the context, and the same divided by the choice's bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    _json_lines(directory / f"{name}.jsonl", items)
    body = ("output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
            "target_delimiter: ''\ndoc_to_target: label\nmetric_list:\n"
            "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
            "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")  # fmt: skip
    atomic_write_text(directory / f"{name}.yaml", _task_yaml(name, directory / f"{name}.jsonl", body))
    return name


def write_perplexity_task(directory: Path, name: str, texts: list[str]) -> str:
    """`<name>.yaml` + `<name>.jsonl`: lm-eval's rolling loglikelihood over `texts` (word and byte
    perplexity, bits per byte)."""
    directory.mkdir(parents=True, exist_ok=True)
    _json_lines(directory / f"{name}.jsonl", [{"text": t} for t in texts])
    body = ("output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")  # fmt: skip
    atomic_write_text(directory / f"{name}.yaml", _task_yaml(name, directory / f"{name}.jsonl", body))
    return name


def task_manager(tasks_dir: Path):
    """An lm-eval `TaskManager` that knows the tasks in `tasks_dir` only (no indexing of lm-eval's own)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir), include_defaults=False)


def go_offline() -> None:
    """Offline hub and datasets, and no `pip list` etc. in lm-eval's results (it would start subprocesses)."""
    os.environ.update(OFFLINE_ENV)
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = lambda results: None


def run_lm_eval(model_dir: str | os.PathLike, tasks_dir: Path, tasks: list[str], occult: dict, *, device: str = "cpu",
                dtype: str = "float32", batch_size: int = 8, max_length: int = 256, bootstrap_iters: int = 100_000,
                log_samples: bool = False) -> dict:  # fmt: skip
    """lm-eval's `simple_evaluate` of `tasks` with `occult-hf` (model_args: the checkpoint, `occult`'s
    OccultConfig fields); `{"tasks": {task: {metric: value}}, "occult_config": ...}`: the numeric metrics
    (`acc`, `acc_stderr`, ...), with `doc_loglikelihoods` per perplexity task when `log_samples`, and
    the `OccultConfig` the model ran with, as lm-eval recorded it. Empty on ranks other than 0.

    `bootstrap_iters` > 0 gives the standard errors (closed form for `acc`: lm-eval bootstraps only
    other aggregations); 0 skips them.
    """
    import lm_eval

    import occult_hf.eval  # noqa: F401  (registers occult-hf)

    go_offline()
    args = {"pretrained": str(model_dir), "device": device, "dtype": dtype, "max_length": max_length, **occult}
    results = lm_eval.simple_evaluate(model="occult-hf", model_args=args, tasks=tasks, batch_size=batch_size,
                                      log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                                      task_manager=task_manager(tasks_dir))  # fmt: skip
    if results is None:
        return {}
    out = {task: {k.split(",")[0]: v for k, v in r.items() if isinstance(v, (int, float))} for task, r in results["results"].items()}
    for task, samples in results.get("samples", {}).items():
        if task in out and samples and samples[0]["doc"].keys() == {"text"}:
            out[task]["doc_loglikelihoods"] = [_first_float(s["filtered_resps"][0]) for s in sorted(samples, key=lambda s: s["doc_id"])]
    return {"tasks": out, "occult_config": results["config"]["occult_config"]}


def _first_float(response) -> float:
    return float(response[0] if isinstance(response, (list, tuple)) else response)
