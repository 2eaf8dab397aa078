"""What every row of `occult bench paper` shares: the ranks, the device, the waits, the reductions over ranks and
the rows written so far (`Context`), and an occult_hf model's mean CT."""

from __future__ import annotations

import gc
import time

import numpy as np
import torch
import torch.distributed as dist

from occult_hf.benchmarks.ep import max_and_mean
from occult_hf.benchmarks.paper_models import DTYPES
from occult_hf.benchmarks.paper_results import save_results
from occult_hf.benchmarks.paper_rows import FINETUNE_ROWS, PREFILL_ROWS, PaperRow


class Context:
    """What every row needs: the ranks, the device, the host-side group for waits, and the output."""

    def __init__(self, args, rank: int, world: int, device) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        #: the weights' dtype (`--dtype`; auto: bf16 on GPU, fp32 on CPU, where the exact rows are compared to 1e-5)
        self.dtype = DTYPES[getattr(args, "dtype", "auto")] or (torch.bfloat16 if self.cuda else torch.float32)
        # a rank that waits while another works waits on the host (gloo), not in a spinning NCCL kernel
        self.host_group = dist.new_group(backend="gloo") if dist.is_initialized() and self.cuda else None
        self.rows: list[PaperRow] = []
        self.progress = None
        self.placements: dict = {}  # model name -> the Placement its placed rows use (planned once per run)
        self.started = time.perf_counter()
        #: the row keys to run (`--rows`; default every row)
        self.wanted = set(args.rows) if getattr(args, "rows", None) else {key for key, _ in (*PREFILL_ROWS, *FINETUNE_ROWS)}

    def wants(self, *keys: str) -> bool:
        """Whether any of `keys` is a row to run."""
        return any(key in self.wanted for key in keys)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.host_group)

    def log(self, message: str) -> None:
        if self.rank == 0:
            (self.progress.write if self.progress is not None else print)(message)

    def add(self, row: PaperRow) -> None:
        self.rows.append(row)
        state = "ran" if row.ran else f"not run: {row.reason}"
        elapsed = time.perf_counter() - self.started
        self.log(f"[{elapsed:6.0f} s] {row.experiment} {row.model} {row.key}: {state}" + (f", {row.ms:.1f} ms" if row.ran else ""))
        if self.progress is not None:
            self.progress.update(1)
        if self.rank == 0:  # md and JSON after every row (a run cut at its time limit keeps them); the plot per model
            save_results(self.rows, self.args, self.world, self.device, plot_too=False)

    def save(self) -> None:
        """Write every output, the plot included (after each model's experiment and at the end)."""
        if self.rank == 0 and self.rows:
            save_results(self.rows, self.args, self.world, self.device)

    def free(self) -> None:
        """Give a dropped model's GPU memory back before the next row (on a CPU nothing: a full `gc.collect`
        costs a second there with transformers and peft imported, and tiny models need no room)."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self, set_aside_gib: float = 0.0) -> list[float]:
        """Peak GiB allocated on every rank's GPU since the last reset, less `set_aside_gib` that the row does
        not use (the stock model kept for the next rows); rank order, [] on CPU."""
        if not self.cuda:
            return []
        peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30 - set_aside_gib
        mine = torch.tensor([peak_gib], dtype=torch.float64, device=self.device)
        if not dist.is_initialized():
            return [mine.item()]
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        return [round(g.item(), 2) for g in gathered]

    def mean(self, value: float) -> float:
        return max_and_mean(value, self.device)[1]

    def max(self, value: float) -> float:
        return max_and_mean(value, self.device)[0]


def last_mean_ct(model, world: int) -> float:
    """Mean CT over the MoE layers of an occult_hf model's last forward (this rank's tokens)."""
    from occult_hf.metrics import mean_ct
    from occult_hf.moe import OccultMoE

    values = [
        mean_ct(m.last_topk_ids_Tk.cpu().numpy(), m.layout.device_of_E.cpu().numpy(), world)
        for m in model.modules()
        if isinstance(m, OccultMoE) and m.last_topk_ids_Tk is not None
    ]
    return float(np.mean(values)) if values else float("nan")
