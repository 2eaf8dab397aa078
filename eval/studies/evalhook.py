"""The evaluation hook end to end: a trained model through `occult-hf` in lm-eval, on local tasks.

Tasks are built from the held-out splits (`occult train`'s prepared data), so the model never
trained on them:

- `occ_ppl_<domain>`: rolling-loglikelihood perplexity (lm-eval's `loglikelihood_rolling`:
  word perplexity, byte perplexity, bits per byte) over the first held-out documents of each domain;
- `occ_nextline`: multiple choice, pick the true next line of a held-out document among three
  distractor lines drawn from the same domain's held-out text (chance: 0.25).

Each runs exact (Occult dispatch, same function as the model) and pruned (router mode, `N_d`=1 of
D=2), in one process (logical devices) and on 2 ranks (gloo expert parallelism under torchrun). The
study's own computation of the same rolling loglikelihoods (this module's `rolling_loglikelihood`,
written from lm-eval's windowing rule, run on the plain transformers model) checks lm-eval's
perplexity.

    python -m occult_hf.eval.studies.evalhook --model CKPT --data DATA --out-dir docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from occult_hf.utils.atomic import atomic_write_json, atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.errors import run_command

from .lmeval_tasks import OFFLINE_ENV, first_lines, nextline_items, run_lm_eval, write_multiple_choice_task, write_perplexity_task

NUM_DEVICES = 2
PRUNED = {"prune": "router", "max_devices_per_token": 1}
MAX_LENGTH = 256


def build_tasks(data, directory: Path, docs_per_domain: int = 12, max_chars: int = 1200, mc_items: int = 60, seed: int = 0) -> list[str]:
    """Write the local task YAMLs and JSONL files into `directory`; return the task names: one
    perplexity task per domain, and `occ_nextline` with `mc_items` items drawn from every domain."""
    rng = random.Random(seed)
    names, mc = [], []
    for domain in data.domains:
        texts = [t for t in data.heldout_texts(domain) if t.strip()]
        names.append(write_perplexity_task(directory, f"occ_ppl_{domain}", [first_lines(t, max_chars) for t in texts[:docs_per_domain]]))
        mc += nextline_items(texts, mc_items // len(data.domains), rng)
    return names + [write_multiple_choice_task(directory, "occ_nextline", mc)]


def _run(model_dir: str, tasks_dir: Path, tasks: list[str], occult: dict) -> dict:
    """One lm-eval run of the tasks on CPU in fp32, with per-document loglikelihoods and no bootstrap."""
    return run_lm_eval(model_dir, tasks_dir, tasks, occult, max_length=MAX_LENGTH, bootstrap_iters=0, log_samples=True).get("tasks", {})


@torch.no_grad()
def rolling_loglikelihood(model, ids: list[int], prefix_id: int, max_length: int) -> float:
    """Sum of log p(token | preceding tokens) over `ids`, each token predicted once: chunks of
    `max_length` predicted tokens; a chunk's input is the `max_length` tokens of `[prefix] + ids` that
    end right before its last token (the first chunk starts at the prefix)."""
    seq = [prefix_id] + list(ids)
    total = 0.0
    for start in range(0, len(ids), max_length):
        end = min(start + max_length, len(ids))  # predict ids[start:end] = seq[start+1:end+1]
        lo = max(0, end - max_length)
        inputs = torch.tensor([seq[lo:end]])
        logprobs = torch.log_softmax(model(input_ids=inputs, use_cache=False).logits[0].float(), -1)
        targets = torch.tensor(seq[start + 1 : end + 1])
        positions = torch.arange(start - lo, end - lo)
        total += float(logprobs[positions, targets].sum())
    return total


def own_perplexity(model_dir: str, tasks_dir: Path, domains: list[str]) -> dict:
    """The study's own rolling loglikelihoods and word/byte perplexities of the `occ_ppl_*` documents."""
    from transformers import AutoTokenizer, OlmoeForCausalLM

    model = OlmoeForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    out = {}
    for domain in domains:
        texts = [json.loads(l)["text"] for l in open(tasks_dir / f"occ_ppl_{domain}.jsonl", encoding="utf-8")]
        lls, tokens = [], 0
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens += len(ids)
            lls.append(rolling_loglikelihood(model, ids, prefix, MAX_LENGTH))
        words = sum(len(re.split(r"\s+", t)) for t in texts)
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        out[f"occ_ppl_{domain}"] = {"doc_loglikelihoods": lls, "word_perplexity": math.exp(-sum(lls) / words),
                                    "byte_perplexity": math.exp(-sum(lls) / nbytes), "token_perplexity": math.exp(-sum(lls) / tokens),
                                    "tokens": tokens}  # fmt: skip
    return out


