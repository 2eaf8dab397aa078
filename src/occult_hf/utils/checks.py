"""Input checks for routing arrays, the device count and a model's source, shared by the metrics, the planners, the
pruner, the config, the launcher and the commands.

Each returns its input as the array type the callers compute with, or raises a `ValueError` that
names the input, what it holds and the rule it broke.

Shape legend: N tokens, k experts per token, E routed experts, D devices.
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, Iterable

import numpy as np

#: the longest wait on a peer rank any timeout setting may ask for (one day): longer is never a bound a user
#: meant, and torch's process-group timeouts (30 min by default) end such a wait first
MAX_TIMEOUT_S = 86400.0
#: items of a list an error message shows before "... and N more"
SHOWN_ITEMS = 8


# ----- input checks --------------------------------------------------------------------------
def did_you_mean(unknown: Iterable[str], valid: Iterable[str]) -> str:
    """`" (did you mean 'num_devices'?)"`: the closest valid name of each unknown one that has a close one
    (difflib's ratio >= 0.6), for the errors of keyword and key checks; "" when none is close."""
    valid = list(valid)
    close = [match[0] for name in unknown if (match := difflib.get_close_matches(str(name), valid, n=1))]
    return f" (did you mean {' / '.join(map(repr, close))}?)" if close else ""


def shown(items: Iterable[Any], limit: int = SHOWN_ITEMS) -> str:
    """`[a, b, c]`, or the first `limit` items and `... (N in all)`: a list in an error message of bounded size
    (a file with 200k extra layers must not make a megabyte of error text)."""
    items = list(items)
    if len(items) <= limit:
        return f"[{', '.join(map(repr, items))}]"
    return f"[{', '.join(map(repr, items[:limit]))}, ... ({len(items)} in all)]"


def check_timeout_s(value: Any, setting: str) -> float:
    """Return `value` as float seconds or raise naming `setting`: a finite number in (0, `MAX_TIMEOUT_S`].

    Strings (environment variables) are parsed; booleans, NaN, infinities and values past the maximum
    are errors here instead of an `OverflowError` in the first collective that waits with them.
    """
    seconds = value
    if isinstance(value, str):
        try:
            seconds = float(value)
        except ValueError:
            seconds = None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)) or not (
        math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S
    ):
        raise ValueError(f"{setting}={value!r} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    return float(seconds)


def check_count(setting: str, value: Any, minimum: int, meaning: str = "", why: str = "") -> int:
    """Return `value` or raise unless it is an `int` >= `minimum` (a bool is not a count): `<setting> must be an
    integer >= <minimum><meaning>, got <value><why>`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{setting} must be an integer >= {minimum}{meaning}, got {value!r}{why}")
    return value


def check_num_devices(num_devices, setting: str = "num_devices") -> int:
    """Return `num_devices` as an int or raise: a positive integer (Python or numpy, not a bool).

    The one check of the device count; `setting` names it in the error (e.g. "OccultConfig.num_devices").
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"{setting} must be a positive integer, got {num_devices!r}")
    return int(num_devices)


def check_devices_per_node(value: Any, num_devices: int, setting: str = "devices_per_node") -> int:
    """Return `value` as an int or raise naming `setting`: the devices of one node, an integer >= 1 (Python or numpy,
    not a bool) that divides `num_devices`, since every node holds as many devices (devices n*G .. n*G+G-1: node n)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{setting} must be an integer >= 1, got {value!r}")
    if num_devices % value:
        raise ValueError(
            f"{setting}={value} does not divide num_devices={num_devices}: every node must hold the same number of devices"
        )
    return int(value)


def check_topk_ids(topk_ids_Nk: np.ndarray, num_experts: int, name: str = "topk_ids") -> np.ndarray:
    """Return `topk_ids_Nk` as int64 `[N, k]` or raise: integer, 2-D, ids in [0, E), distinct per row."""
    ids = np.asarray(topk_ids_Nk)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array [N, k], got {ids.dtype} with shape {list(ids.shape)}")
    if ids.shape[1] > num_experts:
        raise ValueError(f"{name} has k={ids.shape[1]} experts per token but num_experts={num_experts}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(
            f"{name} holds expert ids in [{int(ids.min())}, {int(ids.max())}]; they must lie in [0, num_experts={num_experts})"
        )
    ids = ids.astype(np.int64, copy=False)
    if ids.shape[1] > 1 and ids.size:
        sorted_ids = np.sort(ids, axis=1)
        repeated_N = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(axis=1)
        if repeated_N.any():
            first = int(np.flatnonzero(repeated_N)[0])
            raise ValueError(
                f"{name} repeats an expert within a token's top-k ({int(repeated_N.sum())} rows; first: row {first} = "
                f"{ids[first].tolist()})"
            )
    return ids


def check_device_map(device_of_E: np.ndarray, num_experts: int, num_devices: int) -> np.ndarray:
    """Return `device_of_E` as int64 `[E]` or raise: one device id in [0, D) per expert."""
    devices = np.asarray(device_of_E)
    if devices.shape != (num_experts,) or devices.dtype.kind not in "iu":
        raise ValueError(
            f"device map must be an integer array [E={num_experts}], got {devices.dtype} with shape {list(devices.shape)}"
        )
    if num_experts and (devices.min() < 0 or devices.max() >= num_devices):
        raise ValueError(
            f"device map uses device ids in [{int(devices.min())}, {int(devices.max())}]; "
            f"they must lie in [0, num_devices={num_devices})"
        )
    return devices.astype(np.int64, copy=False)


def check_square(matrix_EE: np.ndarray, num_experts: int, name: str = "coactivation") -> np.ndarray:
    """Return `matrix_EE` as an array or raise when it is not `[E, E]`."""
    matrix = np.asarray(matrix_EE)
    if matrix.shape != (num_experts, num_experts):
        raise ValueError(f"{name} must have shape [E, E] = [{num_experts}, {num_experts}], got {list(matrix.shape)}")
    return matrix


def check_model_source(name: str) -> None:
    """Fail at once on a local model directory that does not exist, instead of minutes of Hub retries.

    `name` is taken as local when it exists, starts with `/`, `.` or `~`, ends with a separator, or
    is not a valid Hub id (`org/name`); a valid Hub id that is not a directory is left to transformers.
    """
    if os.path.isdir(name):
        return
    if os.path.exists(name):
        raise NotADirectoryError(f"MODEL {name!r} is a file; expected a model directory or a Hub model id")
    if names_a_local_path(name):
        raise FileNotFoundError(f"MODEL {name!r}: model directory does not exist (and it is not a Hub model id)")


def ends_with_separator(path: str) -> bool:
    """Whether `path` ends with a path separator (`/`, and `\\` where the system has it): it names a directory, which
    `os.path.abspath` and `dirname` would silently turn into its parent's entry."""
    return path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep))


def names_a_local_path(name: str) -> bool:
    """Whether `name` can only mean a local path: it starts with `/`, `.` or `~`, ends with a separator, or is not a
    valid Hub id (`org/name`), so that looking it up on the Hub would end, after its retries, in a connection error."""
    if name.startswith(("/", ".", "~")) or ends_with_separator(name):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


__all__ = [
    "check_model_source", "ends_with_separator", "names_a_local_path", "check_devices_per_node", "check_topk_ids", "check_device_map", "check_square", "check_timeout_s",
    "shown", "MAX_TIMEOUT_S",
]
