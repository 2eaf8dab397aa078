"""`occult bench model`: a small model at a real MoE shape on one device, occult_hf against stock transformers.

Shape legend: B sequences, S sequence length, T = B*S tokens, H hidden, V vocabulary.

Per shape (`--shapes`, the real OLMoE-1B-7B and Qwen1.5-MoE-A2.7B layer shapes: attention, router,
experts, shared experts as the checkpoints have them) a randomly initialised transformers causal LM
with `--layers` decoder layers (default 4) is built in bf16 on the GPU, then:

- **stock**: the model as transformers runs it (its default attention and experts implementation,
  named in the table);
- **occult**: a copy with `apply_occult(model, {"num_devices": 1})` (one process, every expert
  local: the "local" dispatcher), one copy per expert backend in `--backends` (default "auto": Triton on
  CUDA; "torch": PyTorch's grouped GEMMs), so that backends are compared with stock in the same run.

With `--compile`, each model is timed also as `torch.compile(model.model)` (inductor, its default mode: what a
user gets for one line of code), after a first call that compiles; the table then compares every row with stock
transformers eager and with stock transformers compiled, the strongest thing a user runs instead.

Timed (`triton.testing.do_bench` medians, CUDA events) on the decoder without the LM head
(`model.model`, so that the vocabulary's matmul and loss, which both share, do not dilute the
comparison): forward under `no_grad`, and forward + backward of a random upstream gradient of the
last hidden state. The models compute the same function (same weights, same routing), and the
table gives each one's time, the speed-up, and the share of the roofline it reaches: the decoder's matrix products
(`decoder_matmul_flops`: projections, router, the routed experts a token runs, shared experts, causal attention; three
times as many with the backward) at the dense GEMM rate measured at the start of the run. `--profile N` adds, per model, a `torch.profiler` summary of one
forward and one forward+backward (`ep.profile_steps`: wall against GPU busy time, device time per `occult::`
stage, with the whole MoE block of either model as `moe block`, the N costliest kernels and host operators), which
says where a layer's time goes; with `--compile`, of each compiled model too (its kernels: the named stages and
blocks are not recorded inside a compiled graph).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from occult_hf.utils.arguments import positive_float, positive_int
from occult_hf.utils.atomic import atomic_write_text
from occult_hf.utils.host_memory import available_bytes
from occult_hf.experts import expert_backend_names
from occult_hf.benchmarks import failure_text, measures_a_gpu

HELP = "a few-layer model at a real MoE shape on one device: occult_hf (one process) vs stock transformers"
DESCRIPTION = __doc__.split("\n\n", 1)[1]
needs_cuda = measures_a_gpu

#: transformers config of each real model (the MoE layer and attention as in the checkpoint)
MODEL_SHAPES: dict[str, tuple[str, dict]] = {
    "olmoe-1b-7b": (
        "OlmoeConfig",
        dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=50304, max_position_embeddings=4096),
    ),
    "qwen1.5-moe-a2.7b": (
        "Qwen2MoeConfig",
        dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
             num_experts=60, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
             decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=8192),
    ),
}  # fmt: skip

#: attention heads of a model whose width `--hidden` overrides (the real shapes' 16 would leave too few columns each)
DRY_RUN_HEADS = 4


def dry_run_hidden(text: str) -> int:
    """`--hidden`: a positive multiple of 2 * DRY_RUN_HEADS, checked at parse time, since rotary embeddings need heads
    of even width and a width that does not split into them fails deep inside the first forward."""
    value = positive_int(text)
    if value % (2 * DRY_RUN_HEADS):
        raise argparse.ArgumentTypeError(
            f"expected a multiple of {2 * DRY_RUN_HEADS} ({DRY_RUN_HEADS} attention heads of even width), got {value}"
        )
    return value


def model_config(shape: str, layers: int, hidden: int | None = None, intermediate: int | None = None):
    """The transformers config of `shape` with `layers` decoder layers (hidden/intermediate overridable for dry runs)."""
    import transformers

    class_name, kwargs = MODEL_SHAPES[shape]
    kwargs = dict(kwargs, num_hidden_layers=layers)
    if hidden is not None:
        kwargs.update(hidden_size=hidden, num_attention_heads=DRY_RUN_HEADS, num_key_value_heads=DRY_RUN_HEADS)
    if intermediate is not None:
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if key in kwargs:
                kwargs[key] = intermediate
    return getattr(transformers, class_name)(**kwargs)


def build_model(config, device, dtype, seed: int = 0, copies: int = 1, backward_tokens: int = 0):
    """A randomly initialised causal LM of `config` (std 0.02 for every weight, 1/sqrt(fan-in) for experts).
    `copies`: how many tensors of this model's size the caller holds at once (stock, its occult copies, the
    gradients of the one in a backward), and `backward_tokens`: the tokens of the forward+backward it will run, both
    checked against the device's free memory first (`require_memory`)."""
    from transformers import AutoModelForCausalLM

    require_memory(config, device, dtype, copies, backward_tokens)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def require_memory(config, device, dtype, copies: int, backward_tokens: int = 0) -> None:
    """A MemoryError, naming the sizes and the flags that shrink the model, where `copies` times the parameters of
    `config` in `dtype`, plus what a forward+backward of `backward_tokens` tokens must keep (`kept_expert_activations`),
    do not fit in what `device` has free; before anything is allocated, since on the CPU the kernel kills a process
    that runs out (exit status 137, no message) and on a GPU an allocation fails midway through building. Both are
    floors (the other activations come on top), so passing is no promise: it rules out in a second the runs that
    cannot fit."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    one, free = parameters * dtype.itemsize, free_bytes(device)
    kept = kept_expert_activations(model, backward_tokens) * dtype.itemsize
    if copies * one + kept > free:
        activations = f" and {kept / 2**30:.1f} GiB of expert activations for a backward of {backward_tokens} tokens" if kept else ""
        raise MemoryError(
            f"{copies} x {one / 2**30:.1f} GiB of parameters ({config.model_type}, {parameters / 1e9:.2f}B parameters in "
            f"{str(dtype).removeprefix('torch.')}, {config.num_hidden_layers} layers, hidden {config.hidden_size}){activations} "
            f"do not fit in the {free / 2**30:.1f} GiB the {device.type} has free: pass --layers, --hidden or --intermediate "
            f"for a smaller model{' or --batch, --seq for fewer tokens' if kept else ''}"
        )


def kept_expert_activations(model, tokens: int) -> int:
    """Elements that a forward+backward of `tokens` tokens keeps for the backward in the routed experts alone: each MoE
    layer's gate and up projections of every (token, expert) pair, `tokens * k` rows of `2I`, which stock
    transformers' experts (every implementation) and occult_hf's backends all keep for the activation's gradient."""
    from occult_hf.patches import adapter_for

    adapter = adapter_for(model)
    top_k = model.config.num_experts_per_tok
    return sum(tokens * top_k * adapter.expert_weights(block)[0].shape[1] for _, _, block in adapter.iter_moe_blocks(model))


