"""CPU dry runs of `occult bench model` and `occult bench decode` (tiny widths) and the exchange model of `occult bench exchange --model`:
the harnesses run and their tables say what they are (figures themselves need the GPU); without CUDA
and without `--cpu` every benchmark fails at once."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from occult_hf.cli import main as occult_main
from occult_hf.cli.bench import BENCHMARKS

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared/data/routing/qwen15moe_a27b_chat_gptq_int4_gsm8k25_layer0_trace.npz"


def _occult(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "occult_hf.cli", *args], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_bench_model_dry_run(tmp_path):
    out = _occult("bench", "model", "--cpu", "--shapes", "olmoe-1b-7b", "--layers", "1", "--batch", "1", "--seq", "8",
                  "--hidden", "32", "--intermediate", "16", "--backends", "auto", "torch", "--profile", "3",
                  "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert re.search(r"\| olmoe-1b-7b +\| 8 +\| 1 +\| grouped_mm +\| occult \(torch\) +\|", out), out[-3000:]
    rows = json.loads((tmp_path / "bench_model_cpu.json").read_text())["rows"]
    assert [r["implementation"] for r in rows] == ["stock", "occult", "occult (torch)"]
    # a profile of each model: where the host's time goes, the whole MoE block in every model (stock too), and the
    # block's stages in the occult_hf models
    count = lambda *cells: len(re.findall(r"\| " + r" +\| ".join(map(re.escape, cells)) + r" +\|", out))  # noqa: E731
    assert count("host operator", "calls", "self host ms") == 2 * 3 and count("moe block", "1") == 2 * 3
    assert count("route", "1") == 2 * 2


def test_bench_model_compiled_dry_run_profiles_the_compiled_models(tmp_path):
    """With --compile and --profile, each model is timed and profiled also as torch.compile(model.model) (inductor on
    the CPU here): four rows, and a profile of each compiled model's forward and forward+backward."""
    out = _occult("bench", "model", "--cpu", "--compile", "--shapes", "olmoe-1b-7b", "--layers", "1", "--batch", "1", "--seq", "8",
                  "--hidden", "32", "--intermediate", "16", "--backends", "auto", "--profile", "3", "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "bench_model_cpu.json").read_text())["rows"]
    assert [r["implementation"] for r in rows] == ["stock", "stock compiled", "occult", "occult compiled"]
    assert all(r["fwd_bwd_ms"] == r["fwd_bwd_ms"] for r in rows), rows  # none failed (NaN)
    for name in ("stock compiled", "occult compiled"):
        assert f"### olmoe-1b-7b, {name}, 8 tokens" in out


def test_roofline_counts_every_matrix_product_of_the_decoder():
    """The roofline's FLOPs, counted by hand for a tiny OLMoE (hidden 32, 4 heads of 8, 64 experts of width 16, top-8)
    and a tiny Qwen1.5-MoE (its shared expert of width 16 and their one-column gate too): projections, router, the k
    routed experts a token, causal attention."""
    from transformers import AutoModelForCausalLM

    from occult_hf.benchmarks.model import decoder_matmul_flops, model_config

    batch, seq, hidden, width, layers = 3, 10, 32, 16, 2
    tokens = batch * seq
    attention = 4 * hidden * hidden * 2 * tokens + 2 * batch * 4 * seq * seq * 8
    expected = {
        "olmoe-1b-7b": attention + 2 * tokens * (64 * hidden + 8 * 3 * hidden * width),
        # router, 4 routed experts, the shared expert and its gate (q, k and v's biases are additions, not products)
        "qwen1.5-moe-a2.7b": attention + 2 * tokens * (60 * hidden + 4 * 3 * hidden * width + 3 * hidden * width + hidden),
    }
    for shape, per_layer in expected.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(shape, layers, hidden, width))
        assert decoder_matmul_flops(model, batch, seq) == layers * per_layer, shape


