"""The quality, drift and transfer runs on a trained MoE (DESIGN.md §9; docs/quality.md).

One command runs everything that needs the model (on GPUs when there are any; `--micro` runs the
same code path on CPU in a minute, with the tiny recipe and a few steps, to test it):

    python -m occult_hf.eval.studies.quality --data DATA --work WORK --out OUT [--micro]

1. **pretrain** (GPU 0): the `study` recipe from scratch on python_docs + kernel_docs
   (`occult_hf.training.train`); python_stdlib_code stays new to the model.
2. **base** (GPU 0): per domain, routing profiles of the training split (planning) and of the
   held-out split (measuring) for the transfer study; held-out perplexity; learned-routing
   structure against a random router; the `refined` placement at D=4 planned on the training
   profile of the fine-tuning domain B (python_stdlib_code), which every fine-tune below uses.
3. **variants** (one worker process per variant, several per GPU at once: a fine-tune of this small
   model is bound by kernel launches, so processes sharing a GPU fill each other's gaps): fine-tune on B, for the same steps, data
   order and seed: `plain` (exact Occult dispatch at D=4: the same function as the model, with
   `OccultCallback`'s drift watch), and pruning-aware with `OccultCallback` for `N_d` in {1, 2, 3},
   `router` and `similarity` modes; and the same pruning with no fine-tuning (`noft-*`). For each:
   held-out perplexity on B and A (python_docs, forgetting) and C, and on held-out B: CT, remote
   copies, bytes per token, removed routing weight; for the fine-tuned models also the drift
   numbers (the placement planned before fine-tuning against one re-planned on the fine-tuned
   routing, both measured on held-out B) and what the callback's drift watch logged.

Every stage runs as a worker process under `occult_hf.eval.studies.jobs.run_jobs`: a worker whose log
stops growing for `--stall` seconds is killed and reported, and at `--budget` seconds after the start
every worker still running is killed, so the command always returns with what it made, exits non-zero
and names each stalled, failed or cut worker with its last log line. (On the H200 run of 2026-11-30
the fine-tuning workers printed nothing for 200 s and the parent waited on them without a limit; the
probable cause was the first training step of `expert_backend="auto"`, i.e. the Triton kernels, in
fp32: every new rows-per-expert bucket autotunes and compiles every Hopper config of the four
forward and backward kernels, and fp32 IEEE dots compile slowly. That was not confirmed on the GPU.)

The Occult blocks use `expert_backend="torch"` (fp32 weights through PyTorch GEMMs); the
environment variable `OCCULT_STUDY_EXPERT_BACKEND` selects another backend (`auto`, `triton`).

Results land in OUT: `quality_results.json`, the loss curve, and `profiles.tar.gz` (the transfer
study's profiles). The CPU side (`python -m occult_hf.eval.studies.report_quality`) turns them into
the tables and plots of docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

#: the fine-tuning domain (B), the forgetting domain (A) and the third one (C)
FT_DOMAIN, FORGET_DOMAIN, THIRD_DOMAIN = "python_stdlib_code", "python_docs", "kernel_docs"
#: logical devices of the pruning study
STUDY_DEVICES = 4
PRUNED = [(mode, n) for n in (2, 1, 3) for mode in ("router", "similarity")]
#: the `refined` planner's options in every plan of the study (placement, re-plans, drift watch):
#: 8 search rounds on 4,096 sampled tokens instead of 40 on 16,384 (measured: 1.5 s instead of 40 s
#: per E=64 layer on a shared CPU, held-out CT within 1% on a synthetic E=64 k=8 profile)
REFINED = {"search_rounds": 8, "max_sample_tokens": 4096}


def settings(micro: bool | str) -> dict:
    """Sizes of the run: `study` (GPUs), `cpu` (the tiny recipe, a real but small study on CPU) or
    `micro` (a few steps: the CPU test of the path); `micro=True` means `micro`.

    `variant_min_s`: a fine-tune / no-fine-tune variant does not start with less time than this left
    before the budget. The `study` sizes fit the whole command (pretrain, base, 13 variants) into one
    5-minute call on two H200s: pretraining stops at its time budget; a fine-tune is 60 steps of
    32 x 512 tokens.
    """
    size = "micro" if micro is True else ("study" if micro is False else micro)
    if size == "micro":
        return {"recipe": "tiny", "pretrain": {"max_steps": 4, "batch_size": 4, "time_budget_s": None},
                "ft_steps": 3, "ft_batch": 4, "ft_lr": 3e-4, "eval_tokens": 1024, "profile_tokens": 1024,
                "drift_tokens": 1024, "drift_every": 3, "variant_min_s": (0.0, 0.0), "size": size}  # fmt: skip
    if size == "cpu":
        return {"recipe": "tiny", "pretrain": {"time_budget_s": None},
                "ft_steps": 60, "ft_batch": 8, "ft_lr": 1e-3, "eval_tokens": 16_384, "profile_tokens": 8192,
                "drift_tokens": 8192, "drift_every": 60, "variant_min_s": (0.0, 0.0), "size": size}  # fmt: skip
    return {"recipe": "study", "pretrain": {"time_budget_s": 95.0},
            "ft_steps": 60, "ft_batch": 32, "ft_lr": 3e-4, "eval_tokens": 32_768, "profile_tokens": 32_768,
            "drift_tokens": 16_384, "drift_every": 60, "variant_min_s": (60.0, 25.0), "size": size}  # fmt: skip


def _recipe(work: Path, micro: bool):
    from occult_hf.training import get_recipe

    s = settings(micro)
    recipe = get_recipe(s["recipe"], **s["pretrain"])
    if s["recipe"] == "tiny":  # the study recipe already leaves the fine-tuning domain out
        recipe = recipe.replace(train_domains=(FORGET_DOMAIN, THIRD_DOMAIN))
    return recipe


def _write_json(path: Path, data) -> None:
    from occult_hf.utils.atomic import atomic_write_json

    atomic_write_json(path, data)


# ----- 1. pretrain ------------------------------------------------------------------------------
def pretrain(data: Path, work: Path, micro: bool) -> None:
    from occult_hf.training import train

    recipe = _recipe(work, micro)
    log = train(recipe, data, work / "base", eval_tokens=settings(micro)["eval_tokens"], progress=True)
    print(json.dumps({k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "heldout_perplexity")}), flush=True)


def _load(path: Path):
    import torch
    from transformers import OlmoeForCausalLM

    model = OlmoeForCausalLM.from_pretrained(path)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 fine-tunes and evaluations, TF32 matmuls
        model = model.cuda()
    return model.eval()


# ----- 2. base ------------------------------------------------------------------------------------
def base(data_dir: Path, work: Path, micro: bool) -> None:
    from occult_hf.placement import plan_placement
    from occult_hf.profile import RoutingProfile
    from occult_hf.training import PreparedData
    from occult_hf.training.evaluate import capture_routing, routing_structure

    s = settings(micro)
    data = PreparedData(data_dir)
    recipe = _recipe(work, micro)
    model = _load(work / "base")
    prof_dir = work / "profiles"
    prof_dir.mkdir(exist_ok=True)
    result = {"structure": {}}
    for domain in data.domains:
        print(f"[base] routing profiles and structure of {domain}", flush=True)
        for split in ("train", "heldout"):
            windows = data.windows(split, domain, recipe.seq_len, max_tokens=s["profile_tokens"])
            profile = RoutingProfile.collect(model, windows.tolist(), batch_size=16, max_length=recipe.seq_len,
                                             sample_size=s["profile_tokens"], progress=False,
                                             source=f"study base model, {split} split of {domain}")  # fmt: skip
            profile.save(prof_dir / f"{split}_{domain}.safetensors")
        routing = capture_routing(model, data.windows("heldout", domain, recipe.seq_len, max_tokens=s["profile_tokens"]))
        result["structure"][domain] = routing_structure(routing, recipe.num_experts)
    print(f"[base] planning the refined placement (D={STUDY_DEVICES}) on the training split of {FT_DOMAIN}", flush=True)
    plan_profile = RoutingProfile.load(prof_dir / f"train_{FT_DOMAIN}.safetensors")
    placement = plan_placement(plan_profile, STUDY_DEVICES, "refined", progress=False, **REFINED)
    placement.meta["planned_on"] = f"base model, training split of {FT_DOMAIN}"
    placement.save(work / "placement_ft.json")
    _write_json(work / "base.json", result)


# ----- 3. variants --------------------------------------------------------------------------------
def _occult_model(work: Path, checkpoint: Path, mode: str | None, n_d: int | None):
    from occult_hf.config import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = _load(checkpoint)
    config = OccultConfig(
        placement=str(work / "placement_ft.json"),
        num_devices=STUDY_DEVICES,
        prune=mode,
        max_devices_per_token=n_d,
        profile=str(work / "profiles" / f"train_{FT_DOMAIN}.safetensors") if mode == "similarity" else None,
        expert_backend=os.environ.get("OCCULT_STUDY_EXPERT_BACKEND", "torch"),
    )
    return apply_occult(model, config)


def measure(model, data, recipe, max_tokens: int) -> dict:
    """Perplexity on held-out A, B, C; on held-out B the dispatched routing's CT, remote copies,
    bytes per token (bf16, one direction, per MoE layer) and removed weight; the dispatched ids."""
    import torch

    from occult_hf.hf.apply import occult_modules
    from occult_hf.metrics import communication_volume
    from occult_hf.pruning import pruners_of
    from occult_hf.training.evaluate import perplexity

    out = {"perplexity": {d: perplexity(model, data.windows("heldout", d, recipe.seq_len, max_tokens=max_tokens)) for d in data.domains}}
    blocks = {module.layer_idx if hasattr(module, "layer_idx") else i: module for i, module in enumerate(occult_modules(model).values())}
    captured: dict[int, list] = {layer: [] for layer in blocks}
    handles = [b.register_forward_hook(lambda m, i, o, layer=layer: captured[layer].append(m.last_topk_ids_Tk.cpu()))
               for layer, b in blocks.items()]  # fmt: skip
    for pruner in pruners_of(model).values():
        pruner.pop_stats()
    from occult_hf.training.evaluate import mean_nll

    mean_nll(model, data.windows("heldout", FT_DOMAIN, recipe.seq_len, max_tokens=max_tokens))
    for handle in handles:
        handle.remove()
    removed = {layer: p.pop_stats()["removed_weight_fraction"] for layer, p in pruners_of(model).items()}
    first = next(iter(blocks.values()))
    per_layer = {}
    for layer, chunks in captured.items():
        ids_Nk = torch.cat(chunks).numpy()
        device_of_E = first.layout.device_of_E.cpu().numpy() if layer not in blocks else blocks[layer].layout.device_of_E.cpu().numpy()
        volume = communication_volume(ids_Nk, device_of_E, STUDY_DEVICES)
        per_layer[layer] = {"ct": volume.ct_mean, "remote_copies": volume.remote_copies_mean, "ids": ids_Nk}
    hidden = model.config.hidden_size
    out["ct"] = float(np.mean([v["ct"] for v in per_layer.values()]))
    out["remote_copies"] = float(np.mean([v["remote_copies"] for v in per_layer.values()]))
    out["bytes_per_token"] = out["remote_copies"] * hidden * 2
    out["removed_weight"] = float(np.mean(list(removed.values()))) if removed else 0.0
    out["dispatched_ids"] = {layer: v["ids"] for layer, v in per_layer.items()}
    return out


def _profile_from_ids(ids_by_layer: dict, num_experts: int, source: str):
    import torch

    from occult_hf.profile import RoutingProfile
    from occult_hf.profile.stats import LayerAccumulator

    layers = {}
    for layer, ids_Nk in ids_by_layer.items():
        acc = LayerAccumulator(num_experts, ids_Nk.shape[1], sample_size=None)
        acc.update(torch.from_numpy(np.ascontiguousarray(ids_Nk)))
        layers[int(layer)] = acc.to_layer_routing()
    return RoutingProfile(num_experts, next(iter(ids_by_layer.values())).shape[1], layers, meta={"source": source})


def drift(work: Path, model, data, recipe, measured: dict, max_tokens: int) -> dict:
    """CT on held-out B of the placement planned before fine-tuning vs one re-planned on the
    fine-tuned model's routing of B's training split (both by `refined`, D=4)."""
    from occult_hf.metrics import evaluate_placement
    from occult_hf.placement import Placement, plan_placement

    before = Placement.load(work / "placement_ft.json")
    train_ids = measure_ids(model, data.windows("train", FT_DOMAIN, recipe.seq_len, max_tokens=max_tokens))
    replanned = plan_placement(_profile_from_ids(train_ids, recipe.num_experts, "fine-tuned, B train"), STUDY_DEVICES, "refined", progress=False, **REFINED)
    held = _profile_from_ids(measured["dispatched_ids"], recipe.num_experts, "fine-tuned, B held-out")
    result = {}
    for name, placement in (("before", before), ("replanned", replanned)):
        metrics = evaluate_placement(held, placement)
        result[f"ct_{name}"] = float(np.mean([m.ct for m in metrics.values()]))
        result[f"balance_{name}"] = float(np.mean([m.balance for m in metrics.values()]))
    return result


def measure_ids(model, windows_BS) -> dict:
    """Dispatched expert ids per layer over `windows_BS` (through the Occult blocks)."""
    import torch

    from occult_hf.hf.apply import occult_modules
    from occult_hf.training.evaluate import mean_nll

    blocks = list(occult_modules(model).values())
    captured = {i: [] for i in range(len(blocks))}
    handles = [b.register_forward_hook(lambda m, i_, o, i=i: captured[i].append(m.last_topk_ids_Tk.cpu())) for i, b in enumerate(blocks)]
    mean_nll(model, windows_BS)
    for handle in handles:
        handle.remove()
    return {i: torch.cat(c).numpy() for i, c in captured.items()}


def variant(name: str, data_dir: Path, work: Path, micro: bool) -> dict:
    """Run one variant (`plain`, `router-2`, `noft-similarity-1`, ...) and return its numbers."""
    from occult_hf.hf.callback import OccultCallback
    from occult_hf.training import PreparedData, train

    s = settings(micro)
    data = PreparedData(data_dir)
    recipe = _recipe(work, micro)
    noft = name.startswith("noft-")
    spec = name[5:] if noft else name
    mode, n_d = (None, None) if spec == "plain" else (spec.rsplit("-", 1)[0], int(spec.rsplit("-", 1)[1]))
    print(f"[{name}] loading the base model (Occult blocks, D={STUDY_DEVICES}, prune={mode}, N_d={n_d})", flush=True)
    model = _occult_model(work, work / "base", mode, n_d)
    result = {"variant": name, "mode": mode, "max_devices_per_token": n_d, "fine_tuned": not noft}
    start = time.perf_counter()
    if not noft:
        print(f"[{name}] fine-tuning on {FT_DOMAIN}: {s['ft_steps']} steps x {s['ft_batch']} x {recipe.seq_len} tokens", flush=True)
        ft = recipe.replace(name=f"{recipe.name}-ft-{spec}", max_steps=s["ft_steps"], batch_size=s["ft_batch"],
                            learning_rate=s["ft_lr"], warmup_steps=max(1, s["ft_steps"] // 10), time_budget_s=None,
                            bf16=False)  # fmt: skip  (fp32 weights and activations through the Occult blocks)
        callback = OccultCallback(schedule_steps=s["ft_steps"] // 4 if mode else 0, check_every=s["drift_every"], per_layer=False,
                                  planner_options=REFINED)  # fmt: skip
        log = train(ft, data_dir, work / f"ft_{spec}", model=model, train_domains=(FT_DOMAIN,),
                    trainer_callbacks=[callback, _step_printer(name, s["ft_steps"])], eval_tokens=s["eval_tokens"], progress=False, save=False,
                    logging_steps=max(1, s["ft_steps"] // 10))  # fmt: skip
        result["train"] = {k: log[k] for k in ("steps", "tokens_seen", "wall_s", "final_loss", "loss_history")}
        result["callback_logs"] = [{k: v for k, v in h.items() if k.startswith("occult/") or k in ("step", "loss")}
                                   for h in log["log_history"] if any(k.startswith("occult/") for k in h)]  # fmt: skip
    print(f"[{name}] measuring perplexity, CT and removed weight", flush=True)
    measured = measure(model, data, recipe, s["eval_tokens"])
    if not noft:
        print(f"[{name}] drift: re-planning on the fine-tuned routing", flush=True)
        result["drift"] = drift(work, model, data, recipe, measured, s["drift_tokens"])
    measured.pop("dispatched_ids")
    result.update(measured)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def _step_printer(name: str, total: int, every: int | None = None):
    """A `TrainerCallback` printing `[name] step i/total loss ...` every few steps: the worker's heartbeat."""
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


