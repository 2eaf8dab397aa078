"""The quality, drift and accuracy runs on a trained MoE (docs/design.md §8; docs/quality.md).

One command runs everything that needs the model, as supervised worker processes on the GPUs (on
CPU when there are none):

    python -m occult_hf.eval.studies.quality --data DATA --work WORK --out OUT [--size study|cpu|micro]

1. **base** (one job, GPU 0): the multiple-choice tasks built from held-out text (`MC_TASKS`),
   loaded once through lm-eval so that the workers find them prepared; pre-train the study recipe
   from scratch on python_docs + kernel_docs (`occult_hf.training.train`; python_stdlib_code, B,
   stays new to the model); per domain, routing profiles of the training split (planning) and of
   the held-out split (the transfer study); learned-routing structure; at every study D the
   `refined` placement planned on the training profile of B, which every variant at that D uses.
2. **variants** (`studies.variants`: `plain` and every pruned fine-tune for each seed, `base` and
   every pruned base model without fine-tuning), several worker processes per GPU at once (a
   fine-tune of this model through the Occult blocks is bound by kernel launches, so processes
   sharing a GPU fill each other's gaps). Each: fine-tune on B (the seed sets the data order;
   pruned ones with `OccultCallback`'s N_d schedule); held-out perplexity of every domain; on
   held-out B the dispatched routing's CT, remote copies, bytes per token and removed weight (exact
   variants under every D's placement); drift for `plain` (`quality_measures.drift`); then the
   checkpoint through lm-eval's `occult-hf` model type on the multiple-choice tasks, as it runs
   (its placement, D, pruning), with lm-eval's standard errors.

Every job runs under `occult_hf.eval.studies.jobs.run_jobs` (a worker whose log stops growing for
`--stall` seconds is killed, every job still running at `--budget` seconds is cut). The command is
**resumable**: a later run with the same `--work` skips the base job once it finished (a pre-training the
deadline cut goes on from its last checkpoint, `pretrain_checkpoint_steps`, to the same weights) and every
variant whose result exists, so a study longer than one device call is the same command run again
until it reports every variant done. A study that outlives its machine goes on on another: the base job is
bitwise repeatable (deterministic algorithms), so the next machine trains the same base model again, and
`--earlier OUT/quality_results.json` takes the variants the first machine finished (matched by a SHA-256
of the base job's outputs, `base_fingerprint`). A study that fits one machine's lease can pre-train with PyTorch's
default kernels instead (`--default-kernels`: about 1.35x faster, not repeatable, so every variant runs on that
machine; `base_kernels` in the results says which). Each run writes, in OUT, `quality_results.json` (every result in
WORK so far), `loss_curve.png`, `profiles_train.tar.gz` and `profiles_heldout.tar.gz` (the transfer
study's profiles), `placements.tar.gz`, `tasks.tar.gz` (the task files) and `logs.tar.gz`, then exits 0 when every variant is done, 2 when
some are left for another run, 1 when a job failed or stalled.

The Occult blocks use `expert_backend="torch"` (fp32 weights through PyTorch GEMMs, TF32 on GPUs);
the environment variable `OCCULT_STUDY_EXPERT_BACKEND` selects another backend (`auto`, `triton`).
The CPU side (`python -m occult_hf.eval.studies.report_quality OUT`) writes the tables and plots.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import sys
import tarfile
import time
from functools import partial
from pathlib import Path

from occult_hf.utils.atomic import atomic_path, atomic_write_json, atomic_write_text
from occult_hf.utils.errors import DEBUG_ENV, run_command

from .jobs import Job, run_jobs
from .lmeval_tasks import OFFLINE_ENV, cloze_items, nextline_items, run_lm_eval, write_multiple_choice_task
from .variants import MODES, Variant, study_variants

#: the fine-tuning domain (B), the forgetting domain (A) and the third one (C)
FT_DOMAIN, FORGET_DOMAIN, THIRD_DOMAIN = "python_stdlib_code", "python_docs", "kernel_docs"
#: the `refined` planner's options in every plan of the study (placements, re-plans, drift watch):
#: 8 search rounds on 4,096 sampled tokens instead of 40 on 16,384 (measured: 1.5 s instead of 40 s
#: per E=64 layer on a shared CPU, held-out CT within 1% on a synthetic E=64 k=8 profile)
REFINED = {"search_rounds": 8, "max_sample_tokens": 4096}
#: the multiple-choice tasks: name -> (item builder, held-out domain it is built from)
MC_TASKS = {"occ_nextline_code": ("nextline", FT_DOMAIN), "occ_cloze_code": ("cloze", FT_DOMAIN),
            "occ_nextline_docs": ("nextline", FORGET_DOMAIN)}  # fmt: skip
_BUILDERS = {"nextline": nextline_items, "cloze": cloze_items}
#: the seed of the multiple-choice items (fixed: every variant answers the same items)
MC_SEED = 0

#: the sizes of a run. `device_limits`: {D: N_d values}; `per_job` / `min_job_s`: (fine-tunes,
#: variants without fine-tuning) per worker process, and the time a job needs left before the
#: deadline to start (per variant in it) until a variant of its kind has finished in the work directory
#: (`variant_need_s`); `slots`: worker processes per GPU (or on the CPU); `job_gib`:
#: (fine-tunes, variants without fine-tuning) the GPU memory one worker process holds at its peak, which
#: decides how many share a GPU (`run_jobs`' `capacity_gib`).
SIZES = {
    # one H200 (docs/quality.md, the stronger model): the study_long recipe, D=4 and D=8, 3 seeds
    "study": {"recipe": "study_long", "pretrain": {}, "pretrain_checkpoint_steps": 300,
              "device_limits": {4: (1, 2, 3), 8: (1, 2, 3, 4)}, "modes": MODES, "seeds": (0, 1, 2),
              "ft_steps": 60, "ft_batch": 32, "ft_lr": 3e-4, "eval_tokens": 32_768, "profile_tokens": 32_768,
              "drift_tokens": 16_384, "mc_items": 600, "mc_batch": 64,
              "per_job": (2, 3), "min_job_s": (110.0, 50.0), "slots": 10, "job_gib": (20.0, 4.0)},
    # the tiny recipe on the real corpus, on a CPU: a study in minutes (not the study: a check of it)
    "cpu": {"recipe": "tiny", "pretrain": {}, "pretrain_checkpoint_steps": None,
            "device_limits": {4: (1, 2)}, "modes": MODES, "seeds": (0, 1),
            "ft_steps": 30, "ft_batch": 8, "ft_lr": 1e-3, "eval_tokens": 16_384, "profile_tokens": 8192,
            "drift_tokens": 8192, "mc_items": 100, "mc_batch": 32,
            "per_job": (2, 5), "min_job_s": (0.0, 0.0), "slots": 2, "job_gib": (0.0, 0.0)},
    # a few steps of everything: the CI test of the pipeline
    "micro": {"recipe": "tiny", "pretrain": {"max_steps": 4, "batch_size": 4}, "pretrain_checkpoint_steps": 2,
              "device_limits": {4: (2,)}, "modes": ("router",), "seeds": (0, 1),
              "ft_steps": 3, "ft_batch": 4, "ft_lr": 3e-4, "eval_tokens": 1024, "profile_tokens": 1024,
              "drift_tokens": 1024, "mc_items": 8, "mc_batch": 8,
              "per_job": (4, 2), "min_job_s": (0.0, 0.0), "slots": 2, "job_gib": (0.0, 0.0)},
}  # fmt: skip


def settings(size: str) -> dict:
    """The sizes of a `study`, `cpu` or `micro` run (`SIZES`), with `size` itself."""
    if size not in SIZES:
        raise ValueError(f"quality study: size {size!r} is not one of {sorted(SIZES)}")
    return {**SIZES[size], "size": size}


def variants_of(size: str) -> list[Variant]:
    s = settings(size)
    return study_variants(s["device_limits"], s["modes"], s["seeds"])


def study_recipe(size: str):
    from occult_hf.training import get_recipe

    s = settings(size)
    # the study recipes name these domains already; the tiny one trains on every domain of the corpus, B included.
    # A fixed number of steps, never a time budget: the base model must not depend on the machine's speed (`repeatable`)
    return get_recipe(s["recipe"], **s["pretrain"]).replace(train_domains=(FORGET_DOMAIN, THIRD_DOMAIN), time_budget_s=None)


def placement_file(work: Path, devices: int) -> Path:
    return work / f"placement_d{devices}.json"


def similarity_profile(work: Path) -> Path:
    """The routing profile similarity pruning reads: the base model's, on B's training split."""
    return work / "profiles" / f"train_{FT_DOMAIN}.safetensors"


def _load(path: Path):
    import torch
    from transformers import OlmoeForCausalLM

    model = OlmoeForCausalLM.from_pretrained(path)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 fine-tunes and evaluations, TF32 matmuls
        model = model.cuda()
    return model.eval()


# ----- 1. the base job ---------------------------------------------------------------------------
def base_parts(work: Path) -> dict[str, Path]:
    """The base job's parts and the file each writes last (its mark of being done)."""
    return {"pretrain": work / "base" / "train_log.json", "profiles": work / "base.json", "tasks": work / "tasks" / "tasks.json"}


