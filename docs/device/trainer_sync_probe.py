"""What does `Trainer` add to the quality study's pre-training step? Its per-step NaN/inf check of the loss.

The study's base job (`occult_hf.training.train`, the `study_long` recipe: 64 x 512 tokens, bf16 autocast, AdamW)
ran at 0.27 s a step on the H200 where the bare step takes 0.19 s (docs/device/finetune_speed_probe.py --setting
pretrain). `TrainingArguments.logging_nan_inf_filter` (on by default) asks `torch.isnan(loss) or torch.isinf(loss)`
after every step: a host read of the loss, so the host waits for the GPU at every step and then launches the next
step's kernels while the GPU idles. This probe times the same Trainer run (random tokens, `--steps` steps, the
study's logging interval) with the filter on and off, in fresh processes, and prints a table: seconds per step over
the steps after the first `--skip` (the host waits for the GPU only at those two points).

    python docs/device/trainer_sync_probe.py [--steps 60] [--skip 10]
    python docs/device/trainer_sync_probe.py --recipe tiny --steps 6 --skip 2 --cpu    # a check of the script
"""

import argparse
import subprocess
import sys
import time


def child(recipe_name: str, nan_inf_filter: bool, steps: int, skip: int, device: str) -> None:
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from occult_hf.training import get_recipe
    from occult_hf.training.train import PackedWindows, build_model

    recipe = get_recipe(recipe_name)
    batch = recipe.batch_size if device == "cuda" else 2
    windows = torch.randint(3, recipe.vocab_size, (batch * (steps + 1), recipe.seq_len)).numpy()
    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (skip, steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()

    model = build_model(recipe)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=recipe.learning_rate,
                                 max_grad_norm=1.0, logging_steps=max(1, 1300 // 100), save_strategy="no", report_to="none",
                                 bf16=recipe.bf16 and device == "cuda", use_cpu=device == "cpu", dataloader_num_workers=0,
                                 disable_tqdm=True, logging_nan_inf_filter=nan_inf_filter)  # fmt: skip
        Trainer(model=model, args=args, train_dataset=PackedWindows(windows), callbacks=[Clock()]).train()
    print(f"RESULT {(marks[steps] - marks[skip]) / (steps - skip):.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="study_long")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--cpu", dest="device", action="store_const", const="cpu", default="cuda")
    args = parser.parse_args()
    rows = []
    for nan_inf_filter in (True, False):
        command = [sys.executable, __file__, "--child", args.recipe, str(int(nan_inf_filter)), str(args.steps), str(args.skip), args.device]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line.split() for line in done.stdout.splitlines() if line.startswith("RESULT")]
        seconds = f"{float(lines[0][1]):.3f}" if lines else "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:160]
        rows.append(f"| {nan_inf_filter} | {seconds} |")
        print(rows[-1], flush=True)
    print(f"\n{args.recipe}, {args.device}, steps {args.skip + 1}-{args.steps}\n\n| logging_nan_inf_filter | s/step |\n|---|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        name, nan_inf_filter, steps, skip, device = sys.argv[2:7]
        child(name, nan_inf_filter == "1", int(steps), int(skip), device)
    else:
        main()
