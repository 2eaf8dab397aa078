"""argparse types shared by the command line and the benchmarks: a bad count is an error at parse time, not a
crash or a useless file later."""

from __future__ import annotations

import argparse
import math


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


#: `--tokens 0` or `--layer -3` is refused by argparse with the rule it broke
positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def _float_above(minimum: float, inclusive: bool):
    rule = f"a finite number {'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
        if not (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)):
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
        return value

    parse.__name__ = rule
    return parse


#: a rate or a size (`--gbs 0` would print infinite times) and a cost that may be nothing (`--call-ms 0`)
positive_float = _float_above(0.0, inclusive=False)
non_negative_float = _float_above(0.0, inclusive=True)


def separator(text: str) -> str:
    """`--separator`: a non-empty string with Python's backslash escapes decoded, since a shell passes `'\\x1e'`
    as four characters (decoded: U+001E, the ASCII record separator)."""
    try:
        decoded = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} holds a broken backslash escape ({error.reason})") from None
    if not decoded:
        raise argparse.ArgumentTypeError("the separator must not be empty")
    return decoded


def torch_dtype_name(text: str) -> str:
    """`--dtype`: "auto" or the name of a torch dtype; another attribute of torch (`nn`) would otherwise fail far from
    the flag, after the model loaded (lm-eval: "cannot pickle 'module' object")."""
    if text == "auto":
        return text
    import torch

    if not isinstance(getattr(torch, text, None), torch.dtype):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a torch dtype name (float32, bfloat16, float16), got {text!r}")
    return text


__all__ = ["non_negative_float", "non_negative_int", "positive_float", "positive_int", "separator", "torch_dtype_name"]