def base_done(work: Path) -> bool:
    """Whether every part of the base job has finished (each part's mark, `base_parts`, exists)."""
    return all(mark.is_file() for mark in base_parts(work).values())


def base_job(data_dir: Path, work: Path, size: str, deterministic: bool = True) -> None:
    """Pre-train, profile and plan, build the tasks: each part skipped when an earlier run finished it; bitwise
    repeatable (`repeatable`), so that another machine trains the very same base model (`base_fingerprint`), unless
    `deterministic` is False (PyTorch's default kernels: faster, and the base model lives on this machine alone)."""
    kernels = "deterministic" if deterministic else "default"
    kernels_mark = base_kernels_file(work)
    if kernels_mark.is_file() and kernels_mark.read_text().strip() != kernels:
        raise ValueError(f"quality study: the base job in {work} started with {kernels_mark.read_text().strip()} kernels; it cannot "
                         f"go on with {kernels} ones (a pre-training resumed with other kernels is neither model): use a new work directory")
    atomic_write_text(kernels_mark, kernels)
    if deterministic:
        repeatable()
    done = {part: mark.is_file() for part, mark in base_parts(work).items()}
    if not done["tasks"]:  # first: a machine where lm-eval cannot load them fails in seconds, not after pre-training
        build_tasks(data_dir, work / "tasks", settings(size)["mc_items"])
    if not done["pretrain"]:
        pretrain(data_dir, work, size)
    if not done["profiles"]:
        profile_and_plan(data_dir, work, size)