def _rank_worker(args) -> int:
    """Under torchrun: exact and pruned through occult-hf on the EP group; rank 0 writes the results."""
    tasks = args.tasks.split(",")
    results = {}
    for label, occult in (("exact", {"num_devices": NUM_DEVICES}), ("pruned", {"num_devices": NUM_DEVICES, **PRUNED})):
        results[label] = _run(args.model, args.tasks_dir, tasks, occult)
    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write_json(args.result, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.evalhook", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory with tokenizer (e.g. occult train --recipe tiny)")
    parser.add_argument("--data", type=Path, required=True, help="its prepared data directory (held-out splits)")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--docs-per-domain", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2, help="EP ranks of the torchrun run (0: skip it)")
    parser.add_argument("--worker", action="store_true", help="(internal) a torchrun rank")
    parser.add_argument("--tasks-dir", type=Path)
    parser.add_argument("--tasks", default="")
    parser.add_argument("--result", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:
        return _rank_worker(args)
    from occult_hf.training import PreparedData

    data = PreparedData(args.data)
    tasks_dir = args.out_dir / "evalhook_tasks"
    tasks = build_tasks(data, tasks_dir, docs_per_domain=args.docs_per_domain)
    report = {"model": os.path.abspath(args.model), "tasks": tasks, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    start = time.perf_counter()
    for label, occult in (("exact", {"num_devices": NUM_DEVICES}), ("pruned", {"num_devices": NUM_DEVICES, **PRUNED})):
        report["runs"][f"1 process, {label}"] = _run(args.model, tasks_dir, tasks, occult)
    if args.ranks:
        result = args.out_dir / "evalhook_ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port", "29533",
                   "-m", "occult_hf.eval.studies.evalhook", "--worker", "--model", args.model, "--tasks-dir", str(tasks_dir),
                   "--tasks", ",".join(tasks), "--result", str(result)]  # fmt: skip
        env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        for label, r in json.loads(result.read_text()).items():
            report["runs"][f"{args.ranks} ranks (gloo EP), {label}"] = r
        result.unlink()
    report["wall_s"] = round(time.perf_counter() - start, 1)
    own = own_perplexity(args.model, tasks_dir, data.domains)
    report["own"] = own
    exact = report["runs"]["1 process, exact"]
    report["agreement"] = {
        task: {"word_perplexity_lm_eval": exact[task]["word_perplexity"], "word_perplexity_own": own[task]["word_perplexity"],
               "relative_difference": abs(exact[task]["word_perplexity"] / own[task]["word_perplexity"] - 1),
               "max_doc_loglikelihood_difference": max(abs(a - b) for a, b in zip(exact[task]["doc_loglikelihoods"], own[task]["doc_loglikelihoods"]))}
        for task in own
    }  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "evalhook.json", report)
    table = markdown(report)
    atomic_write_text(args.out_dir / "evalhook.md", table + "\n")
    print(table)
    return 0


def markdown(report: dict) -> str:
    tasks = report["tasks"]
    header = ["run", *(f"{t} {'acc / acc_norm' if t == 'occ_nextline' else 'word ppl'}" for t in tasks)]
    runs = [[run, *(f"{r[t]['acc']:.3f} / {r[t]['acc_norm']:.3f}" if t == "occ_nextline" else f"{r[t]['word_perplexity']:.4g}" for t in tasks)]
            for run, r in report["runs"].items()]  # fmt: skip
    agreement = [[task, f"{a['word_perplexity_lm_eval']:.4f}", f"{a['word_perplexity_own']:.4f}", f"{a['relative_difference']:.2e}",
                  f"{a['max_doc_loglikelihood_difference']:.2e}", f"{report['own'][task]['token_perplexity']:.3f}"]
                 for task, a in report["agreement"].items()]  # fmt: skip
    agreement_header = ["task", "lm-eval word ppl (1 process, exact)", "own word ppl", "relative difference",
                        "largest per-document loglikelihood difference", "own token ppl"]  # fmt: skip
    return "\n\n".join([markdown_table(header, runs, align="l" + "r" * len(tasks)), markdown_table(agreement_header, agreement, align="lrrrrr")])


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.evalhook", main))
