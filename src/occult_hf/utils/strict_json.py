"""Strict JSON reading: the one parser behind every JSON file and string occult_hf reads.

Python's `json` module is lenient in ways that turn a bad file into a silently different one: a key
given twice keeps its last value, `NaN` and `Infinity` parse (and later fail a write, or a timeout,
far from the file), a deeply nested document raises `RecursionError` and a 5000-digit integer a
`ValueError` that names no file. Here each of these is a `ValueError` that names the file (or the
setting the text came from) and the JSON path, in a message of bounded size, and a file larger than
`max_bytes` is refused before it is read.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: the largest JSON file read by default (a placement of 61 layers x 256 experts is about 100 kB)
DEFAULT_MAX_BYTES = 64 * 2**20
#: characters of a JSON error kept in a message (a parser's message can quote the whole input)
_MAX_DETAIL = 200


class JSONInputError(ValueError):
    """A JSON input that breaks the strict rules; the message names the input and what is wrong."""


class _Duplicate(ValueError):
    pass


class _NotFinite(ValueError):
    pass


def parse_json(text: str | bytes, what: str, allow_nan: bool = False) -> Any:
    """The value of the JSON `text`; `what` names it in errors (e.g. "placement 'p.json'").

    Rejects duplicate keys in one object, `NaN` / `Infinity` / `-Infinity` (unless `allow_nan`: files of other
    tools that write them, lm-eval's results), nesting deeper than the interpreter allows, integers past Python's
    digit limit and text that is not UTF-8.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise JSONInputError(f"{what} is not valid JSON: not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=None if allow_nan else _no_constant)
    except _Duplicate as error:
        raise JSONInputError(f"{what}: key {str(error)} appears twice in one JSON object") from None
    except _NotFinite as error:
        raise JSONInputError(f"{what}: {error} is not a JSON number (NaN and infinities are not allowed)") from None
    except json.JSONDecodeError as error:
        raise JSONInputError(f"{what} is not valid JSON: {_bounded(str(error))}") from None
    except RecursionError:
        raise JSONInputError(f"{what} is nested too deeply to be read as JSON") from None
    except ValueError as error:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise JSONInputError(f"{what} is not valid JSON: {_bounded(str(error))}") from None


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = DEFAULT_MAX_BYTES, allow_nan: bool = False) -> Any:
    """`parse_json` of the file at `path`; `what` is the kind of file ("placement"), named with its path.

    A file larger than `max_bytes` is refused before it is read; so is anything but a regular file (a FIFO
    would block the read forever, a directory or a symlink loop give an `OSError` that names no kind of file);
    an unreadable file is an `OSError` that names it.
    """
    path = os.fspath(path)
    label = f"{what} {path!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{label} is not a file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise JSONInputError(f"{label} is {size} bytes, more than the {max_bytes} a {what} file may have")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    return parse_json(data, label, allow_nan)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(_bounded(repr(key)))
        out[key] = value
    return out


def json_kind(value: Any) -> str:
    """A parsed JSON value's kind in JSON's words ("an array", "null"), a number with its value ("int 3"): what an
    error about a file's structure says it found."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"{type(value).__name__} {value!r}"
    )


def _no_constant(name: str):
    raise _NotFinite(name)


def _bounded(text: str) -> str:
    return text if len(text) <= _MAX_DETAIL else f"{text[:_MAX_DETAIL]}... ({len(text)} characters)"


__all__ = ["DEFAULT_MAX_BYTES", "JSONInputError", "json_kind", "parse_json", "read_json_file"]