def test_bench_decode_dry_run(tmp_path):
    """Every variant (dynamic, static and static-reused `generate()`) of stock and occult runs and has its
    row, the fp32 greedy tokens of both are checked equal, and the table and the plot are written."""
    out = _occult("bench", "decode", "--cpu", "--models", "olmoe-1b-7b", "--layers", "1", "--hidden", "32", "--intermediate", "16",
                  "--batches", "1", "2", "--prompt", "4", "--new-tokens", "3", "--repeats", "1", "--check-layers", "1",
                  "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "bench_decode_cpu.json").read_text())["rows"]
    variants = {(r["batch"], r["implementation"], r["cache"]) for r in rows if r["error"] is None}
    assert variants == {(b, i, c) for b in (1, 2) for i in ("stock", "occult") for c in ("dynamic", "static", "static-reused")}, rows
    assert "occult == stock: True" in out and "| occult static vs stock dynamic" in out and "| stock static-reused ms" in out
    assert (tmp_path / "bench_decode_cpu.png").stat().st_size > 0


def test_static_reused_passes_one_reset_cache_to_every_call_and_decodes_the_static_tokens(monkeypatch):
    """The `static-reused` variant hands `generate()` the same `StaticCache` in every call, reset before each (the
    serving recipe), where `static` lets transformers make a new one per call; both decode the same greedy tokens."""
    from tiny_models import tiny_batch, tiny_model

    from occult_hf import OccultConfig, apply_occult
    from occult_hf.benchmarks import decode

    model = apply_occult(tiny_model("olmoe").eval(), OccultConfig(num_devices=1))
    prompt = tiny_batch(batch=2, seq=5, seed=0)
    generate, seen = model.generate, []

    def watched(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        seen.append(None if cache is None else (id(cache), all(not layer.keys.any() for layer in cache.layers if layer.is_initialized)))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", watched)
    decode.time_step(model, prompt, 3, "static-reused", repeats=1)
    assert len(seen) == 1 + 2 * 2 and len({cache_id for cache_id, _ in seen}) == 1, seen  # compiling call, settling, timed
    assert all(was_reset for _, was_reset in seen), seen
    reused = decode.static_cache_for(model, prompt, 3)
    expected = decode.generate_greedy(model, prompt, 3, "static")
    assert torch.equal(decode.generate_greedy(model, prompt, 3, reused), expected)
    assert torch.equal(decode.generate_greedy(model, prompt, 3, reused), expected)


def test_bench_decode_cut_short_keeps_the_batches_it_finished(tmp_path, monkeypatch):
    """A run killed during batch 2 (a KeyboardInterrupt from inside its timing) leaves batch 1's table and rows."""
    from occult_hf.benchmarks import decode
    from occult_hf.cli import build_parser

    timed = decode.time_step

    def cut_at_batch_2(model, prompt_BS, *rest):
        if prompt_BS.shape[0] == 2:
            raise KeyboardInterrupt
        return timed(model, prompt_BS, *rest)

    monkeypatch.setattr(decode, "time_step", cut_at_batch_2)
    args = build_parser().parse_args(["bench", "decode", "--cpu", "--models", "olmoe-1b-7b", "--layers", "1", "--hidden", "32",
                                      "--intermediate", "16", "--batches", "1", "2", "--prompt", "4", "--new-tokens", "3",
                                      "--repeats", "1", "--check-layers", "0", "--caches", "dynamic", "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        decode.run(args)
    rows = json.loads((tmp_path / "bench_decode_cpu.json").read_text())["rows"]
    assert {(r["batch"], r["implementation"]) for r in rows} == {(1, "stock"), (1, "occult")}
    assert "| olmoe-1b-7b | 1 " in (tmp_path / "bench_decode_cpu.md").read_text()


def test_bench_decode_untracked_times_occult_without_routing_records(tmp_path, monkeypatch):
    """`--untracked` times the occult model as served (`track_routing(model, False)`) and says so in the table."""
    from occult_hf import occult_modules
    from occult_hf.benchmarks import decode
    from occult_hf.cli import build_parser

    timed, tracking = decode.time_step, {}

    def record_tracking(model, *rest):
        blocks = occult_modules(model)
        if blocks:
            tracking.update({name: block.track for name, block in blocks.items()})
        return timed(model, *rest)

    monkeypatch.setattr(decode, "time_step", record_tracking)
    args = build_parser().parse_args(["bench", "decode", "--cpu", "--models", "olmoe-1b-7b", "--layers", "1", "--hidden", "32",
                                      "--intermediate", "16", "--batches", "1", "--prompt", "4", "--new-tokens", "3", "--repeats", "1",
                                      "--check-layers", "0", "--caches", "dynamic", "--untracked", "--out", str(tmp_path)])  # fmt: skip
    decode.run(args)
    assert tracking and not any(tracking.values()), tracking
    assert "occult untracked (`track_routing(model, False)`)" in (tmp_path / "bench_decode_cpu.md").read_text()


TINY_DECODE = ["bench", "decode", "--cpu", "--models", "olmoe-1b-7b", "--layers", "1", "--hidden", "32", "--intermediate", "16",
               "--batches", "1", "2", "--prompt", "4", "--new-tokens", "3", "--repeats", "1", "--check-layers", "0",
               "--caches", "dynamic"]  # fmt: skip


def test_bench_decode_isolate_times_each_implementation_in_a_process_of_its_own(tmp_path, monkeypatch):
    """`--isolate`: every row comes from a fresh process (this one's `time_step` refuses to run), stock and occult at
    each batch, and the table says how it was timed."""
    from occult_hf.benchmarks import decode
    from occult_hf.cli import build_parser

    def not_here(*_):
        raise AssertionError("--isolate timed a model in the parent process")

    monkeypatch.setattr(decode, "time_step", not_here)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    decode.run(build_parser().parse_args([*TINY_DECODE, "--isolate", "--untracked", "--out", str(tmp_path)]))
    rows = json.loads((tmp_path / "bench_decode_cpu.json").read_text())["rows"]
    assert {(r["batch"], r["implementation"]) for r in rows if r["error"] is None} == {(b, i) for b in (1, 2) for i in ("stock", "occult")}, rows
    assert all(r["ms_per_step"] > 0 for r in rows)
    table = (tmp_path / "bench_decode_cpu.md").read_text()
    assert "in a process of its own (`--isolate`)" in table and "occult untracked" in table and "| olmoe-1b-7b | 2 " in table


def test_bench_decode_isolate_keeps_what_a_dying_process_timed_and_says_why_it_died(tmp_path, monkeypatch):
    """A timing process that writes batch 1's row and then exits with an error: batch 1 keeps its time, batch 2 gets a
    row with the exit status and the process's last output, and the run still writes its table."""
    from occult_hf.benchmarks import decode
    from occult_hf.cli import build_parser

    dies_after_batch_1 = (
        "import json, sys; spec = json.load(open(sys.argv[1])); "
        "row = dict(model=spec['shape'], batch=1, implementation=spec['implementation'], cache='dynamic', ms_per_step=1.5, first_call_s=0.1); "
        "json.dump([row], open(spec['rows'], 'w')); print('out of memory at batch 2'); sys.exit(3)"
    )  # fmt: skip
    monkeypatch.setattr(decode, "isolated_command", lambda spec: [sys.executable, "-c", dies_after_batch_1, str(spec)])
    decode.run(build_parser().parse_args([*TINY_DECODE, "--isolate", "--out", str(tmp_path)]))
    rows = {(r["batch"], r["implementation"]): r for r in json.loads((tmp_path / "bench_decode_cpu.json").read_text())["rows"]}
    assert set(rows) == {(b, i) for b in (1, 2) for i in ("stock", "occult")}
    assert all(rows[(1, i)]["ms_per_step"] == 1.5 and rows[(1, i)]["error"] is None for i in ("stock", "occult"))
    assert all("exited with status 3: out of memory at batch 2" in rows[(2, i)]["error"] for i in ("stock", "occult")), rows
    table = (tmp_path / "bench_decode_cpu.md").read_text()
    assert "| 1.50 " in table and "| nan " in table


def test_bench_decode_isolate_terminated_keeps_the_batch_its_process_wrote_and_kills_it(tmp_path):
    """`timeout`'s SIGTERM while a timing process is in batch 2, silent since it wrote batch 1's row: the run ends
    with status 143, batch 1 in its table, and the timing process killed rather than left on the device. The stand-in
    writes its rows as the real one does (whole, by a rename): a file the parent read half-written failed the run."""
    import signal

    marker = tmp_path / "child_wrote_batch_1"
    writes_batch_1_then_hangs = (
        "import json, os, sys, time; spec = json.load(open(sys.argv[1])); "
        "row = dict(model=spec['shape'], batch=1, implementation=spec['implementation'], cache='dynamic', ms_per_step=1.5, first_call_s=0.1); "
        "json.dump([row], open(spec['rows'] + '.tmp', 'w')); os.replace(spec['rows'] + '.tmp', spec['rows']); "
        f"print('batch 1', flush=True); open({str(marker)!r}, 'w').write(str(os.getpid())); "
        "time.sleep(120)"
    )  # fmt: skip
    parent = (
        "import sys; from occult_hf.benchmarks import decode; from occult_hf.cli import main; "
        f"decode.isolated_command = lambda spec: [sys.executable, '-c', {writes_batch_1_then_hangs!r}, str(spec)]; "
        f"sys.exit(main({[*TINY_DECODE, '--isolate', '--out', str(tmp_path)]!r}))"
    )  # fmt: skip
    run = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    deadline = time.monotonic() + 300
    while not (marker.is_file() and marker.read_text()) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.is_file(), run.communicate(timeout=60)[0][-3000:]
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 143, output[-3000:]
    rows = json.loads((tmp_path / "bench_decode_cpu.json").read_text())["rows"]
    assert [(r["batch"], r["implementation"], r["ms_per_step"]) for r in rows] == [(1, "stock", 1.5)], rows
    child = Path(f"/proc/{marker.read_text()}")
    deadline = time.monotonic() + 10
    while child.exists() and "zombie" not in (child / "status").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.exists() or "zombie" in (child / "status").read_text()


@pytest.mark.skipif(not TRACE.is_file(), reason=f"real routing trace {TRACE} not present")
def test_exchange_model_is_labelled_and_dedup_sends_less(tmp_path):
    out = _occult("bench", "exchange", "--model", str(TRACE), "--model-devices", "2", "4", "--tokens", "512",
                  "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert out.startswith("MODEL, not a measurement")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if re.match(r"\| [24] +\|", line)]
    sent = {(r[0], r[1], r[2]): int(r[4]) for r in rows}
    for devices in ("2", "4"):
        for placement in ("contiguous", "refined"):
            assert sent[(devices, placement, "dedup")] < sent[(devices, placement, "per_expert")]


def test_realsize_routing_balance_counts_every_pair():
    """`bench realsize`'s per-layer routing table (one process, 2 logical devices, contiguous placement): the pairs
    each device received are the router's own choices counted by home, every token has a row on 1 or 2 devices."""
    import torch

    from occult_hf import apply_occult
    from occult_hf.benchmarks.realsize import balance_table, routing_balance
    from tiny_models import tiny_batch, tiny_model

    model = tiny_model("olmoe")
    ids_BS = tiny_batch(model.config.vocab_size, batch=2, seq=16)
    chosen = []  # each layer's router choice, recorded by a hook on the stock routers
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids_BS)
    for hook in hooks:
        hook.remove()
    apply_occult(model, {"num_devices": 2})
    balance = routing_balance(model, ids_BS)
    num_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    assert [b.layer for b in balance] == list(range(model.config.num_hidden_layers))
    for b, ids_Tk in zip(balance, chosen):
        home_Tk = ids_Tk // (num_experts // 2)  # contiguous: experts 0..E/2-1 on device 0
        assert b.pairs_D == [int((home_Tk == d).sum()) for d in range(2)] and sum(b.pairs_D) == ids_BS.numel() * top_k
        assert b.rows_D == [int((home_Tk == d).any(1).sum()) for d in range(2)]
        assert 1.0 <= b.ct <= 2.0 and 0.5 <= b.busiest_share <= 1.0
    table = balance_table(balance)
    assert table.count("\n") == len(balance) + 2 and re.search(r"\| mean +\|", table)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_gpu_benchmark_without_cuda_fails_at_once(name, tmp_path, monkeypatch, capsys):
    """Issue 32: `occult bench model` on CPU ran over 100 s at the real shapes with no output."""
    monkeypatch.chdir(tmp_path)  # nothing the benchmark might write lands in the checkout
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exited:
        occult_main(["bench", name])
    assert time.perf_counter() - start < 5.0 and exited.value.code == 2
    assert f"occult bench {name}: this run measures a GPU and this machine has no CUDA device" in capsys.readouterr().err


def test_a_model_larger_than_the_free_memory_fails_before_anything_is_allocated(tmp_path, monkeypatch, capsys):
    """`occult bench decode --cpu` at the real sizes held stock and occult (2 x 25.8 GiB in fp32) on a 24 GiB machine:
    the kernel killed it after a minute, exit status 137 and no message. Now the parameters are counted on the meta
    device first, and a run whose models cannot fit ends at once with an error that names the sizes and the flags."""
    import occult_hf.benchmarks.model as bench_model

    monkeypatch.setattr(bench_model, "free_bytes", lambda device: 4 * 2**30)
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exited:
        occult_main(["bench", "decode", "--cpu", "--no-progress", "--models", "olmoe-1b-7b", "--check-layers", "0"])
    error = capsys.readouterr().err
    assert time.perf_counter() - start < 30.0 and exited.value.code == 2
    assert "MemoryError: 2 x 25.8 GiB of parameters (olmoe, 6.92B parameters in float32, 16 layers" in error, error
    assert "do not fit in the 4.0 GiB the cpu has free: pass --layers, --hidden or --intermediate" in error
    # what fits is built as before
    model = bench_model.build_model(bench_model.model_config("olmoe-1b-7b", 1, 32, 16), "cpu", torch.float32, copies=2)
    assert sum(p.numel() for p in model.parameters()) < 4 * 2**30 // 8


def test_a_run_whose_expert_activations_cannot_fit_fails_before_building(tmp_path, monkeypatch, capsys):
    """`occult bench model --cpu` at its real shapes passed the parameter check (3 x 7.0 GiB) and spent 98 s building
    models before its forward+backward ran out of memory. The experts' kept pre-activations (4 layers x 16,384 tokens x
    8 experts x 2I) are now counted with the parameters, so such a run ends in seconds and names both."""
    import occult_hf.benchmarks.model as bench_model

    monkeypatch.setattr(bench_model, "free_bytes", lambda device: 24 * 2**30)
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exited:
        occult_main(["bench", "model", "--cpu", "--no-progress", "--shapes", "olmoe-1b-7b", "--batch", "8", "--seq", "2048"])
    error = capsys.readouterr().err
    assert time.perf_counter() - start < 30.0 and exited.value.code == 2
    assert "3 x 7.0 GiB of parameters (olmoe, 1.88B parameters in float32, 4 layers, hidden 2048) and 4.0 GiB of expert " \
        "activations for a backward of 16384 tokens do not fit in the 24.0 GiB the cpu has free" in error, error
    assert "or --batch, --seq for fewer tokens" in error
    # the floor is the experts' gate and up rows: layers x tokens x k x 2I elements
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench_model.model_config("olmoe-1b-7b", 3, 64, 32))
    assert bench_model.kept_expert_activations(model, 100) == 3 * 100 * 8 * 64


def test_a_cpu_run_that_outgrows_the_free_memory_ends_in_an_error_not_a_kill(tmp_path):
    """`occult bench model --cpu` at its real shapes passed the parameter check (3 x 7.1 GiB against 22.8 GiB free) and
    was then killed by the kernel while its forward+backward built activations: exit status 137 and no message, after
    80 s. A CPU run may now grow by what the machine had free and no more (`utils.host_memory`). Here 1 GiB is made to
    look free: the models fit, 16,384 tokens of forward+backward do not, and the run ends in seconds with an error that
    names the benchmark and where its size flags are."""
    script = (
        "import collections, sys, psutil\n"
        "psutil.virtual_memory = lambda: collections.namedtuple('Memory', 'available')(1 << 30)\n"
        "from occult_hf.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["bench", "model", "--cpu", "--no-progress", "--shapes", "olmoe-1b-7b", "--layers", "1", "--hidden", "256",
            "--intermediate", "256", "--batch", "8", "--seq", "2048", "--backends", "auto", "--out", str(tmp_path)]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert time.perf_counter() - start < 120 and done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "occult bench model: ran out of memory: the 0.8 GiB this machine had free at the start were not enough" in done.stderr
    assert "can't allocate memory" in done.stderr and "(`occult bench model --help` lists them)" in done.stderr


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")])
def test_an_allocation_that_fails_on_the_cpu_names_the_benchmark(error, capsys):
    """The interpreter's own `MemoryError` has no message, torch's allocator's is a `RuntimeError`: both end in the
    benchmark's one line; a `MemoryError` that already says what did not fit, and any other error, pass unchanged."""
    import argparse

    from occult_hf.cli.bench import _run

    class Failing:
        def __init__(self, raised: BaseException) -> None:
            self.raised = raised

        def needs_cuda(self, args) -> bool:
            return False

        def run(self, args) -> int:
            raise self.raised

    with pytest.raises(SystemExit) as exited:
        _run("model", Failing(error), argparse.Namespace(cpu=True))
    assert str(exited.value.code).startswith("occult bench model: ran out of memory: the ")
    assert str(exited.value.code).endswith(f"({str(error) or 'MemoryError'}); pass smaller sizes (`occult bench model --help` lists them)")
    for passing in (MemoryError("2 x 25.8 GiB of parameters do not fit"), RuntimeError("shapes do not match")):
        with pytest.raises(type(passing), match=str(passing)):
            _run("model", Failing(passing), argparse.Namespace(cpu=True))
