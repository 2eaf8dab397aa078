"""Flags every `occult` command spells the same way: `--device` (with `auto`), `--num-devices` and
`--devices-per-node` (positive integers, checked at parse time, before any work)."""

from __future__ import annotations

from ..utils.arguments import positive_int


def resolve_device(value: str | None) -> str:
    """`--device`: `auto` (or None) is CUDA when available, else CPU, in every command; an explicit CUDA
    device without CUDA is an error (not a silent fallback, not a traceback; the command line's handler
    prefixes the command's name)."""
    import torch

    requested = "auto" if value in (None, "") else str(value)
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested} but this torch build sees no CUDA device; use --device auto or cpu")
    try:
        torch.device(requested)
    except RuntimeError as error:
        raise ValueError(f"--device {requested!r} is not a torch device ({error}); use auto, cpu or cuda[:N]") from error
    return requested


def add_num_devices_argument(parser, help: str, **kwargs) -> None:
    """`--num-devices` (the name of `OccultConfig.num_devices`; `--num_devices` as transformers' scripts spell it)."""
    parser.add_argument("--num-devices", "--num_devices", dest="num_devices", type=positive_int, help=help, **kwargs)


def add_devices_per_node_argument(parser, help: str, default: int | None = None) -> None:
    """`--devices-per-node G` (`OccultConfig.devices_per_node`, `plan_placement(devices_per_node=G)`)."""
    parser.add_argument("--devices-per-node", "--devices_per_node", dest="devices_per_node", type=positive_int, default=default, help=help)


__all__ = ["add_devices_per_node_argument", "add_num_devices_argument", "resolve_device"]