def claim_work_dir(work: Path, size: str, data_settings) -> None:
    """Record in `work/study.json` the study size and the prepared data's settings on the first run; refuse a later
    run with others: every result in `work` (the base model, the finished variants) belongs to the first ones, which a
    resume would silently reuse and report as this study's (a micro base model and 3-step variants as a cpu study)."""
    mark = work / "study.json"
    ours = {"size": size, "data_settings": data_settings}
    if mark.is_file():
        theirs = json.loads(mark.read_text())
        changed = [f"{key} {theirs.get(key)!r} (now {value!r})" for key, value in ours.items() if theirs.get(key) != value]
        if changed:
            raise SystemExit(f"quality study: the work directory {work} holds a study made with other settings: "
                             f"{'; '.join(changed)}; use a new --work")  # fmt: skip
        return
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(mark, json.dumps(ours, indent=1))


def base_kernels_file(work: Path) -> Path:
    """Which kernels the base job pre-trains with (`base_job`): "deterministic" or "default"."""
    return work / "base_kernels.txt"


def repeatable() -> None:
    """Make this process's GPU work bitwise repeatable (call it before any CUDA work: cuBLAS reads its workspace setting
    when it starts).

    The base model lives on the machine that trained it, so a study longer than one session's device time goes on
    on another machine by training it again, and the variants of both runs join only if it is the very same model.
    On the H200 two pre-trainings of the study model with PyTorch's default kernels differ after 8 steps; with
    deterministic algorithms they are equal bit for bit, at about 1.35x the step time (docs/device/determinism_probe.py).
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def base_fingerprint(work: Path) -> str:
    """SHA-256 of what every variant builds on: the base checkpoint's weight files, the placements, the similarity
    profile's tensors and the task items (not the files' paths, which the profile and the task YAML name). Computed
    once (the pipeline does it after the base job), then read from `base/fingerprint.txt`."""
    from safetensors import safe_open

    if not base_done(work):
        raise RuntimeError(f"quality study: the base job in {work} has not finished: no fingerprint of its outputs yet")
    mark = work / "base" / "fingerprint.txt"
    if not mark.is_file():
        digest = hashlib.sha256()
        files = [*sorted((work / "base").glob("*.safetensors")), *sorted(work.glob("placement_d*.json")),
                 *sorted((work / "tasks").glob("*.jsonl"))]  # fmt: skip
        for path in files:
            digest.update(path.name.encode())
            with path.open("rb") as content:
                for block in iter(lambda: content.read(1 << 24), b""):
                    digest.update(block)
        with safe_open(similarity_profile(work), "pt") as profile:
            for name in sorted(profile.keys()):
                digest.update(name.encode())
                digest.update(profile.get_tensor(name).numpy().tobytes())
        atomic_write_text(mark, digest.hexdigest())
    return mark.read_text().strip()


def pretrain(data_dir: Path, work: Path, size: str) -> None:
    from occult_hf.training import train

    print(f"[base] pre-training recipe {study_recipe(size).name}", flush=True)
    # checkpoints: a pre-training cut by a call's deadline resumes in the next call on the same machine, to the same weights
    log = train(study_recipe(size), data_dir, work / "base", eval_tokens=settings(size)["eval_tokens"], progress=True,
                checkpoint_steps=settings(size)["pretrain_checkpoint_steps"])
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity")}), flush=True)


def profile_and_plan(data_dir: Path, work: Path, size: str) -> None:
    from occult_hf.placement import plan_placement
    from occult_hf.profile import RoutingProfile
    from occult_hf.training import PreparedData
    from occult_hf.training.evaluate import capture_routing, routing_structure

    s = settings(size)
    data = PreparedData(data_dir)
    recipe = study_recipe(size)
    model = _load(work / "base")
    (work / "profiles").mkdir(parents=True, exist_ok=True)
    result = {"structure": {}}
    for domain in data.domains:
        print(f"[base] routing profiles and structure of {domain}", flush=True)
        for split in ("train", "heldout"):
            windows = data.windows(split, domain, recipe.seq_len, max_tokens=s["profile_tokens"])
            profile = RoutingProfile.collect(model, windows.tolist(), batch_size=16, max_length=recipe.seq_len,
                                             sample_size=s["profile_tokens"], progress=False,
                                             source=f"study base model, {split} split of {domain}")  # fmt: skip
            profile.save(work / "profiles" / f"{split}_{domain}.safetensors")
        routing = capture_routing(model, data.windows("heldout", domain, recipe.seq_len, max_tokens=s["profile_tokens"]))
        result["structure"][domain] = routing_structure(routing, recipe.num_experts)
    plan_profile = RoutingProfile.load(similarity_profile(work))
    for devices in s["device_limits"]:
        print(f"[base] planning the refined placement (D={devices}) on the training split of {FT_DOMAIN}", flush=True)
        placement = plan_placement(plan_profile, devices, "refined", progress=False, **REFINED)
        placement.meta["planned_on"] = f"base model, training split of {FT_DOMAIN}"
        placement.save(placement_file(work, devices))
    atomic_write_json(work / "base.json", result)


def build_tasks(data_dir: Path, tasks_dir: Path, items: int) -> list[str]:
    """Write `MC_TASKS` (`items` each, from the held-out splits) into `tasks_dir`, load them once through
    lm-eval (it prepares their datasets in the cache the workers read), then write `tasks.json`."""
    from occult_hf.training import PreparedData

    from .lmeval_tasks import go_offline, task_manager

    data = PreparedData(data_dir)
    print(f"[base] building the multiple-choice tasks ({items} items each)", flush=True)
    for name, (builder, domain) in MC_TASKS.items():
        texts = [t for t in data.heldout_texts(domain) if t.strip()]
        write_multiple_choice_task(tasks_dir, name, _BUILDERS[builder](texts, items, random.Random(MC_SEED)))
    go_offline()
    loaded = task_manager(tasks_dir).load(list(MC_TASKS))["tasks"]
    counts = {name: len(task.eval_docs) for name, task in loaded.items()}
    atomic_write_json(tasks_dir / "tasks.json", {"tasks": MC_TASKS, "items": counts, "seed": MC_SEED})
    return list(MC_TASKS)


# ----- 2. a variant ------------------------------------------------------------------------------
def occult_settings(work: Path, variant: Variant, exact_devices: int) -> dict:
    """The `OccultConfig` fields of `variant` (exact ones at `exact_devices`)."""
    devices = variant.devices or exact_devices
    fields = {"placement": str(placement_file(work, devices)), "num_devices": devices,
              "expert_backend": os.environ.get("OCCULT_STUDY_EXPERT_BACKEND", "torch")}  # fmt: skip
    if variant.pruned:
        fields.update(prune=variant.mode, max_devices_per_token=variant.max_devices_per_token)
        if variant.mode == "similarity":
            fields["profile"] = str(similarity_profile(work))
    return fields


def fine_tune(model, variant: Variant, data_dir: Path, work: Path, size: str) -> dict:
    """Fine-tune `model` on B in place: `plain` with `OccultCallback`'s logging and its drift watch at
    the last step, a pruned one with the callback's N_d schedule over the first quarter of the steps."""
    from occult_hf.hf.callback import OccultCallback
    from occult_hf.training import train

    s = settings(size)
    recipe = study_recipe(size)
    print(f"[{variant.name}] fine-tuning on {FT_DOMAIN}: {s['ft_steps']} steps x {s['ft_batch']} x {recipe.seq_len} tokens, seed {variant.seed}", flush=True)
    ft = recipe.replace(name=f"{recipe.name}-ft-{variant.name}", max_steps=s["ft_steps"], batch_size=s["ft_batch"],
                        learning_rate=s["ft_lr"], warmup_steps=max(1, s["ft_steps"] // 10), time_budget_s=None,
                        bf16=False, seed=variant.seed)  # fmt: skip  (fp32 weights and activations through the Occult blocks)
    callback = OccultCallback(schedule_steps=s["ft_steps"] // 4 if variant.pruned else 0,
                              check_every=0 if variant.pruned else s["ft_steps"], per_layer=False, planner_options=REFINED)  # fmt: skip
    log = train(ft, data_dir, work / "ft" / variant.name, model=model, train_domains=(FT_DOMAIN,),
                trainer_callbacks=[callback, _step_printer(variant.name, s["ft_steps"])], eval_tokens=s["eval_tokens"],
                progress=False, save=False, logging_steps=max(1, s["ft_steps"] // 10))  # fmt: skip
    return {"train": {k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "loss_history")},
            "callback_logs": [{k: v for k, v in h.items() if k.startswith("occult/") or k in ("step", "loss")}
                              for h in log["log_history"] if any(k.startswith("occult/") for k in h)]}  # fmt: skip


def measure(model, variant: Variant, data_dir: Path, work: Path, size: str) -> dict:
    """Held-out perplexity of every domain; on held-out B the dispatched routing's communication (under
    its own D's placement, or every D's for an exact variant) and removed weight; drift for `plain`."""
    from occult_hf.placement import Placement
    from occult_hf.training import PreparedData
    from occult_hf.training.evaluate import perplexity

    from .quality_measures import communication, dispatched_routing, drift

    s = settings(size)
    data = PreparedData(data_dir)
    seq_len, hidden = study_recipe(size).seq_len, model.config.hidden_size
    out = {"perplexity": {d: perplexity(model, data.windows("heldout", d, seq_len, max_tokens=s["eval_tokens"]))
                          for d in data.domains}}  # fmt: skip
    held_ids, out["removed_weight"] = dispatched_routing(model, data.windows("heldout", FT_DOMAIN, seq_len, max_tokens=s["eval_tokens"]))
    placements = {d: Placement.load(placement_file(work, d)) for d in ([variant.devices] if variant.pruned else s["device_limits"])}
    out["communication"] = {str(d): communication(held_ids, p, hidden) for d, p in placements.items()}
    if variant.fine_tuned and not variant.pruned:
        print(f"[{variant.name}] drift: re-planning on the fine-tuned routing", flush=True)
        train_ids, _ = dispatched_routing(model, data.windows("train", FT_DOMAIN, seq_len, max_tokens=s["drift_tokens"]))
        out["drift"] = {str(d): drift(train_ids, held_ids, p, model.config.num_experts, REFINED) for d, p in placements.items()}
    return out


def accuracy(checkpoint: Path, variant: Variant, work: Path, size: str) -> tuple[dict, dict]:
    """lm-eval through `occult-hf` on `MC_TASKS`: (`{task: {acc, acc_stderr, acc_norm, acc_norm_stderr}}`,
    the `OccultConfig` lm-eval recorded that the model ran with)."""
    import torch

    s = settings(size)
    results = run_lm_eval(checkpoint, work / "tasks", list(MC_TASKS), occult_settings(work, variant, max(s["device_limits"])),
                          device="cuda" if torch.cuda.is_available() else "cpu", batch_size=s["mc_batch"],
                          max_length=study_recipe(size).seq_len)  # fmt: skip
    keys = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
    return {task: {k: results["tasks"][task][k] for k in keys} for task in MC_TASKS}, results["occult_config"]


def run_variant(name: str, data_dir: Path, work: Path, size: str) -> dict:
    """One variant: fine-tune (when it is one), measure, score on the tasks through lm-eval."""
    import torch

    from occult_hf.config import OccultConfig
    from occult_hf.hf.apply import apply_occult
    from occult_hf.training import PreparedData

    variant = Variant.parse(name)
    if variant not in variants_of(size):
        raise ValueError(f"variant {name!r} is not part of the {size} study")
    s = settings(size)
    fields = occult_settings(work, variant, max(s["device_limits"]))
    print(f"[{name}] loading the base model (Occult blocks: {fields})", flush=True)
    model = apply_occult(_load(work / "base"), OccultConfig(**fields))
    result = {"variant": name, "fine_tuned": variant.fine_tuned, "seed": variant.seed, "mode": variant.mode,
              "devices": variant.devices, "max_devices_per_token": variant.max_devices_per_token,
              "base_fingerprint": base_fingerprint(work), "timings_s": {}}  # fmt: skip
    start = time.perf_counter()
    if variant.fine_tuned:
        result.update(fine_tune(model, variant, data_dir, work, size))
        result["timings_s"]["fine_tune"] = round(time.perf_counter() - start, 1)
    print(f"[{name}] measuring perplexity, CT and removed weight", flush=True)
    mark = time.perf_counter()
    result.update(measure(model, variant, data_dir, work, size))
    result["timings_s"]["measure"] = round(time.perf_counter() - mark, 1)
    checkpoint = work / "base"
    if variant.fine_tuned:  # lm-eval loads a checkpoint: this one lives until it is scored
        checkpoint = work / "checkpoints" / name
        model.save_pretrained(checkpoint)
        PreparedData(data_dir).tokenizer().save_pretrained(checkpoint)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"[{name}] multiple-choice tasks through lm-eval (occult-hf)", flush=True)
    mark = time.perf_counter()
    result["accuracy"], result["lm_eval_occult_config"] = accuracy(checkpoint, variant, work, size)
    result["timings_s"]["lm_eval"] = round(time.perf_counter() - mark, 1)
    if variant.fine_tuned:
        shutil.rmtree(checkpoint)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if torch.cuda.is_available():  # for planning how many workers share a GPU
        result["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def _step_printer(name: str, total: int, every: int | None = None):
    """A `TrainerCallback` printing `[name] step i/total` every few steps: the worker's heartbeat."""
    from transformers import TrainerCallback

    every = every or max(1, total // 12)

    class StepPrinter(TrainerCallback):
        def __init__(self) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1 or state.global_step % every == 0 or state.global_step == total:
                print(f"[{name}] step {state.global_step}/{total} ({time.perf_counter() - self.start:.1f} s)", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"[{name}] step {state.global_step} loss {logs['loss']:.4f}", flush=True)

    return StepPrinter()


def result_file(work: Path, name: str) -> Path:
    return work / "variants" / f"{name}.json"


def worker(names: list[str], data_dir: Path, work: Path, size: str) -> None:
    """Variants one after the other in this process; each result (or its error) goes to its result file."""
    import torch

    torch.set_num_threads(1)
    for name in names:
        try:
            result = run_variant(name, data_dir, work, size)
        except Exception as error:  # noqa: BLE001  (the error is the result: the pipeline reports it)
            import traceback

            traceback.print_exc()
            result = {"variant": name, "error": f"{type(error).__name__}: {error}",
                      "base_fingerprint": base_fingerprint(work) if base_done(work) else None}  # fmt: skip
        result_file(work, name).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(result_file(work, name), result)
        print(f"[{name}] done at {time.strftime('%H:%M:%S')}", flush=True)


# ----- the pipeline --------------------------------------------------------------------------------
def current_result(work: Path, name: str) -> dict | None:
    """`name`'s result file in `work`, None when there is none or it names another base model than the work
    directory's: one made before the base job was run again (its `base/` removed and pre-trained anew) holds
    another model's numbers, which a resume would keep and report beside the new ones."""
    path = result_file(work, name)
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    made_on = result.get("base_fingerprint")
    if made_on is not None and base_done(work) and made_on != base_fingerprint(work):
        return None
    return result


def finished(work: Path, name: str) -> bool:
    """Whether an earlier job delivered `name` on this base model (`current_result`, without an error)."""
    result = current_result(work, name)
    return result is not None and "error" not in result


#: a worker's own start before its first variant: imports, the data and the base model (13-18 s on the H200)
JOB_START_S = 20.0


def variant_need_s(work: Path, fine_tuned: bool, unmeasured_s: float) -> float:
    """Seconds one variant of this kind needs: the longest one of its kind took in `work`, `unmeasured_s` until one did.

    Workers share a GPU, so a variant takes as long as its neighbours let it: what this work directory measured (read
    each time a job could start, so a run learns from its own first variants) is the best guess, above or below the
    size's figure (the `study` size's is what one H200 under CUDA MPS measured with nine workers on 2026-12-03: 62-102 s
    a fine-tune, 21-45 s a variant without one). Starting only what the time left can finish lets a call end early
    instead of spending its last minutes on work that the deadline throws away.
    """
    walls = [result.get("wall_s", 0.0) for path in (work / "variants").glob("*.json")
             if "error" not in (result := json.loads(path.read_text())) and bool(result.get("fine_tuned")) == fine_tuned]  # fmt: skip
    return max(walls) if walls else unmeasured_s


def job_need_s(work: Path, fine_tuned: bool, variants: int, unmeasured_s: float) -> float:
    """Seconds a worker job of `variants` variants of one kind needs left before the deadline to start: its own start
    and `variant_need_s` per variant."""
    return JOB_START_S + variants * variant_need_s(work, fine_tuned, unmeasured_s)


def pack_jobs(names: list[str], common: list[str], work: Path, size: str) -> list[Job]:
    """The worker jobs of `names` (in order): `per_job` fine-tunes, or variants without fine-tuning, each.

    A job does not start with less time left than `job_need_s`, estimated when its slot frees up.
    """
    s = settings(size)
    jobs, group = [], []
    for i, name in enumerate(names):
        group.append(name)
        tuned = Variant.parse(name).fine_tuned
        kind = 0 if tuned else 1  # the index of the settings' (fine-tunes, variants without) pairs
        last = i + 1 == len(names) or Variant.parse(names[i + 1]).fine_tuned != tuned
        if last or len(group) == s["per_job"][kind]:
            label = group[0] if len(group) == 1 else f"{group[0]}+{len(group) - 1}"
            jobs.append(Job(label, [*common, "--stage", "variants", "--names", ",".join(group)], work / "logs" / f"{label}.txt",
                            min_time_s=partial(job_need_s, work, tuned, len(group), s["min_job_s"][kind]),
                            memory_gib=s["job_gib"][kind]))  # fmt: skip
            group = []
    return jobs


def _tar(path: Path, members: list[tuple[Path, str]]) -> None:
    """A gzipped tar of `members` ((source, name in the archive)) at `path`, at gzip's fastest level: the archives
    hold routing profiles written at the end of a GPU run, where tarfile's default level costs far more time than
    its smaller archives save (docs/quality.md); they stay within the device tool's 16 MiB a file."""
    with atomic_path(path) as tmp, tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
        for source, arcname in members:
            if source.exists():
                tar.add(source, arcname=arcname)


def write_outputs(data: Path, work: Path, out: Path, size: str, timings: dict, problems: list[str]) -> dict:
    """`quality_results.json` (every result in `work` of this study's variants) and the archives, in `out`."""
    import torch

    current = {v.name: current_result(work, v.name) for v in variants_of(size)}  # each result file read once
    base_log = json.loads((work / "base" / "train_log.json").read_text()) if (work / "base" / "train_log.json").is_file() else {}
    base_log.pop("log_history", None)
    results = {
        "base": base_log,
        "base_fingerprint": base_fingerprint(work) if base_done(work) else None,
        "base_kernels": base_kernels_file(work).read_text().strip() if base_kernels_file(work).is_file() else None,
        "base_routing": json.loads((work / "base.json").read_text()) if (work / "base.json").is_file() else None,
        "tasks": json.loads((work / "tasks" / "tasks.json").read_text()) if (work / "tasks" / "tasks.json").is_file() else None,
        "variants": [result for result in current.values() if result is not None],
        "missing": [n for n, result in current.items() if result is None or "error" in result],
        "timings_s": timings,
        "problems": problems,
        "settings": settings(size),
        "data": json.loads((data / "data.json").read_text()),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or ["cpu"],
        "software": software_versions(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "quality_results.json", results)
    if (work / "base" / "loss_curve.png").is_file():
        shutil.copy(work / "base" / "loss_curve.png", out / "loss_curve.png")
    for split in ("train", "heldout"):  # two archives: 16 MiB is the most one returned file may hold
        profiles = [(p, f"profiles/{p.name}") for p in sorted((work / "profiles").glob(f"{split}_*.safetensors"))]
        _tar(out / f"profiles_{split}.tar.gz", profiles)
    _tar(out / "placements.tar.gz", [(placement_file(work, d), placement_file(work, d).name) for d in settings(size)["device_limits"]])
    _tar(out / "tasks.tar.gz", [(work / "tasks", "tasks")])
    _tar(out / "logs.tar.gz", [(work / "logs", "logs")])
    return results


def software_versions() -> dict[str, str]:
    """The versions of what the results depend on: a GPU machine's image pins none of them."""
    import datasets
    import lm_eval
    import pyarrow
    import torch
    import transformers

    return {module.__name__: module.__version__ for module in (torch, transformers, pyarrow, datasets, lm_eval)}


def study_env(work: Path) -> dict:
    """The workers' environment: offline, one datasets cache for all, one CPU thread each, unbuffered, and a failing
    worker's whole traceback in its log (`OCCULT_DEBUG`), not one line."""
    return {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(work / "hf_datasets"), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", DEBUG_ENV: "1"}  # fmt: skip


#: the share of a GPU's memory the study's workers may hold together (the rest: allocator fragmentation)
GPU_MEMORY_SHARE = 0.95


def gpu_capacity_gib(gpus: list[str | None]) -> dict[str, float]:
    """GPU index -> the GiB the study's workers may hold on it together (none on the CPU)."""
    import torch

    return {gpu: GPU_MEMORY_SHARE * torch.cuda.get_device_properties(int(gpu)).total_memory / 2**30 for gpu in gpus if gpu is not None}


def read_earlier(path: Path, size: str) -> dict:
    """An earlier run's `quality_results.json` to take variants from (`adopt`), checked before any job starts: the
    same study size, and a base model that it names."""
    from occult_hf.utils.strict_json import read_json_file

    results = read_json_file(path, "an earlier quality study's results")
    if not isinstance(results, dict) or not isinstance(results.get("variants"), list):
        raise ValueError(f"quality study: {path} is not a quality_results.json (no list of variants)")
    theirs = results.get("settings", {}).get("size") if isinstance(results.get("settings"), dict) else None
    if theirs != size:
        raise ValueError(f"quality study: {path} is a {theirs!r} study's results, this is the {size!r} study")
    if not results.get("base_fingerprint"):
        raise ValueError(f"quality study: {path} names no base model (base_fingerprint): its variants cannot be matched to this study's")
    return results


def adopt(results: dict, path: Path, work: Path, size: str) -> list[str]:
    """Take the finished variants of an earlier run (`read_earlier`) into `work` when it trained the same base model
    (`base_fingerprint`), else a ValueError naming both; variants `work` has already are kept. Returns the names taken."""
    ours = base_fingerprint(work)
    if results["base_fingerprint"] != ours:
        raise ValueError(
            f"quality study: {path} was run on another base model (fingerprint {results['base_fingerprint'][:16]}, this work "
            f"directory's {ours[:16]}): its variants cannot join this study. The base job is repeatable on one GPU kind and "
            f"software: pre-train from the same prepared data there, or leave --earlier out and run every variant here"
        )
    study = {v.name for v in variants_of(size)}
    taken = []
    for row in results["variants"]:
        name = row.get("variant")
        if name in study and "error" not in row and row.get("base_fingerprint") == ours and not finished(work, name):
            result_file(work, name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(result_file(work, name), row)
            taken.append(name)
    return taken


def pipeline(data: Path, work: Path, out: Path, size: str, budget_s: float, stall_s: float = 90.0,
             slots_per_gpu: int | None = None, names: list[str] | None = None, earlier: tuple[Path, ...] = (),
             deterministic_base: bool = True) -> int:  # fmt: skip
    """The base job, then every variant not yet finished, as supervised workers (module docstring); `earlier`: results
    of earlier runs on the same base model whose variants this one takes instead of running them (`adopt`);
    `deterministic_base`: False pre-trains with PyTorch's default kernels (`base_job`).

    Returns 0 when every variant of the study has its result, 2 when some are left for another run of
    the same command; raises `SystemExit` (status 1) naming every job that failed or stalled.
    """
    import torch

    if earlier and not deterministic_base:
        raise ValueError("quality study: --earlier takes variants of another machine's run of the same base model, which "
                         "only the deterministic base job trains again: leave out --default-kernels or --earlier")
    start = time.time()
    deadline = start + budget_s
    try:
        import occult_hf.eval  # noqa: F401  (every variant is scored through lm-eval: fail now, not after pre-training)
    except ImportError as error:
        raise SystemExit(f"quality study: {error} (on a machine without them, carry their wheels: docs/quality.md, 'Before the device calls')") from error
    from occult_hf.training import PreparedData

    print(f"[pipeline] {' '.join(f'{name} {version}' for name, version in software_versions().items())}", flush=True)
    prepared = PreparedData(data)  # a directory that is not prepared data is an error naming it, before any job starts
    earlier_results = {path: read_earlier(path, size) for path in earlier}
    claim_work_dir(work, size, prepared.meta.get("settings"))
    s = settings(size)
    gpus = [str(i) for i in range(torch.cuda.device_count())] or [None]
    env = study_env(work)
    common = ["-m", "occult_hf.eval.studies.quality", "--data", str(data), "--work", str(work), "--size", size]
    timings: dict[str, float] = {}
    if base_done(work):
        print(f"[pipeline] the base job finished in an earlier run ({work / 'base'})", flush=True)
    else:
        base_args = [*common, "--stage", "base", *([] if deterministic_base else ["--default-kernels"])]
        (outcome,) = run_jobs([Job("base", base_args, work / "logs" / "base.txt")], [gpus[0]],
                              deadline=deadline, stall_s=stall_s, env=env, prefix="[pipeline]")  # fmt: skip
        timings["base"] = outcome.wall_s
        if outcome.status == "cut":  # its pre-training resumes from its last checkpoint (`pretrain`) in the next run
            write_outputs(data, work, out, size, timings, [])
            print(f"[pipeline] the base job was cut by the deadline ({outcome.describe()}): run the same command again to continue", flush=True)
            return 2
        if not outcome.ok:
            write_outputs(data, work, out, size, timings, [outcome.describe()])
            raise SystemExit(f"quality study: the base job did not finish ({outcome.describe()}); its log: {work / 'logs' / 'base.txt'}")
    print(f"[pipeline] base model {base_fingerprint(work)[:16]}", flush=True)
    for path, results in earlier_results.items():
        taken = adopt(results, path, work, size)
        print(f"[pipeline] took {len(taken)} variant(s) of {path} (the same base model)", flush=True)
    study = [v.name for v in variants_of(size)]
    unknown = sorted(set(names or []) - set(study))
    if unknown:
        raise ValueError(f"quality study: variant(s) {unknown} are not part of the {size} study; its variants are {study}")
    todo = [n for n in (names or study) if not finished(work, n)]
    print(f"[pipeline] {len(study) - len(todo) if names is None else len(names) - len(todo)} variant(s) already done, {len(todo)} to run", flush=True)
    slots = [gpu for _ in range(slots_per_gpu or s["slots"]) for gpu in gpus]  # interleaved: the first jobs spread over the GPUs
    t = time.time()
    outcomes = run_jobs(pack_jobs(todo, common, work, size), slots, deadline=deadline, stall_s=stall_s, env=env, prefix="[pipeline]",
                        capacity_gib=gpu_capacity_gib(gpus))  # fmt: skip
    timings["variants"] = round(time.time() - t, 1)
    problems = [o.describe() for o in outcomes if o.status in ("failed", "stalled")]
    problems += [f"{n}: {result['error']}" for n in todo if (result := current_result(work, n)) is not None and "error" in result]
    results = write_outputs(data, work, out, size, timings, problems)
    left = [n for n in results["missing"] if names is None or n in names]
    print(f"[pipeline] this run took {time.time() - start:.0f} s; {len(study) - len(results['missing'])} of {len(study)} variants done; "
          f"results in {out / 'quality_results.json'}", flush=True)  # fmt: skip
    if problems:
        raise SystemExit("quality study: " + str(len(problems)) + " job(s) or variant(s) did not deliver:\n  " + "\n  ".join(problems))
    if left:
        print(f"[pipeline] {len(left)} variant(s) left ({', '.join(left)}): run the same command again to continue", flush=True)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, type=Path, help="prepared data (occult train --prepare-only)")
    parser.add_argument("--work", required=True, type=Path, help="scratch directory (checkpoints, results; a later run resumes from it)")
    parser.add_argument("--out", type=Path, default=Path("quality_out"), help="results directory")
    parser.add_argument("--size", choices=sorted(SIZES), default="study", help="study (GPUs, the default), cpu (the tiny recipe) or micro (the test)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds from the start after which every job still running is cut (its variants are left for the next run)")
    parser.add_argument("--stall", type=float, default=90.0, help="seconds without a new log line after which a job is killed")
    parser.add_argument("--per-gpu", type=int, default=None, help="worker processes sharing one GPU (or the CPU); default: the size's")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the study's variants (default: all)")
    parser.add_argument("--earlier", type=Path, action="append", default=[],
                        help="an earlier run's quality_results.json (another machine's): its variants join this run's when both "
                             "trained the same base model (repeatable; checked by its fingerprint); repeatable")
    parser.add_argument("--default-kernels", action="store_true",
                        help="pre-train with PyTorch's default kernels: about 1.35x faster than the deterministic ones, but not "
                             "repeatable, so every variant must run on this machine (no --earlier from another)")
    parser.add_argument("--stage", choices=["base", "variants"], default=None, help="(internal) one job")
    parser.add_argument("--names", default="", help="(internal) the variants of this worker")
    args = parser.parse_args(argv)
    if args.stage == "base":
        base_job(args.data, args.work, args.size, deterministic=not args.default_kernels)
    elif args.stage == "variants":
        worker(args.names.split(","), args.data, args.work, args.size)
    else:
        names = args.variants.split(",") if args.variants else None
        return pipeline(args.data, args.work, args.out, args.size, args.budget, args.stall, args.per_gpu, names, tuple(args.earlier),
                        deterministic_base=not args.default_kernels)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.quality", main))
