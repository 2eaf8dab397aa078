"""CPU dry runs of `occult bench model` (tiny widths) and the exchange model of `occult bench exchange --model`:
the harnesses run and their tables say what they are (figures themselves need the GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


def _occult(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "occult_hf.cli", *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_bench_model_dry_run(tmp_path):
    out = _occult("bench", "model", "--shapes", "olmoe-1b-7b", "--layers", "1", "--batch", "1", "--seq", "8",
                  "--hidden", "32", "--intermediate", "16", "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert "| olmoe-1b-7b | 8 | 1 |" in out
    rows = json.loads((tmp_path / "bench_model_cpu.json").read_text())["rows"]
    assert [r["implementation"] for r in rows] == ["stock", "occult"]


@pytest.mark.skipif(not TRACE.is_file(), reason=f"real routing trace {TRACE} not present")
def test_exchange_model_is_labelled_and_dedup_sends_less(tmp_path):
    out = _occult("bench", "exchange", "--model", str(TRACE), "--model-devices", "2", "4", "--tokens", "512",
                  "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert out.startswith("MODEL, not a measurement")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")]
    sent = {(r[0].strip("| "), r[1], r[2]): int(r[4]) for r in rows}
    for devices in ("2", "4"):
        for placement in ("contiguous", "refined"):
            assert sent[(devices, placement, "dedup")] < sent[(devices, placement, "per_expert")]
