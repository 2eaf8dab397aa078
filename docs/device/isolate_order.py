"""Does an eager dynamic-cache `generate()` before the static one slow occult's static step in its process?

`occult bench decode --isolate` times, in occult's own process, the dynamic cache and then the static one; its static
batch-1 step took 4.26 and 4.84 ms in two draws, where `tracking_alone.py` (static only, 33 new tokens) put it at
2.7-3.3 ms in most processes. This runs the `--isolate` process itself (`python -m occult_hf.benchmarks.decode SPEC`)
for occult at batch 1, alternately with the caches `static` and `dynamic static`, each in a fresh process, and prints
each process's rows. `python docs/device/isolate_order.py [ROUNDS]` (MODEL as in profile_decode.py).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from occult_hf.benchmarks.decode import RowsFile, isolated_command, write_isolated_spec

ORDERS = (["static"], ["dynamic", "static"])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    shape = os.environ.get("MODEL", "olmoe-1b-7b")
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for caches in ORDERS:
                spec, rows = Path(scratch) / "spec.json", Path(scratch) / f"rows_{round_}_{len(caches)}.json"
                args = argparse.Namespace(layers=None, hidden=None, intermediate=None, batches=[1], caches=caches,
                                          prompt=128, new_tokens=64, repeats=2, untracked=False, seed=0,
                                          dtype=torch.bfloat16)  # fmt: skip
                write_isolated_spec(spec, shape, "occult", rows, args)
                subprocess.run(isolated_command(spec), check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                cells = ", ".join(f"{r.cache} {r.ms_per_step:.2f} ms" for r in RowsFile(rows).rows()) or "no rows"
                print(f"order {shape} round {round_ + 1} caches {' '.join(caches)}: {cells}", flush=True)


if __name__ == "__main__":
    main()
