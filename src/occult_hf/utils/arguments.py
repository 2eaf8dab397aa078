"""argparse types shared by the command line and the benchmarks: a bad count is an error at parse time, not a
crash or a useless file later."""

from __future__ import annotations

import argparse


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


__all__ = ["non_negative_int", "positive_int"]