def worker(name: str, data_dir: Path, work: Path, micro: bool, out_file: Path) -> None:
    """One variant in this process; its result (or its error) goes to `out_file`."""
    try:
        result = variant(name, data_dir, work, micro)
    except Exception as error:  # noqa: BLE001  (the error is the result: the pipeline reports it)
        import traceback

        traceback.print_exc()
        result = {"variant": name, "error": f"{type(error).__name__}: {error}"}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    _write_json(out_file, result)
    print(f"[{name}] done at {time.strftime('%H:%M:%S')}", flush=True)


# ----- the pipeline ---------------------------------------------------------------------------------
def variant_names() -> list[str]:
    """Every variant, in the order they start (most wanted first: a cut-off run keeps those)."""
    return ["plain"] + [f"{m}-{n}" for m, n in PRUNED] + [f"noft-{m}-{n}" for m, n in PRUNED]


def _assemble(data: Path, work: Path, out: Path, micro: bool, timings: dict, variants: list, problems: list[str]) -> None:
    """Write `quality_results.json` (again after each stage, so that a cut-off run keeps what it made)."""
    import torch

    base_log = json.loads((work / "base" / "train_log.json").read_text()) if (work / "base" / "train_log.json").is_file() else {}
    base_log.pop("log_history", None)
    results = {
        "base": base_log,
        "base_routing": json.loads((work / "base.json").read_text()) if (work / "base.json").is_file() else None,
        "variants": variants,
        "timings_s": timings,
        "problems": problems,
        "settings": settings(micro),
        "data": json.loads((data / "data.json").read_text()),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or ["cpu"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    _write_json(out / "quality_results.json", results)


def pipeline(data: Path, work: Path, out: Path, micro: bool, budget_s: float, stall_s: float = 90.0,
             per_gpu: int | None = None, names: list[str] | None = None) -> int:  # fmt: skip
    """The three stages as supervised worker processes (module docstring); returns the exit status.

    `per_gpu` workers share each GPU (default: all variants at once, spread over the GPUs; one on CPU).
    Raises `SystemExit` naming every stalled, failed or cut worker after writing what was made.
    """
    import torch

    from .jobs import Job, run_jobs

    start = time.time()
    deadline = start + budget_s
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    gpus = [str(i) for i in range(torch.cuda.device_count())] or [None]
    s = settings(micro)
    common = ["-m", "occult_hf.eval.studies.quality", "--data", str(data), "--work", str(work), "--size", s["size"]]
    timings: dict[str, float] = {}
    problems: list[str] = []
    for stage in ("pretrain", "base"):
        (outcome,) = run_jobs([Job(stage, [*common, "--stage", stage], out / f"log_{stage}.txt")], [gpus[0]],
                              deadline=deadline, stall_s=stall_s, prefix="[pipeline]")  # fmt: skip
        timings[stage] = outcome.wall_s
        if not outcome.ok:
            problems.append(outcome.describe())
            _assemble(data, work, out, micro, timings, [], problems)
            raise SystemExit(f"quality study: stage {stage} did not finish ({outcome.describe()}); "
                             f"its log: {out / f'log_{stage}.txt'}")  # fmt: skip
    _assemble(data, work, out, micro, timings, [], problems)
    shutil.copy(work / "base" / "loss_curve.png", out / "loss_curve.png")
    with tarfile.open(out / "profiles.tar.gz", "w:gz") as tar:
        tar.add(work / "profiles", arcname="profiles")
        tar.add(work / "placement_ft.json", arcname="profiles/placement_ft.json")
    names = names or variant_names()
    unknown = sorted(set(names) - set(variant_names()))
    if unknown:
        raise ValueError(f"quality study: unknown variant(s) {unknown}; the variants are {variant_names()}")
    if per_gpu is None:
        per_gpu = -(-len(names) // len(gpus)) if gpus[0] is not None else 1
    slots = [gpu for _ in range(per_gpu) for gpu in gpus]  # interleaved: the first jobs spread over the GPUs
    min_ft, min_noft = s["variant_min_s"]
    var_dir = work / "variants"
    var_dir.mkdir(exist_ok=True)
    jobs = [Job(name, [*common, "--stage", "variant", "--name", name, "--result", str(var_dir / f"{name}.json")],
                out / f"log_{name}.txt", min_time_s=min_noft if name.startswith("noft-") else min_ft)
            for name in names]  # fmt: skip
    t = time.time()
    outcomes = run_jobs(jobs, slots, deadline=deadline, stall_s=stall_s, prefix="[pipeline]")
    timings["variants"] = round(time.time() - t, 1)
    variants = []
    for outcome in outcomes:
        path = var_dir / f"{outcome.name}.json"
        if outcome.ok and path.is_file():
            result = json.loads(path.read_text())
            if "error" in result:
                problems.append(f"{outcome.name}: {result['error']}")
            variants.append(result)
        else:
            problems.append(outcome.describe())
            variants.append({"variant": outcome.name, "error": outcome.describe()})
    _assemble(data, work, out, micro, timings, variants, problems)
    print(f"[pipeline] done in {time.time() - start:.0f} s; results in {out / 'quality_results.json'}", flush=True)
    if problems:
        raise SystemExit("quality study: " + str(len(problems)) + " worker(s) did not deliver:\n  " + "\n  ".join(problems))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occult_hf.eval.studies.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, type=Path, help="prepared data (occult train --prepare-only)")
    parser.add_argument("--work", required=True, type=Path, help="scratch directory (checkpoints)")
    parser.add_argument("--out", type=Path, default=Path("quality_out"), help="results directory")
    parser.add_argument("--micro", action="store_true", help="tiny sizes on CPU: a test of the path")
    parser.add_argument("--size", choices=["study", "cpu", "micro"], default=None,
                        help="study (GPUs, the default), cpu (the tiny recipe on CPU) or micro (= --micro)")
    parser.add_argument("--budget", type=float, default=280.0,
                        help="seconds from the start after which every worker still running is killed (the run then "
                             "writes what it made and exits non-zero)")
    parser.add_argument("--stall", type=float, default=90.0, help="seconds without a new log line after which a worker is killed")
    parser.add_argument("--per-gpu", type=int, default=None, help="variant workers sharing one GPU (default: all at once)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(variant_names())}")
    parser.add_argument("--stage", choices=["pretrain", "base", "variant"], default=None, help="(internal) one stage")
    parser.add_argument("--name", default="", help="(internal) the variant of this worker")
    parser.add_argument("--result", type=Path, default=None, help="(internal) the worker's result file")
    args = parser.parse_args(argv)
    if args.size is not None:
        args.micro = {"study": False, "micro": True}.get(args.size, args.size)
    if args.stage is None:
        names = args.variants.split(",") if args.variants else None
        return pipeline(args.data, args.work, args.out, args.micro, args.budget, args.stall, args.per_gpu, names)
    if args.stage == "pretrain":
        pretrain(args.data, args.work, args.micro)
    elif args.stage == "base":
        base(args.data, args.work, args.micro)
    else:
        worker(args.name, args.data, args.work, args.micro, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