def decoder_matmul_flops(model, batch: int, seq: int) -> float:
    """FLOPs of the matrix products in one forward of `model.model` (the decoder, as timed here) on `batch` sequences
    of `seq` tokens: every `nn.Linear` (attention's projections, shared experts, dense MLPs), each MoE block's router
    and its `k` routed experts per token, and causal attention (its two `S x S` products, half of them masked). The
    backward's products are twice these, so a forward+backward does three times as many. At the dense GEMM rate they
    are the step's compute roofline: the norms, rotary and gathers come on top."""
    from occult_hf.patches import adapter_for

    decoder, config = model.model, model.config
    tokens = batch * seq
    flops = sum(2.0 * tokens * m.weight.numel() for m in decoder.modules() if isinstance(m, torch.nn.Linear))
    adapter = adapter_for(model)
    for _, _, block in adapter.iter_moe_blocks(decoder):
        router = adapter.router(block)
        if not isinstance(router, torch.nn.Linear):  # transformers 5's routers hold a bare [E, H] weight
            flops += 2.0 * tokens * router.weight.numel()
        gate_up_E2IH, down_EHI = adapter.expert_weights(block)
        flops += 2.0 * tokens * config.num_experts_per_tok * (gate_up_E2IH[0].numel() + down_EHI[0].numel())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    flops += config.num_hidden_layers * 2.0 * batch * heads * seq * seq * head_dim  # QK^T and PV, causal: half of 2 x 2BhS^2d
    return flops


