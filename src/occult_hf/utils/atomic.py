"""Atomic, validated file writes: every file occult_hf writes goes through here (docs/design.md §6).

A write is (1) serialised completely in memory and validated (JSON is parsed back; a caller may
pass its own check), (2) written to a temporary file in the target's own directory (same file
system, so the rename is atomic) and flushed to disk, (3) `os.replace`d over the target. A failure
at any step, or a crash, leaves the previous file whole and no temporary file behind (a killed
process can leave one `.<name>.tmp-*` file, never a truncated target).

Metadata often holds numpy scalars (`np.float64` from a metric, `np.int64` from a count), which
`json.dump` rejects half way through a file; `to_json_native` converts them first and names the
JSON path of anything it cannot convert.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .checks import ends_with_separator


def to_json_native(value: Any, where: str = "$") -> Any:
    """`value` with numpy scalars/arrays, tuples and path-likes turned into JSON's own types.

    Dict keys must be strings or integers (integers become decimal strings, as `json` does). NaN
    and infinities are rejected: strict JSON has no spelling for them. Errors name the JSON path.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"cannot write {float(value)!r} at JSON path {where}: JSON has no NaN or infinity")
        return float(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.ndarray):
        return to_json_native(value.tolist(), where)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer)):
                raise TypeError(f"cannot write dict key {key!r} ({type(key).__name__}) at JSON path {where}")
            name = str(int(key)) if not isinstance(key, str) else key
            if name in out:
                raise ValueError(f"duplicate key {name!r} at JSON path {where}")
            out[name] = to_json_native(item, f"{where}.{name}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_json_native(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} at JSON path {where} as JSON")


def json_text(value: Any, indent: int | None = 1, sort_keys: bool = False) -> str:
    """Strict JSON text of `value` (after `to_json_native`), parsed back before it is returned."""
    text = json.dumps(to_json_native(value), indent=indent, sort_keys=sort_keys, allow_nan=False) + "\n"
    json.loads(text)  # validate: what we write is what a reader gets
    return text


def atomic_write_bytes(path: str | os.PathLike, data: bytes, validate: Callable[[bytes], None] | None = None) -> None:
    """Write `data` to `path` atomically (temporary file in the same directory, fsync, `os.replace`)."""
    if validate is not None:
        validate(data)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, value: Any, indent: int | None = 1, sort_keys: bool = False) -> None:
    """Serialise `value` as strict JSON in memory (numpy scalars converted) and write it atomically."""
    atomic_write_text(path, json_text(value, indent=indent, sort_keys=sort_keys))


def atomic_save_npz(path: str | os.PathLike, validate: Callable[[bytes], None] | None = None, **arrays: np.ndarray) -> None:
    """`np.savez_compressed(path, **arrays)` atomically: the archive is built in memory, checked by
    `validate(bytes)` when given, then written."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue(), validate=validate)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)` through `atomic_path`. torch's writer reports a failed write (a full disk) as a
    `RuntimeError` that names no file ("unexpected pos 704 vs 598"): it becomes an `OSError` naming `path` and the
    space left on its file system."""
    import torch

    with atomic_path(path) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as error:
            free = shutil.disk_usage(os.path.dirname(tmp)).free
            raise OSError(
                f"writing {os.fspath(path)!r} failed with {free} bytes left on its file system: "
                f"{' '.join(str(error).split())[:300]}"
            ) from error


def atomic_save_figure(figure, path: str | os.PathLike, **savefig_kwargs) -> None:
    """`figure.savefig` through `atomic_path` (the format from the target's extension, default PNG)."""
    fmt = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=fmt, **savefig_kwargs)


def check_writable_dir(path: str | os.PathLike, what: str = "output") -> str:
    """Raise an `OSError` naming `path` when it cannot be written: its directory does not exist, or takes no new
    file (a probe file made and removed: read-only mounts, permissions, /proc), or `path` is a directory. Checked
    before long runs."""
    path = os.fspath(path)
    if ends_with_separator(path):  # abspath would drop it, and the write fail
        raise IsADirectoryError(f"{what} {path!r} ends with a separator: a directory, expected a file path")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{what} {path!r}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path!r} is a directory, expected a file path")
    try:
        probe_directory(directory)
    except OSError as error:
        raise PermissionError(f"{what} {path!r}: cannot write in directory {directory!r} ({error.strerror or error})") from None
    return path


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, else its nearest ancestor that exists (a relative path's walk ends at "."): a file there is what stands
    in the way of making `path` a directory, a directory where it would be made."""
    existing = Path(path)
    while not existing.exists():
        existing = existing.parent
    return existing


def probe_directory(directory: str | os.PathLike) -> None:
    """Make and remove a file in `directory`; the `OSError` of one that takes no new file (a read-only mount, its
    permissions, /proc), which `os.access` does not report for root."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".occult_probe-"):
        pass


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside `path` for writers that need a file name (safetensors, matplotlib).

    On a clean exit the temporary file is flushed to disk and renamed over `path`; on an error it
    is removed and `path` is untouched.
    """
    path = check_writable_dir(path)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _keep_mode(path, tmp)
        os.replace(tmp, path)
    except OSError as error:  # "No space left on device" names no file: name the one being written
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if error.errno is None or error.filename == path:
            raise
        raise type(error)(error.errno, error.strerror, path) from error
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _keep_mode(path: str, tmp: str) -> None:
    """Give the new file the old file's permissions, or the umask's default (mkstemp makes 0600)."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(tmp, mode)


__all__ = [
    "to_json_native",
    "json_text",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_path",
    "atomic_save_figure",
    "atomic_torch_save",
    "check_writable_dir",
    "nearest_existing",
    "probe_directory",
]
