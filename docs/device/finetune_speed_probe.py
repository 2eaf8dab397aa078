"""How fast could the quality study's GPU jobs run? Its fine-tunes, and the pre-training of its base model.

The quality study (docs/quality.md) fine-tunes the 218M `study_long` model in fp32 (TF32 matmuls) through the
`torch` expert backend, six processes at a time on one H200 under CUDA MPS: about 1 s per 32 x 512-token step each.
`--setting finetune` (the default) times the same step (a pruning-aware fine-tune: `apply_occult` with 8 logical
devices, router pruning to N_d=2, AdamW, random tokens, random weights: speed does not depend on what the router
learned) for each expert backend and precision, with K processes at once as the study runs them, and prints a table:
seconds per step (median over the processes), tokens per second of all K together, and the ratio to the first
configuration. `--setting pretrain` times the base job's step instead (64 x 512 tokens, bf16 autocast as the recipe's
Trainer, no pruning): BACKEND `stock` is the transformers model as the study pre-trains it, any other an
`apply_occult(num_devices=1)` model with that expert backend; `+compile` after the precision compiles the model
(`torch.compile(model)`, as `TrainingArguments(torch_compile=True)` does).

    python docs/device/finetune_speed_probe.py [--processes 6] [--steps 12] [--configs torch:fp32,triton:bf16,...]
    python docs/device/finetune_speed_probe.py --setting pretrain --processes 1 --configs stock:bf16,stock:bf16+compile,auto:bf16
    python docs/device/finetune_speed_probe.py --recipe tiny --processes 2 --steps 3 --cpu    # a check of the script

Start CUDA MPS first for K > 1 (docs/quality_h200.sh does, and says why).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {"finetune": "torch:fp32,torch:bf16,triton:fp32,triton:bf16,auto:bf16",
           "pretrain": "stock:bf16,stock:bf16+compile,auto:bf16,auto:bf16+compile"}
#: the study's own configuration of each setting, the table's reference
REFERENCE = {"finetune": ("torch", "fp32"), "pretrain": ("stock", "bf16")}
#: sequences per step: the study's fine-tune batch and the study_long recipe's (its own batch_size is the CPU check's)
BATCH = {"finetune": 32, "pretrain": 64}


def child(setting: str, recipe_name: str, backend: str, precision: str, steps: int, device: str) -> None:
    import torch

    import occult_hf
    from occult_hf.training import get_recipe
    from occult_hf.training.train import build_model

    torch.backends.cuda.matmul.allow_tf32 = True  # as the study's fine-tunes
    recipe = get_recipe(recipe_name)
    model = build_model(recipe).to(device).train()
    precision, compiled = precision.removesuffix("+compile"), precision.endswith("+compile")
    if setting == "finetune":
        config = occult_hf.OccultConfig(num_devices=8, prune="router", max_devices_per_token=2, expert_backend=backend)
    else:
        config = None if backend == "stock" else occult_hf.OccultConfig(num_devices=1, expert_backend=backend)
    if config is not None:
        occult_hf.apply_occult(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if compiled:
        model = torch.compile(model)
    batch = torch.randint(3, recipe.vocab_size, (BATCH[setting] if device == "cuda" else 2, recipe.seq_len), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")
    warmup, start = 2, None
    for step in range(warmup + steps):
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    print(f"RESULT {seconds:.4f} {batch.numel()}", flush=True)


def measure(args, backend: str, precision: str) -> tuple[list[float], int, str]:
    """`(seconds per step of each process, tokens per step of one, the first failure or "")` of K processes at once.

    Each process writes to files of its own, not to pipes: a pipe read only after the earlier processes end could
    fill and stall a process inside its timed steps."""
    command = [sys.executable, __file__, "--child", args.setting, args.recipe, backend, precision, str(args.steps), args.device]
    seconds, tokens, failure = [], 0, ""
    with tempfile.TemporaryDirectory() as folder:
        logs = [(open(f"{folder}/{i}.out", "w+"), open(f"{folder}/{i}.err", "w+")) for i in range(args.processes)]
        processes = [subprocess.Popen(command, stdout=out, stderr=err, text=True) for out, err in logs]
        deadline = time.monotonic() + args.timeout
        for process, (out, err) in zip(processes, logs):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                failure = failure or f"over {args.timeout} s"
            out.seek(0), err.seek(0)
            lines = [line.split() for line in out.read().splitlines() if line.startswith("RESULT")]
            if lines:
                seconds.append(float(lines[0][1]))
                tokens = int(lines[0][2])
            elif not failure:
                failure = (err.read().strip().splitlines() or [f"exit {process.returncode}"])[-1][:200]
            out.close(), err.close()
    return seconds, tokens, failure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="study_long")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--setting", choices=sorted(CONFIGS), default="finetune", help="which of the study's steps to time")
    parser.add_argument("--configs", help="BACKEND:PRECISION[+compile],... (default: the setting's in CONFIGS)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds the K processes of one configuration may take together (autotuning included)")
    parser.add_argument("--cpu", dest="device", action="store_const", const="cpu", default="cuda")
    args = parser.parse_args()
    args.configs = args.configs or CONFIGS[args.setting]
    print(f"{args.setting}, {args.recipe}, {args.processes} processes, {args.steps} timed steps each, {args.device}", flush=True)
    rows, reference = [], None
    for config in args.configs.split(","):
        backend, precision = config.split(":")
        started = time.perf_counter()
        seconds, tokens, failure = measure(args, backend, precision)
        if not seconds:
            rows.append(f"| {backend} | {precision} | - | - | - | {failure} |")
            continue
        step = statistics.median(seconds)
        throughput = args.processes * tokens / step
        reference = reference or (throughput if (backend, precision) == REFERENCE[args.setting] else None)
        ratio = f"{throughput / reference:.2f}x" if reference else "-"
        note = failure or f"{len(seconds)} processes, {time.perf_counter() - started:.0f} s in all"
        rows.append(f"| {backend} | {precision} | {step:.3f} | {throughput:,.0f} | {ratio} | {note} |")
        print(rows[-1], flush=True)
    print(f"\n| expert backend | precision | s/step (median) | tokens/s, all processes | vs {':'.join(REFERENCE[args.setting])} | note |")
    print("|---|---|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        setting, name, backend, precision, steps, device = sys.argv[2:8]
        child(setting, name, backend, precision, int(steps), device)
    else:
        main()