def free_bytes(device: torch.device) -> int:
    """What `device` has free now: the GPU's free memory, or the memory the OS can give this process."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_bytes()


@dataclass
class ModelRow:
    shape: str
    tokens: int
    layers: int
    implementation: str
    fwd_ms: float
    fwd_bwd_ms: float
    stock_experts: str
    roofline_fwd_ms: float  # the decoder's matrix products at the dense GEMM rate measured in the same run
    roofline_fwd_bwd_ms: float


def _timer(device, warmup_ms: float, rep_ms: float):
    if torch.device(device).type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def wall(fn):  # CPU dry runs of the harness
        import time

        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def decoder_steps(model, ids_BS, decoder=None):
    """`step(backward)` of `model.model` (or `decoder`, its compiled form) on `ids_BS`: a forward under `no_grad`, or
    a forward + backward of a fixed random upstream gradient of the last hidden state (gradients cleared after it, so
    no step pays for accumulation)."""
    parameters = list(model.model.parameters())
    decoder = model.model if decoder is None else decoder
    hidden = decoder(input_ids=ids_BS).last_hidden_state
    upstream = torch.randn_like(hidden)
    del hidden

    def step(backward: bool) -> None:
        if not backward:
            with torch.no_grad():
                decoder(input_ids=ids_BS)
            return
        decoder(input_ids=ids_BS).last_hidden_state.backward(upstream)
        for param in parameters:
            param.grad = None

    return step


@contextlib.contextmanager
def moe_block_ranges(model):
    """Inside: every MoE block of `model` (stock transformers' or occult_hf's) runs in a named range `occult::moe
    block`, so that a profile gives the device time of the whole block in both models, measured rather than by
    difference (forward only: the autograd engine runs the backward outside it)."""
    from occult_hf.patches import adapter_for

    open_ranges, hooks = [], []

    def enter(module, args):
        open_ranges.append(torch.profiler.record_function("occult::moe block").__enter__())

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for _, path, _ in adapter_for(model).iter_moe_blocks(model):
        block = model.get_submodule(path)  # the OccultMoE at that path, or the stock block itself
        hooks += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def time_decoder(model, ids_BS, timer, decoder=None) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of `model.model` (or `decoder`, its compiled form) on `ids_BS`."""
    step = decoder_steps(model, ids_BS, decoder)
    step(False)
    step(True)  # a compiled decoder compiles its forward and backward graphs here, outside the timing
    return timer(lambda: step(False)), timer(lambda: step(True))


def measure(shape: str, args, device, dtype, dense_tflops: float) -> list[ModelRow]:
    from occult_hf import apply_occult
    from occult_hf.benchmarks.ep import profile_steps

    config = model_config(shape, args.layers, args.hidden, args.intermediate)
    stock = build_model(config, device, dtype, args.seed, copies=2 + len(args.backends), backward_tokens=args.batch * args.seq)  # stock, its copies, one's gradients
    experts_impl = str(getattr(stock.config, "_experts_implementation", None) or "default")
    fwd_flops = decoder_matmul_flops(stock, args.batch, args.seq)
    roofline_ms = (fwd_flops / dense_tflops / 1e9, 3 * fwd_flops / dense_tflops / 1e9)
    print(f"{shape}: {fwd_flops / 1e12:.2f} TFLOP of matrix products a forward, {3 * fwd_flops / 1e12:.2f} a forward+backward; "
          f"at the dense GEMM rate of this run ({dense_tflops:.3g} TFLOP/s) {roofline_ms[0]:.2f} / {roofline_ms[1]:.2f} ms", flush=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids_BS = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator, device=device)
    timer = _timer(device, args.warmup_ms, args.rep_ms)
    models = {"stock": stock}
    for backend in args.backends:
        models[occult_name(backend)] = apply_occult(copy.deepcopy(stock), {"num_devices": 1, "expert_backend": backend})
    rows = []
    for name, model in models.items():
        if name != "stock":
            with torch.no_grad():  # the same function: report the difference
                diff = (model.model(input_ids=ids_BS).last_hidden_state.float() - stock.model(input_ids=ids_BS).last_hidden_state.float()).abs().max().item()
            print(f"{shape}: max |{name} - stock| of the last hidden state = {diff:.3g} ({dtype})", flush=True)
        if args.profile:
            with moe_block_ranges(model):
                summary = profile_steps(decoder_steps(model, ids_BS), device, warm=True, top=args.profile)
            print(f"### {shape}, {name}, {args.batch * args.seq} tokens\n\n{summary}\n", flush=True)
        fwd, fwd_bwd = time_decoder(model, ids_BS, timer)
        rows.append(ModelRow(shape, args.batch * args.seq, args.layers, name, fwd, fwd_bwd, experts_impl, *roofline_ms))
        print(f"{shape} {name}: fwd {fwd:.2f} ms, fwd+bwd {fwd_bwd:.2f} ms", flush=True)
        if args.compile:
            torch._dynamo.reset()
            compiled = torch.compile(model.model)
            try:
                fwd, fwd_bwd = time_decoder(model, ids_BS, timer, compiled)
            except Exception as error:  # noqa: BLE001 - a model that fails to compile is a row, not the end of the run
                fwd = fwd_bwd = float("nan")
                print(f"{shape} {name} compiled: failed: {failure_text(error)}", flush=True)
            rows.append(ModelRow(shape, args.batch * args.seq, args.layers, f"{name} compiled", fwd, fwd_bwd, experts_impl, *roofline_ms))
            print(f"{shape} {name} compiled: fwd {fwd:.2f} ms, fwd+bwd {fwd_bwd:.2f} ms", flush=True)
            if args.profile and not math.isnan(fwd):  # the compiled graph's kernels (no block ranges: hooks inside it would break it)
                summary = profile_steps(decoder_steps(model, ids_BS, compiled), device, warm=True, top=args.profile)
                print(f"### {shape}, {name} compiled, {args.batch * args.seq} tokens\n\n{summary}\n", flush=True)
    del stock, models
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def occult_name(backend: str) -> str:
    """The table's name of the occult_hf model on expert backend `backend` ("occult" for the default, "auto")."""
    return "occult" if backend == "auto" else f"occult ({backend})"


