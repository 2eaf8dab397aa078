"""Train an `OlmoeForCausalLM` from scratch with `Trainer` (what `occult train` runs).

The run: seed everything, build the recipe's model, pack the prepared training streams of the
recipe's domains into `[B, S]` windows, shuffle them with the seed, and train with `Trainer`
(AdamW, warm-up then cosine decay to 10%, gradient clipping at 1.0, the Trainer's progress bar unless
HF's switches or `progress=False` turn it off). Under a `time_budget_s` the run measures its step time
after a few steps and shortens the schedule to the steps that fit (the cosine then ends at the last step that runs, rather than being cut). The
checkpoint is a plain transformers directory (weights in safetensors, fp32) with the tokenizer,
`recipe.json`, `train_log.json` (loss per logged step, tokens seen, wall time, held-out perplexity
per domain) and `loss_curve.png`.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..utils.atomic import atomic_save_figure, atomic_write_json, atomic_write_text
from ..utils.checks import check_count
from ..utils.progress import progress_enabled
from ..utils.strict_json import read_json_file
from .data import PreparedData, pack
from .recipes import Recipe


class PackedWindows(torch.utils.data.Dataset):
    """`[B, S]` token windows as causal-LM examples (`labels` = `input_ids`; the model shifts)."""

    def __init__(self, windows_BS: np.ndarray) -> None:
        self.windows_BS = torch.from_numpy(np.ascontiguousarray(windows_BS, dtype=np.int64))

    def __len__(self) -> int:
        return self.windows_BS.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids_S = self.windows_BS[index]
        return {"input_ids": ids_S, "labels": ids_S}


def training_windows(data: PreparedData, recipe: Recipe, domains: tuple[str, ...] | None = None) -> np.ndarray:
    """The shuffled `[B, S]` windows of the training streams of `domains` (default: the recipe's)."""
    windows = [pack(data.stream("train", d), recipe.seq_len) for d in (domains or recipe.train_domains)]
    windows_BS = np.concatenate(windows)
    order = np.random.default_rng(recipe.seed).permutation(len(windows_BS))
    return windows_BS[order]


def with_data_domains(recipe: Recipe, data: PreparedData) -> Recipe:
    """`recipe` with its domains named (`recipe.json` then says what trained): every domain of `data` where the
    recipe names none; a named domain that `data` lacks is an error."""
    if recipe.train_domains is None:
        return recipe.replace(train_domains=tuple(data.domains))
    missing = [d for d in recipe.train_domains if d not in data.domains]
    if missing:
        raise ValueError(
            f"recipe {recipe.name}: train_domains {missing} are not in the prepared data {os.fspath(data.path)!r} "
            f"(its domains: {data.domains}); give --train-domains"
        )
    return recipe


class _Schedule:
    """Warm-up then cosine to `floor` of the peak over `total` steps; `total` may shrink during the run."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _time_budget_callback(schedule: _Schedule, budget_s: float | None, probe_steps: int = 10):
    from transformers import TrainerCallback

    class TimeBudget(TrainerCallback):
        """Fit the run into `budget_s`: after `probe_steps` steps, shorten the schedule to what fits."""

        def __init__(self) -> None:
            self.start = None

        def on_step_end(self, args, state, control, **kwargs):
            if budget_s is None:
                return
            if state.global_step in (1, 1 + probe_steps) and torch.cuda.is_available():
                torch.cuda.synchronize()  # the host runs ahead of the GPU: time the steps the GPU has done
            if state.global_step == 1:
                self.start = time.perf_counter()  # after the first (compiling, warming) step
            elif state.global_step == 1 + probe_steps:
                per_step = (time.perf_counter() - self.start) / probe_steps
                fits = 1 + probe_steps + int((budget_s - per_step * (1 + probe_steps)) / per_step)
                schedule.total = max(probe_steps + 2, min(schedule.total, fits))
            if state.global_step >= schedule.total:
                control.should_training_stop = True

    return TimeBudget()


def last_saved_checkpoint(folder: Path) -> str | None:
    """The newest `checkpoint-N` in `folder` whose save finished: the `Trainer` writes `trainer_state.json` after the
    weights, optimizer, schedule and RNG states, so a save cut by a kill (a call's deadline) has none and is passed by."""
    from transformers.trainer_utils import sort_checkpoints

    saved = [c for c in sort_checkpoints(str(folder)) if os.path.isfile(os.path.join(c, "trainer_state.json"))]
    return saved[-1] if saved else None


def checkpoint_step(checkpoint: str | os.PathLike) -> int:
    """The step of a `Trainer` checkpoint directory, `checkpoint-N`."""
    return int(Path(checkpoint).name.split("-")[-1])


def build_model(recipe: Recipe):
    """A freshly initialised `OlmoeForCausalLM` of the recipe (seeded)."""
    from transformers import OlmoeForCausalLM, set_seed

    set_seed(recipe.seed)
    return OlmoeForCausalLM(recipe.model_config())


def windows_fed(steps: int, num_windows: int, batch_size: int) -> int:
    """Training windows the Trainer fed in `steps` steps of `batch_size`: each epoch ends in a short batch of the
    windows left (its dataloader keeps the last batch), so `steps * batch_size` over-counts whenever `num_windows` is
    not a multiple of the batch. Counted here rather than by the Trainer, which reads a count back from the device
    every step."""
    steps_per_epoch = -(-num_windows // batch_size)
    epochs, steps_in_last = divmod(steps, steps_per_epoch)
    return epochs * num_windows + min(steps_in_last * batch_size, num_windows)


def train(
    recipe: Recipe,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    eval_tokens: int = 16_384,
    progress: bool = True,
    base_model: str | os.PathLike | None = None,
    train_domains: tuple[str, ...] | None = None,
    trainer_callbacks: list | None = None,
    model=None,
    logging_steps: int | None = None,
    save: bool = True,
    checkpoint_steps: int | None = None,
) -> dict:
    """Train `recipe` on the prepared data in `data_dir`; write the checkpoint to `out_dir`; return the log.

    `base_model` (or an already built `model`) continues from a checkpoint instead of from scratch
    (the quality study's fine-tunes); `train_domains` overrides the recipe's domains; `save=False`
    writes only the logs and the loss curve.

    `checkpoint_steps` writes a `Trainer` checkpoint (weights, optimizer, schedule, RNG states, step) to
    `out_dir/trainer` every that many steps, and a call that finds one there resumes from the newest: a run cut by a
    deadline goes on where it stopped instead of from scratch, to the same weights as one uninterrupted run (the
    data order is fixed by the recipe's seed; a recipe with a time budget is refused). The checkpoints are removed once
    the run has finished.

    A finished run already in `out_dir` is replaced (`publish`): the quality study re-runs a variant's fine-tune into
    its directory. `occult train` refuses one unless given `--overwrite` (`finished_run`).
    """
    from transformers import OlmoeForCausalLM, Trainer, TrainingArguments, set_seed

    # read only after training: checked before it (a numpy integer, as a script computes it, is a count too)
    eval_tokens = int(eval_tokens) if isinstance(eval_tokens, np.integer) else eval_tokens
    check_count("train eval_tokens", eval_tokens, 1, " (held-out tokens per domain)")
    data = PreparedData(data_dir)
    recipe = with_data_domains(recipe, data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if data.meta["vocab_size"] > recipe.vocab_size:
        raise ValueError(f"recipe {recipe.name}: vocab_size ({recipe.vocab_size}) is below the prepared tokenizer's ({data.meta['vocab_size']})")
    if checkpoint_steps and recipe.time_budget_s is not None:
        raise ValueError(f"train: checkpoint_steps needs a fixed number of steps; recipe {recipe.name} stops after its time budget "
                         f"({recipe.time_budget_s} s), which shortens the schedule by the machine's speed and a resumed run cannot "
                         f"reproduce: replace(time_budget_s=None)")  # fmt: skip
    set_seed(recipe.seed)
    if checkpoint_steps and model is not None:
        raise ValueError("train: checkpoint_steps builds the model itself (from the recipe, base_model or the checkpoint it "
                         "resumes): pass base_model, not model")  # fmt: skip
    checkpoints = out / "trainer"
    resume_from = last_saved_checkpoint(checkpoints) if checkpoint_steps else None
    if resume_from:
        # the weights through from_pretrained: Trainer's own resume loads the checkpoint's state dict as saved, whose
        # per-expert keys leave a transformers 5.x MoE model's fused expert weights as they were (missing keys)
        model = OlmoeForCausalLM.from_pretrained(resume_from)
    elif model is None:
        model = OlmoeForCausalLM.from_pretrained(base_model) if base_model is not None else build_model(recipe)
    windows_BS = training_windows(data, recipe, train_domains)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        model = model.cuda()
    elif recipe.hidden_size <= 256:
        # small matrices: thread hand-offs cost more than they save, and on a shared CPU busy-waiting
        # threads can make a step 10x slower
        torch.set_num_threads(1)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.1
    )
    schedule = _Schedule(recipe.warmup_steps, recipe.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    args = TrainingArguments(
        output_dir=str(checkpoints),
        max_steps=recipe.max_steps,
        per_device_train_batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        max_grad_norm=1.0,
        logging_steps=logging_steps or max(1, recipe.max_steps // 100),
        save_strategy="steps" if checkpoint_steps else "no",
        save_steps=checkpoint_steps,
        save_total_limit=1,
        report_to="none",
        seed=recipe.seed,
        data_seed=recipe.seed,
        bf16=recipe.bf16 and use_cuda,
        torch_compile=recipe.torch_compile,
        # the filter reads the loss on the host after every step (`torch.isnan(loss) or ...`), so the host waits for the
        # GPU at every step; a NaN loss is then logged as NaN, and the weights are the same
        logging_nan_inf_filter=False,
        # a blocking copy of a batch to the GPU synchronises the stream, so the host would wait for the previous step
        # to end before it enqueues the next; the batches are pinned (Trainer's default), so they copy without waiting
        accelerator_config={"non_blocking": True},
        use_cpu=not use_cuda,
        dataloader_num_workers=0,
        disable_tqdm=not progress_enabled(progress),
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=PackedWindows(windows_BS),
        optimizers=(optimizer, scheduler),
        callbacks=[_time_budget_callback(schedule, recipe.time_budget_s), *(trainer_callbacks or [])],
    )
    for callback in trainer_callbacks or []:
        if hasattr(callback, "attach"):
            callback.attach(trainer)
    if resume_from:
        print(f"[train] resuming from {resume_from}", flush=True)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from)
    wall_s = time.perf_counter() - start
    model = trainer.model
    model.eval()
    history = [h for h in trainer.state.log_history if "loss" in h]
    steps = trainer.state.global_step
    log = {
        "recipe": recipe.to_dict(),
        "steps": steps,
        "tokens_seen": windows_fed(steps, len(windows_BS), recipe.batch_size) * recipe.seq_len,
        "train_windows": int(len(windows_BS)),
        "wall_s": round(wall_s, 1),
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "loss_history": [{"step": h["step"], "loss": h["loss"]} for h in history],
        "log_history": trainer.state.log_history,
        "final_loss": float(np.mean([h["loss"] for h in history[-3:]])) if history else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "resumed_at_step": checkpoint_step(resume_from) if resume_from else None,
    }
    from .evaluate import perplexity

    log["heldout_perplexity"] = {
        d: perplexity(model, data.windows("heldout", d, recipe.seq_len, max_tokens=eval_tokens)) for d in data.domains
    }
    publish(out, model if save else None, data, recipe, log)
    if checkpoint_steps:
        shutil.rmtree(checkpoints, ignore_errors=True)
    return log


def publish(out: Path, model, data: PreparedData, recipe: Recipe, log: dict) -> None:
    """Write a finished run into `out`: the model and tokenizer (unless `model` is None), `recipe.json`, the loss curve,
    and `train_log.json` last, after removing the one an earlier run left.

    `train_log.json` is the mark of a finished run (`finished_run`, and the quality study's `base_done`): with the old
    one gone before the first new file and the new one written last, a crash part-way leaves a directory without a log,
    never a new model beside the old log. This is simpler than staging the files in a directory and renaming it over
    `out`, which also holds the prepared data (`OUT/data`) and the `Trainer` checkpoints; and it removes nothing until
    the training has ended, so a run that fails before then leaves the earlier run whole."""
    (out / "train_log.json").unlink(missing_ok=True)
    if model is not None:
        # saved for inference, as released MoE checkpoints are: router logits in every output would also break
        # transformers' batched, padded generate (its balance loss on the padded mask)
        model.config.output_router_logits = False
        model.save_pretrained(out)
        data.tokenizer().save_pretrained(out)
    atomic_write_text(out / "recipe.json", recipe.to_json())
    plot_loss_curve(log, out / "loss_curve.png")
    atomic_write_json(out / "train_log.json", log)


def finished_run(out_dir: str | os.PathLike) -> str | None:
    """What the finished run in `out_dir` is, in words ("train_log.json: steps 3, final loss 7.593"), or None when
    `out_dir` holds none (`publish` writes `train_log.json` last). `occult train` refuses to replace one without
    `--overwrite`: it trains from scratch, so a re-run would silently throw the earlier model away."""
    path = Path(out_dir) / "train_log.json"
    if not path.exists():
        return None
    try:
        log = read_json_file(path, "training log", allow_nan=True)
    except (OSError, ValueError) as error:
        return f"train_log.json, not readable: {error}"
    if not isinstance(log, dict):
        return "train_log.json, not a JSON object"
    loss = log.get("final_loss")
    shown_loss = f"{loss:.3f}" if isinstance(loss, (int, float)) and not isinstance(loss, bool) else repr(loss)
    return f"train_log.json: steps {log.get('steps')}, final loss {shown_loss}"


def plot_loss_curve(log: dict, path: str | os.PathLike) -> None:
    """Training loss against step (and tokens seen), with the held-out perplexities in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in log["loss_history"]]
    losses = [h["loss"] for h in log["loss_history"]]
    recipe = log["recipe"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(steps, losses)
    ax.set(xlabel=f"step ({recipe['batch_size']} x {recipe['seq_len']} tokens)", ylabel="training loss (LM + aux)")
    ax.grid(alpha=0.3)
    ppl = ", ".join(f"{d} {v:.1f}" for d, v in log.get("heldout_perplexity", {}).items())
    ax.set_title(f"recipe {recipe['name']}: {log['tokens_seen'] / 1e6:.2f}M tokens, {log['wall_s']:.0f} s on {log['device']}\n"
                 f"held-out perplexity: {ppl}", fontsize=8)  # fmt: skip
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)
    plt.close(fig)
