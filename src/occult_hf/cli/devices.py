"""Flags every `occult` command spells the same way: `--device` (with `auto`) and `--num-devices`."""

from __future__ import annotations

import argparse
import warnings


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


class _DeprecatedAlias(argparse.Action):
    """Stores like the new flag and warns that the old spelling is deprecated."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{option_string} is deprecated; use {self.new_flag}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def add_num_devices_argument(parser, help: str, **kwargs) -> None:
    """`--num-devices` (the name of `OccultConfig.num_devices`), with `--devices` as a deprecated alias."""
    parser.add_argument("--num-devices", "--num_devices", dest="num_devices", type=int, help=help, **kwargs)
    parser.add_argument(
        "--devices", dest="num_devices", type=int, action=_DeprecatedAlias, new_flag="--num-devices",
        help=argparse.SUPPRESS,
    )


__all__ = ["add_num_devices_argument", "resolve_device"]
