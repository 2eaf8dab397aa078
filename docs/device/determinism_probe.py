"""Is the quality study's pre-training bitwise repeatable on one GPU kind?

The study's base model (docs/quality.md) lives only on the device machine that trained it, so a study longer than one
session's device time cannot go on in the next session unless the next session can train the very same model again.
This probe trains the `study_long` recipe's model (stock `OlmoeForCausalLM`, bf16 autocast, AdamW, as `occult train`
does) for a few steps on fixed random tokens, twice, each in a fresh process, and compares a hash of every weight:
first as PyTorch runs by default, then as the study's base job runs (`quality.repeatable`: deterministic algorithms and
cuBLAS's fixed workspace).
It prints, per mode, the two hashes, whether they are equal, the ms per step, and an error where an operation has no
deterministic implementation.

    python docs/device/determinism_probe.py [STEPS]      # default 8
"""

import hashlib
import os
import subprocess
import sys
import time


def train_and_hash(steps: int) -> None:
    import torch

    from occult_hf.training import get_recipe
    from occult_hf.training.train import build_model

    recipe = get_recipe("study_long")
    model = build_model(recipe).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(3, recipe.vocab_size, (recipe.batch_size, recipe.seq_len), generator=generator).cuda()
    start = None
    for step in range(steps):
        if step == 2:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / (steps - 2)
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    print(f"RESULT {digest.hexdigest()[:16]} {ms:.1f} loss {loss.item():.6f}", flush=True)


def run(steps: int, deterministic: bool) -> str:
    env = {**os.environ}
    if deterministic:
        env.update(OCCULT_PROBE_DETERMINISTIC="1")
    done = subprocess.run([sys.executable, __file__, "--child", str(steps)], env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return lines[0].removeprefix("RESULT ")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        if os.environ.get("OCCULT_PROBE_DETERMINISTIC"):
            from occult_hf.eval.studies.quality import repeatable

            repeatable()  # the study's own setting, so the probe measures what the base job runs
        return train_and_hash(int(sys.argv[2]))
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for deterministic in (False, True):
        first, second = run(steps, deterministic), run(steps, deterministic)
        same = first.split()[0] == second.split()[0] and not first.startswith("failed")
        label = "deterministic algorithms" if deterministic else "default"
        print(f"{label}: run 1 {first} | run 2 {second} | bitwise equal: {same}", flush=True)


if __name__ == "__main__":
    main()
