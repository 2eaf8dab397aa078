"""One model alone in its process: the static-cache `generate()` step of occult tracked, occult untracked or stock.

`profile_decode.py tracking` times several models in turns in one process, where they share one CUDA-graph tree
manager (one per device): the outputs a tracked model keeps alive are then live across the other models' replays too.
Here each process holds one model, so a tracked step is compared with an untracked one without that sharing.
`python docs/device/tracking_alone.py {tracked,untracked,stock}` (MODEL as in profile_decode.py) prints the ms per step
of five rounds (each the median of two `generate()` pairs, as `occult bench decode`), then the graph replays and the
host ranges of one profiled `generate()` (`profile_decode.profiled_static_generate`), the CPUs the process may run
on and the configs occult's autotuned expert kernels chose in it (each process tunes its own): one process's step fell
at 2.7-2.8 ms and another's at 3.6-3.8 ms, tracked or not, and these say which part moved (kernel time, if the tuner
chose differently; the GPU's idle time, if the host did; run it under `taskset -c N` to pin it).
"""

import copy
import os
import statistics
import sys

import torch

from occult_hf import apply_occult, track_routing
from occult_hf.benchmarks.decode import FULL_LAYERS, time_step
from occult_hf.benchmarks.model import build_model, model_config
from occult_hf.kernels.triton_expert_mlp import _CHOSEN  # the configs this process's autotuner chose
from profile_decode import graph_replays, profiled_static_generate  # this script's sibling (docs/device/)

STEPS, ROUNDS = 33, 5


def one_model(variant: str):
    """`(name, model, prompt)`: MODEL's full configuration in bf16 on the GPU as `variant` ("tracked", "untracked" or
    "stock") and a batch-1 prompt of 128 random tokens."""
    name = os.environ.get("MODEL", "olmoe-1b-7b")
    config = model_config(name, FULL_LAYERS[name])
    model = build_model(config, torch.device("cuda"), torch.bfloat16)
    if variant != "stock":
        model = apply_occult(copy.deepcopy(model), {"num_devices": 1})
        track_routing(model, variant == "tracked")
    return name, model, torch.randint(0, config.vocab_size, (1, 128), device="cuda")


def main() -> None:
    variant = sys.argv[1]
    name, model, prompt = one_model(variant)
    walls = [time_step(model, prompt, STEPS, "static", repeats=2).ms_per_step for _ in range(ROUNDS)]
    rounds = " / ".join(f"{w:.2f}" for w in walls)
    print(f"alone {name} {variant}: median {statistics.median(walls):.2f} ms per step ({rounds})", flush=True)
    from torch.profiler import ProfilerActivity

    run, ranges = profiled_static_generate(model, prompt, ProfilerActivity.CPU, ProfilerActivity.CUDA)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"alone {name} {variant}: {graph_replays(run)}; {ranges}; {len(cpus)} CPUs allowed ({cpus[0]}-{cpus[-1]})", flush=True)
    for (kernel, key), (_, config, _) in _CHOSEN.items():
        print(f"alone {name} {variant}: tuned {kernel.base_fn.__name__} {key} -> {config}", flush=True)


if __name__ == "__main__":
    main()
