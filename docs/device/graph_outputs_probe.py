"""What keeping a per-layer tensor costs a CUDA-graphed step (`torch.compile(mode="reduce-overhead")`), by how it is kept.

A toy 16-layer model (each layer: a 256-wide linear, a softmax over 64 router logits, their top-8) runs one token per
call through CUDA-graph trees, as a decode step does, and the host waits for each call's output as transformers'
stop check does. Variants, each its own compiled model in one process, timed in turns:
  none          nothing kept;
  setattr       each layer stores its top-8 ids on itself (a graph output per layer);
  detached      the same, stored as `ids.detach()` (an output that aliases a graph intermediate, as `OccultMoE`'s);
  viewed        the same, stored as `ids.view(-1, TOP_K)` (another alias of an intermediate);
  stacked       the layers' ids leave the graph as one stacked tensor, stored once on the model;
  buffer        each layer copies its ids into its own buffer (a mutated static input per layer, no output);
  counters      each layer adds its per-expert counts into two buffers of its own (as `ExchangeStats.record`);
  shared        the layers add their counts into rows of one model-wide buffer.
Prints the median wall microseconds per call over rounds (the GPU's work included: the counters add kernels), and the
cProfile of the detached and setattr variants' calls.
Needs a GPU: `python docs/device/graph_outputs_probe.py`.
"""

import cProfile
import pstats
import statistics
import time

import torch
from torch import nn

LAYERS, WIDTH, EXPERTS, TOP_K = 16, 256, 64, 8
CALLS, ROUNDS = 300, 7
VARIANTS = ("none", "setattr", "detached", "viewed", "stacked", "buffer", "counters", "shared")


class Layer(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.last = None
        self.register_buffer("kept", torch.zeros(1, TOP_K, dtype=torch.int64))
        self.register_buffer("sent", torch.zeros(EXPERTS, dtype=torch.int64))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x, shared_counts, index):
        ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1).indices
        if self.variant == "setattr":
            self.last = ids
        elif self.variant == "detached":
            self.last = ids.detach()
        elif self.variant == "viewed":
            self.last = ids.view(-1, TOP_K)
        elif self.variant == "buffer":
            self.kept.copy_(ids)
        elif self.variant == "counters":
            self.sent.add_(torch.zeros_like(self.sent).index_add_(0, ids.flatten(), torch.ones_like(ids.flatten())))
            self.forwards.add_(1)
        elif self.variant == "shared":
            shared_counts[index].index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        return x + self.proj(x) * (ids[:, :1] + 1).to(x.dtype) / EXPERTS, ids  # the ids feed the step, as a dispatch's


class Model(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.layers = nn.ModuleList(Layer(variant) for _ in range(LAYERS))
        self.register_buffer("shared_counts", torch.zeros(LAYERS, EXPERTS, dtype=torch.int64))
        self.routing = None

    def forward(self, x):
        ids = []
        for index, layer in enumerate(self.layers):
            x, layer_ids = layer(x, self.shared_counts, index)
            ids.append(layer_ids)
        if self.variant == "stacked":
            self.routing = torch.stack(ids)
        return x


def step(model, x):
    out = model(x)
    return bool((out.sum() > 1e9).item())  # the host waits for the step, as generate()'s stop check


def timed_calls(model, x) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        step(model, x)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, WIDTH, device="cuda")
    models = {}
    for variant in VARIANTS:
        model = Model(variant).cuda().eval()
        models[variant] = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for compiled in models.values():
            for _ in range(5):
                step(compiled, x)
        walls = {variant: [] for variant in VARIANTS}
        for _ in range(ROUNDS):
            for variant, compiled in models.items():
                walls[variant].append(timed_calls(compiled, x))
        for variant in VARIANTS:
            rounds = " ".join(f"{w:.0f}" for w in walls[variant])
            print(f"{variant:9s} median {statistics.median(walls[variant]):7.1f} us a call (rounds {rounds})", flush=True)
        for variant in ("detached", "setattr"):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(CALLS):
                step(models[variant], x)
            profiler.disable()
            print(f"-- {variant}: cProfile of {CALLS} calls by own time", flush=True)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
