"""`occult bench exchange`: the raw exchange between the ranks: per-call cost and per-byte rate.

Shape legend (docs/conventions.md): D ranks, U bytes of one row.

Launch with `torchrun --nproc-per-node D -m occult_hf.cli bench exchange`. For each volume per rank
(bytes sent to each other rank, `--sizes` in KiB) it times, with the ranks aligned by a barrier:

- `nccl a2a`: `all_to_all_single` with equal splits (NCCL), the reference rate;
- `nccl a2a graph`: the same captured in a CUDA graph and replayed (launch overhead removed);
- `symm_mem vdev` / `symm_mem vdev graph`: `torch.ops.symm_mem.all_to_all_vdev` on NVSHMEM symmetric
  buffers of rows of `--row-bytes`, the split sizes in device memory (skipped where NVSHMEM is
  unavailable; a failure is reported in the table, not raised).

A least-squares fit `time = a + bytes / rate` over the sizes gives the per-call cost `a` and the
per-byte rate of each transport.

`--model TRACE` runs no GPU: it *models* (does not measure) the exchange of one MoE layer at D = 2, 4
and 8 from a per-call cost and a per-byte rate (`--call-ms`, `--gbs`: the fit above) and the rows
that a routing trace sends between each pair of devices (T tokens per rank, contiguous and refined
placement, dedup and per_expert rows): per direction `time = call + max over ranks of the bytes it
sends to other ranks / rate`. It assumes each GPU's injection rate into the NVLink switch stays what
two GPUs measured, whatever D (the switch gives every GPU its full link bandwidth); the table says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.tables import markdown_table
from occult_hf.utils.arguments import non_negative_float, positive_float, positive_int
from occult_hf.benchmarks.ep import max_and_mean, timed

from occult_hf.utils.cuda_graph import capture

HELP = "raw exchange between ranks (NCCL all_to_all_single, NVSHMEM all_to_all_vdev): per-call cost and GB/s"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def needs_cuda(args: argparse.Namespace) -> bool:
    """`--model` models the exchange from a trace, on any machine; a measurement needs the GPUs."""
    return args.model is None


def _slowest_timed(fn, iterations: int, device) -> float:
    """`ep.timed` with three warm-up calls (NCCL's first calls set up channels), the slowest rank's figure."""
    return max_and_mean(timed(fn, iterations, device, warmup=3), device)[0]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """`(per-call ms, GB/s)` of `ms = a + bytes / rate` by least squares over `(bytes, ms)` points."""
    n = len(points)
    if n < 2:
        return float("nan"), float("nan")
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx else float("nan")
    return my - slope * mx, (1.0 / slope) / 1e6 if slope > 0 else float("nan")


def rows_between_devices(ids_Nk, device_of_E, num_devices: int, tokens: int, mode: str):
    """`[D, D]` rows rank s sends to device d (its window of `tokens` trace tokens, tiled), per the mode."""
    import numpy as np

    rows = np.zeros((num_devices, num_devices), dtype=np.int64)
    for rank in range(num_devices):
        index = (rank * tokens + np.arange(tokens)) % ids_Nk.shape[0]
        dest_Tk = np.asarray(device_of_E)[ids_Nk[index]]
        if mode == "dedup":
            hit_TD = np.zeros((tokens, num_devices), dtype=bool)
            np.put_along_axis(hit_TD, dest_Tk, True, axis=1)
            rows[rank] = hit_TD.sum(0)
        else:
            rows[rank] = np.bincount(dest_Tk.reshape(-1), minlength=num_devices)
    return rows


def exchange_model(args) -> str:
    """The modelled exchange table (see the module docstring); runs on the CPU."""
    import numpy as np

    from occult_hf.benchmarks.ep import load_trace, refined_placement
    from occult_hf.expert_shapes import SHAPES
    from occult_hf.placement import Placement

    ids_Nk = load_trace(args.model)
    top_k, num_experts = ids_Nk.shape[1], int(ids_Nk.max()) + 1
    shape = next((s for s in SHAPES.values() if (s.num_experts, s.top_k) == (num_experts, top_k)), None)
    if shape is None:  # the rows' width H comes from the model the trace was recorded on
        known = ", ".join(f"{name} (E={s.num_experts}, k={s.top_k})" for name, s in SHAPES.items())
        raise ValueError(f"--model {args.model!r}: its E={num_experts}, k={top_k} is none of the expert shapes whose row width is known: {known}")
    lines = [
        f"MODEL, not a measurement: T = {args.tokens} tokens per rank of the trace, H = {shape.hidden}, bf16 rows, "
        f"per call {args.call_ms} ms, {args.gbs} GB/s per rank (2-GPU fit), the same rate assumed at every D.",
        "",
    ]
    header = ["D", "placement", "mode", "CT", "rows to other devices per rank (max)", "MB sent per rank per direction (max)",
              "modelled ms, dispatch + combine", "fwd+bwd (x2)"]  # fmt: skip
    cells = []
    for num_devices in args.model_devices:
        placements = {"contiguous": Placement.contiguous(num_experts, num_devices, [0])}
        placements["refined"] = refined_placement(torch.as_tensor(ids_Nk[: args.tokens * num_devices]), shape, num_devices)
        for name, placement in placements.items():
            device_of_E = placement.device_of(0)
            for mode in ("per_expert", "dedup"):
                rows = rows_between_devices(ids_Nk, device_of_E, num_devices, args.tokens, mode)
                remote = rows.sum(1) - np.diag(rows)
                width = top_k if mode == "dedup" else 1
                dispatch_bytes = remote.max() * (shape.hidden * 2 + width * 6)  # bf16 x, int32 slot, bf16 weight
                combine_bytes = remote.max() * shape.hidden * 2
                ms = 2 * args.call_ms + (dispatch_bytes + combine_bytes) / (args.gbs * 1e9) * 1e3
                dedup_rows = rows_between_devices(ids_Nk, device_of_E, num_devices, args.tokens, "dedup")
                ct = dedup_rows.sum() / (num_devices * args.tokens)
                cells.append([num_devices, name, mode, f"{ct:.2f}", int(remote.max()), f"{dispatch_bytes / 1e6:.1f}", f"{ms:.2f}", f"{2 * ms:.2f}"])
    return "\n".join([*lines, markdown_table(header, cells)])


def require_process_group() -> None:
    """Exit with the launch line when no process group is set up: the exchange is between ranks, so a plain
    `occult bench exchange` (no torchrun) has nothing to measure and would fail on the missing group."""
    if not dist.is_initialized():
        raise SystemExit(
            "occult bench exchange: no process group: launch it under `torchrun --nproc-per-node D -m occult_hf.cli "
            "bench exchange`, or pass --model TRACE to model the exchange without one"
        )


def run(args: argparse.Namespace) -> int:
    from occult_hf.benchmarks.experts import machine_line

    if args.model:
        text = exchange_model(args)
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "exchange_model.md", text + "\n")
        return 0
    from occult_hf.dispatch.static import MIN_BUFFER_BYTES, enable_group, row_align, ensure_nvshmem_backend, all_to_all_vdev, nvshmem_usable, vdev_takes_in_out_splits

    from occult_hf.benchmarks.ep import init_from_torchrun

    rank, world, device = init_from_torchrun()
    require_process_group()
    group_name = dist.group.WORLD.group_name
    results: dict[str, list[tuple[int, float]]] = {}
    notes = []

    def record(name, peer_bytes, ms):
        results.setdefault(name, []).append((peer_bytes, ms))

    row_bytes = -(-args.row_bytes // row_align(world)) * row_align(world)
    symm = None
    if nvshmem_usable():
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            ensure_nvshmem_backend(device)
            enable_group(group_name)
            max_rows = max(max(args.sizes) * 1024 // row_bytes * world, -(-MIN_BUFFER_BYTES // row_bytes))
            symm = [symm_mem.empty(max_rows, row_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            splits = symm_mem.empty(world, dtype=torch.int64, device=device)
            out_splits = symm_mem.empty(3 if vdev_takes_in_out_splits() else 2, world, dtype=torch.int64, device=device)
            for t in (*symm, splits, out_splits):
                symm_mem.rendezvous(t, group_name)
        except Exception as error:  # noqa: BLE001 - the probe reports what failed
            notes.append(f"symm_mem set-up failed: {type(error).__name__}: {error}")
            symm = None
    else:
        notes.append("NVSHMEM symmetric memory is not available in this torch build")

    for kib in args.sizes:
        peer_bytes = kib * 1024
        send = torch.randint(0, 255, (peer_bytes * world,), dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)

        def nccl():
            dist.all_to_all_single(recv, send)

        record("nccl a2a", peer_bytes, _slowest_timed(nccl, args.iterations, device))
        try:
            record("nccl a2a graph", peer_bytes, _slowest_timed(capture(nccl, device, warmup=3)[0].replay, args.iterations, device))
        except Exception as error:  # noqa: BLE001
            notes.append(f"nccl graph capture at {kib} KiB failed: {type(error).__name__}: {error}")
        if symm is not None:
            rows = peer_bytes // row_bytes
            if rows == 0:
                continue
            splits.fill_(rows)
            inp, out = symm
            inp[: rows * world].copy_(torch.randint(0, 255, (rows * world, row_bytes), dtype=torch.uint8, device=device))

            def vdev():
                all_to_all_vdev(inp, out, splits, out_splits, group_name)

            try:
                record("symm_mem vdev", rows * row_bytes, _slowest_timed(vdev, args.iterations, device))
                if kib == args.sizes[0]:  # check the data once
                    expected = torch.empty(rows * world, row_bytes, dtype=torch.uint8, device=device)
                    dist.all_to_all_single(expected, inp[: rows * world].contiguous())
                    if not torch.equal(out[: rows * world], expected):
                        notes.append(f"symm_mem vdev at {kib} KiB: received rows differ from NCCL's")
                record("symm_mem vdev graph", rows * row_bytes, _slowest_timed(capture(vdev, device, warmup=3)[0].replay, args.iterations, device))
            except Exception as error:  # noqa: BLE001
                notes.append(f"symm_mem vdev at {kib} KiB failed: {type(error).__name__}: {error}")

    lines = []
    fits = {}
    for name, points in results.items():
        by_size = {b: t for b, t in points}
        cells = []
        for kib in args.sizes:
            match = [t for b, t in points if abs(b - kib * 1024) <= row_bytes]
            cells.append(f"{match[0] * 1e3:.0f} us / {(kib * 1024 * (world - 1)) / (match[0] / 1e3) / 1e9:.0f} GB/s" if match else "-")
        call_ms, rate = fit([(b * (world - 1), t) for b, t in by_size.items()])
        fits[name] = {"per_call_ms": call_ms, "gbs": rate, "points": points}
        lines.append([name, *cells, f"{call_ms:.4f}", f"{rate:.0f}"])
    table = markdown_table(["transport", *(f"{kib} KiB" for kib in args.sizes), "per-call ms (fit)", "GB/s (fit)"], lines)
    if rank == 0:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = f"`occult bench exchange`, {world} ranks, {stamp}, {machine_line(device)}; cells: time / GB/s sent to other ranks per rank"
        text = f"{header}\n\n{table}\n" + "".join(f"\n- {note}" for note in notes)
        print("\n" + text, flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / f"bench_exchange_{world}xcuda.md", text + "\n")
        atomic_write_text(out / f"bench_exchange_{world}xcuda.json", json.dumps({"header": header, "fits": fits, "notes": notes}, indent=1))
    dist.barrier()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", nargs="+", type=positive_int, default=[4, 64, 1024, 16384, 131072], help="KiB sent to each other rank (default: %(default)s)")
    parser.add_argument("--row-bytes", type=positive_int, default=4160, help="row width of the symm_mem exchange (default: %(default)s)")
    parser.add_argument("--iterations", type=positive_int, default=20, help="timed exchanges per size (default: %(default)s)")
    parser.add_argument("--out", default="docs", help="folder of the tables, made if missing (default: ./docs)")
    parser.add_argument("--model", default=None, metavar="TRACE", help="model (no GPU) the exchange at --model-devices from a routing trace")
    parser.add_argument("--model-devices", nargs="+", type=positive_int, default=[2, 4, 8], help="device counts of --model (default: %(default)s)")
    parser.add_argument("--tokens", type=positive_int, default=16384, help="tokens per rank (--model; default: %(default)s)")
    parser.add_argument("--call-ms", type=non_negative_float, default=0.056, help="per-call cost (--model; the NCCL fit; default: %(default)s)")
    parser.add_argument("--gbs", type=positive_float, default=290.0, help="per-rank GB/s (--model; the NCCL fit; default: %(default)s)")
