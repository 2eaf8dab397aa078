"""One model alone in its process: the static-cache `generate()` step of occult tracked, occult untracked or stock.

`profile_decode.py tracking` times several models in turns in one process, where they share one CUDA-graph tree
manager (one per device): the outputs a tracked model keeps alive are then live across the other models' replays too.
Here each process holds one model, so a tracked step is compared with an untracked one without that sharing.
`python docs/device/tracking_alone.py {tracked,untracked,stock}` (MODEL as in profile_decode.py) prints the ms per step
of five rounds (each the median of two `generate()` pairs, as `occult bench decode`).
"""

import copy
import os
import statistics
import sys

import torch

from occult_hf import apply_occult, track_routing
from occult_hf.benchmarks.decode import FULL_LAYERS, time_step
from occult_hf.benchmarks.model import build_model, model_config

STEPS, ROUNDS = 33, 5


def main() -> None:
    variant = sys.argv[1]
    name = os.environ.get("MODEL", "olmoe-1b-7b")
    config = model_config(name, FULL_LAYERS[name])
    model = build_model(config, torch.device("cuda"), torch.bfloat16)
    if variant != "stock":
        model = apply_occult(copy.deepcopy(model), {"num_devices": 1})
        track_routing(model, variant == "tracked")
    prompt = torch.randint(0, config.vocab_size, (1, 128), device="cuda")
    walls = [time_step(model, prompt, STEPS, "static", repeats=2)[0] for _ in range(ROUNDS)]
    rounds = " / ".join(f"{w:.2f}" for w in walls)
    print(f"alone {name} {variant}: median {statistics.median(walls):.2f} ms per step ({rounds})", flush=True)


if __name__ == "__main__":
    main()