def results_table(rows: list[ModelRow]) -> str:
    """One line per (shape, model): its times and its speed-up over stock transformers eager and, where measured,
    compiled."""
    from occult_hf.utils.tables import markdown_table

    by = {(row.shape, row.implementation): row for row in rows}
    compiled = any(row.implementation == "stock compiled" for row in rows)
    headers = ["shape", "tokens", "layers", "stock experts impl.", "model", "fwd ms", "fwd+bwd ms", "fwd vs stock",
               "fwd+bwd vs stock"] + (["fwd vs stock compiled", "fwd+bwd vs stock compiled"] if compiled else []) + [
               "fwd % roofline", "fwd+bwd % roofline"]  # fmt: skip
    lines = []
    for row in rows:
        line = [row.shape, row.tokens, row.layers, row.stock_experts, row.implementation, f"{row.fwd_ms:.2f}", f"{row.fwd_bwd_ms:.2f}"]
        for baseline in ("stock",) + (("stock compiled",) if compiled else ()):
            base = by[(row.shape, baseline)]
            line += [f"{base.fwd_ms / row.fwd_ms:.2f}x", f"{base.fwd_bwd_ms / row.fwd_bwd_ms:.2f}x"]
        line += [f"{100 * row.roofline_fwd_ms / row.fwd_ms:.0f}%", f"{100 * row.roofline_fwd_bwd_ms / row.fwd_bwd_ms:.0f}%"]
        lines.append(line)
    return markdown_table(headers, lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences (B)")
    parser.add_argument("--seq", type=positive_int, default=4096, help="sequence length (S); T = B*S tokens")
    parser.add_argument("--hidden", type=dry_run_hidden, default=None,
                        help=f"override H (CPU dry runs; a multiple of {2 * DRY_RUN_HEADS}, {DRY_RUN_HEADS} attention heads)")
    parser.add_argument("--intermediate", type=positive_int, default=None, help="override the expert/MLP widths (CPU dry runs)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--warmup-ms", type=positive_float, default=100.0, help="do_bench warm-up (ms; default: %(default)s)")
    parser.add_argument("--rep-ms", type=positive_float, default=500.0, help="do_bench repetition time (ms; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=list(expert_backend_names()),
                        help="occult_hf expert backends (OccultConfig.expert_backend), one occult_hf model each")
    parser.add_argument("--compile", action="store_true",
                        help="also time every model as torch.compile(model.model) (inductor): the rows a user compares with")
    parser.add_argument("--profile", type=int, default=0,
                        help="print a profile of one forward and one forward+backward of each model (N costliest kernels)")
    parser.add_argument("--out", default="docs", help="directory for bench_model_<device>.md/.json (default: ./docs)")


def run(args: argparse.Namespace) -> int:
    from occult_hf.benchmarks.experts import DENSE_GEMM_SIZE, dense_gemm_tflops, machine_line
    from occult_hf.cli import check_output_dir

    check_output_dir(args.out)  # before the run, not after its minutes of measuring
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dense_size = DENSE_GEMM_SIZE if device.type == "cuda" else 1024  # the CPU's rate only needs to be of the right order
    dense_tflops = dense_gemm_tflops(device, dtype, _timer(device, args.warmup_ms, args.rep_ms), dense_size)
    rows = []
    for shape in args.shapes:
        rows.extend(measure(shape, args, device, dtype, dense_tflops))
    table = results_table(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"`occult bench model`, one process, {dtype}, {stamp}, {machine_line(device)}; roofline: the decoder's matrix "
              f"products at the dense GEMM rate of this run ({dense_tflops:.3g} TFLOP/s, a {dense_size}^3 matmul)")
    print(f"\n{header}\n\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"bench_model_{device.type}.md", f"{header}\n\n{table}\n")
    atomic_write_text(out / f"bench_model_{device.type}.json", json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0
