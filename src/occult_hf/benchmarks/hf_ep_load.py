"""Peak host and GPU memory per rank while loading an MoE checkpoint under expert parallelism, by path.

    torchrun --nproc-per-node 4 -m occult_hf.benchmarks.hf_ep_load --out DIR     # CPU (gloo) or GPUs (NCCL)

Rank 0 writes an OLMoE checkpoint whose routed experts are `--expert-mb` MB in fp32 (16 experts, 2
layers, hidden 256; the expert width sized to that) and every rank loads it, once per case:

- `hf_ep_contiguous`: `from_pretrained(..., distributed_config=DistributedConfig(ep_size=D, fsdp_size=D,
  ep_implementation="occult"))`: transformers reads each rank's contiguous share of the experts from
  the safetensors files (shard-on-read);
- `hf_ep_placement`: the same with `occult_config=OccultConfig(placement=<a shuffled equal-capacity
  placement>)`: then the expert rows move between the ranks into placement order;
- `occult_config`: `from_pretrained(..., occult_config=OccultConfig(placement=...))` under a plain process
  group (occult_hf's own EP path; on GPUs with `device_map={"": "cuda:<local rank>"}`): each rank reads
  only the experts its placement puts on it (`occult_hf.hf.loading`); the full expert tensors stay on the
  meta device;
- `full_model`: `from_pretrained(..., occult_config=None)` (on GPUs with the same `device_map`): the whole
  model on every rank, what a rank would hold without expert parallelism (the baseline).

With CUDA (`torchrun` on GPUs: NCCL, rank r on `cuda:<local rank>`) the table also gives, per rank,
`torch.cuda.max_memory_allocated` during the load (after `reset_peak_memory_stats`) minus what was
allocated before, and what stays allocated after it.

Per rank: the peak resident set during the load (`VmHWM` after resetting it through
`/proc/self/clear_refs`, Linux only) minus the resident set before it, and what stays resident
afterwards (anonymous memory, and file pages of the memory-mapped checkpoint). One rank's share of the
experts is `expert MB / D`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.arguments import positive_float
from occult_hf.utils.tables import markdown_table

CASES = ("hf_ep_contiguous", "hf_ep_placement", "occult_config", "full_model")
NUM_EXPERTS, LAYERS, HIDDEN = 16, 2, 256


def _status_mb() -> dict[str, float]:
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key] = int(value.split()[0]) / 1024
    return values


def _checkpoint(expert_mb: float, rank: int) -> tuple[str, int]:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    width = max(8, int(expert_mb * 2**20 / (LAYERS * NUM_EXPERTS * 3 * HIDDEN * 4)))
    holder = [tempfile.mkdtemp(prefix="occult_hf_ep_load_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if rank == 0:
        config = OlmoeConfig(
            vocab_size=128, hidden_size=HIDDEN, intermediate_size=width, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=4, num_experts=NUM_EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        OlmoeForCausalLM(config).save_pretrained(holder[0])
    dist.barrier()
    return holder[0], width


def _placement(world: int):
    from occult_hf import Placement

    base = np.arange(NUM_EXPERTS) * world // NUM_EXPERTS
    maps = {layer: np.random.default_rng(3 + layer).permutation(base).tolist() for layer in range(LAYERS)}
    return Placement(NUM_EXPERTS, world, maps, {"method": "shuffled"})


def _gpu() -> torch.device | None:
    """This rank's GPU under torchrun on CUDA machines (`cuda:<LOCAL_RANK>`), else None."""
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return None
    return torch.device("cuda", int(os.environ["LOCAL_RANK"]))


def measure(case: str, path: str, world: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from occult_hf import OccultConfig

    gpu = _gpu()
    device_map = None if gpu is None else {"": gpu}
    gc.collect()
    if gpu is not None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(gpu)
        gpu_before = torch.cuda.memory_allocated(gpu)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current resident set
    before = _status_mb()
    if case == "occult_config":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, occult_config=OccultConfig(placement=_placement(world)), device_map=device_map
        )
    elif case == "full_model":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, occult_config=None, device_map=device_map)
    else:
        config = DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation="occult")
        placement = _placement(world) if case == "hf_ep_placement" else "contiguous"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=config, occult_config=OccultConfig(placement=placement)
        )
    gc.collect()
    after = _status_mb()
    row = {
        "case": case,
        "peak_mb": after["VmHWM"] - before["VmRSS"],
        "anon_mb": after["RssAnon"] - before["RssAnon"],
        "file_mb": after["RssFile"] - before["RssFile"],
    }
    if gpu is not None:
        row["gpu_peak_mb"] = (torch.cuda.max_memory_allocated(gpu) - gpu_before) / 2**20
        row["gpu_after_mb"] = (torch.cuda.memory_allocated(gpu) - gpu_before) / 2**20
    del model
    gc.collect()
    dist.barrier()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--expert-mb", type=positive_float, default=384.0, help="fp32 size of all routed experts")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--out", default="occult_bench", help="directory for hf_ep_load.md and hf_ep_load.json (default: ./occult_bench)")
    args = parser.parse_args(argv)

    import occult_hf  # noqa: F401  (registers ep_implementation="occult")

    gpu = _gpu()
    if gpu is not None:
        torch.cuda.set_device(gpu)
    dist.init_process_group("gloo" if gpu is None else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    path, width = _checkpoint(args.expert_mb, rank)
    expert_mb = LAYERS * NUM_EXPERTS * 3 * HIDDEN * width * 4 / 2**20
    rows = [measure(case, path, world) for case in args.cases]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        lines = [
            f"{world} ranks, experts {expert_mb:.0f} MB (fp32), one rank's share {expert_mb / world:.0f} MB, "
            f"checkpoint {sum(f.stat().st_size for f in Path(path).glob('*.safetensors')) / 2**20:.0f} MB",
            "",
        ]
        header = ["case", "host peak during load, MB (max over ranks)", "in shares", "host resident after: anon / file MB",
                  "GPU max_memory_allocated during load, MB, per rank", "in shares (max)", "GPU allocated after, MB, per rank"]  # fmt: skip
        cases = []
        share = expert_mb / world
        for index, case in enumerate(args.cases):
            per_rank = [g[index] for g in gathered]
            peak = max(r["peak_mb"] for r in per_rank)
            anon = max(r["anon_mb"] for r in per_rank)
            mapped = max(r["file_mb"] for r in per_rank)
            gpu_cells = ["-", "-", "-"]
            if "gpu_peak_mb" in per_rank[0]:
                gpu_peak = [r["gpu_peak_mb"] for r in per_rank]
                gpu_cells = [
                    " / ".join(f"{v:.0f}" for v in gpu_peak),
                    f"{max(gpu_peak) / share:.1f}",
                    " / ".join(f"{r['gpu_after_mb']:.0f}" for r in per_rank),
                ]
            cases.append([case, f"{peak:.0f}", f"{peak / share:.1f}", f"{anon:.0f} / {mapped:.0f}", *gpu_cells])
        text = "\n".join([*lines, markdown_table(header, cases)])
        print(text, flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "hf_ep_load.md", text + "\n")
        atomic_write_text(out / "hf_ep_load.json", json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
