"""Does the Trainer's step of the quality study's base job wait for the GPU at every step? (one GPU)

`occult_hf.training.train` pre-trains `study_long` through `Trainer` at about 0.27 s a step on an H200 where a bare
loop of the same model, optimizer and batch takes 0.19 s (`finetune_speed_probe.py --setting pretrain`). One
candidate: a blocking copy of each batch to the GPU synchronises the stream, so the host would enqueue a step only
once the GPU has finished the one before. This times `train` on the prepared `study_long` data as it runs
(`non_blocking=True`) and with the copy forced back to blocking, each in a fresh process, in turns (the answer:
docs/quality.md).

    python docs/device/trainer_step_probe.py --data .devdata/study_long/data [--steps 150] [--order nb,blocking,nb]
    python docs/device/trainer_step_probe.py --data runs/tiny/data --recipe tiny --steps 25   # a CPU check of the script
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the steps before timing starts (allocator, cuDNN and kernel warm-up)
WARMUP = 20


def child(data: Path, recipe_name: str, steps: int, copy: str) -> None:
    import accelerate.data_loader
    import torch
    from transformers import TrainerCallback

    from occult_hf.training import get_recipe, train

    if copy == "blocking":
        original = accelerate.data_loader.send_to_device

        def blocking(tensor, device, non_blocking=False, **kwargs):
            return original(tensor, device, non_blocking=False, **kwargs)

        accelerate.data_loader.send_to_device = blocking

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (WARMUP, steps):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                setattr(self, "start" if state.global_step == WARMUP else "end", time.perf_counter())

    timer = StepTimer()
    recipe = get_recipe(recipe_name).replace(max_steps=steps, time_budget_s=None)
    with tempfile.TemporaryDirectory() as out:
        train(recipe, data, Path(out), trainer_callbacks=[timer], eval_tokens=4096, progress=False, save=False)
    per_step = (timer.end - timer.start) / (steps - WARMUP)
    tokens = recipe.batch_size * recipe.seq_len
    print(f"RESULT {copy} {per_step:.4f} s/step {tokens / per_step:,.0f} tokens/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="prepared study_long data (occult train --prepare-only)")
    parser.add_argument("--recipe", default="study_long", help="the recipe the data was prepared for")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--order", default="nb,blocking,nb", help="comma-separated: nb (as train runs) or blocking")
    parser.add_argument("--child", choices=["nb", "blocking"], default=None, help="(internal) one timing")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.child:
        child(args.data, args.recipe, args.steps, args.child)
        return 0
    for copy in args.order.split(","):
        result = subprocess.run([sys.executable, __file__, "--data", str(args.data), "--recipe", args.recipe, "--steps", str(args.steps),
                                 "--child", copy],
                                capture_output=True, text=True)  # fmt: skip
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
        print(lines[0] if lines else f"{copy}: failed (exit {result.returncode}): {result.stderr.strip()[-400:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
