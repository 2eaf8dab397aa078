"""occult models under `torch.compile`: one graph (`fullgraph=True`, so a graph break inside occult's code is a
failure here, not a silent slowdown), the same logits, loss and every gradient as eager, in one process and on 2
gloo ranks; a changing token count compiles once more, not at every step; `generate()` with a static cache runs
the compiled step and gives eager's greedy tokens.

`backend="aot_eager"` traces forward and backward through dynamo and AOTAutograd (the occult operators' fake
implementations and autograd formulas included) and runs the traced graphs without inductor, so the comparison
with eager is exact on the CPU. Inductor and CUDA graphs are the GPU tests' (`tests/test_gpu_compile.py`).

transformers installs its output-capturing hooks (router logits for the auxiliary loss) at a model's first call,
under a lock that dynamo cannot trace, so every model here runs once eagerly before it is compiled, as the
reference.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

from distributed import run_world
from tiny_models import FAMILIES, tiny_batch, tiny_model

from occult_hf import OccultConfig, apply_occult

BATCH, SEQ = 2, 12
#: Trainer steps of the compiled-training tests: N_d moves from 2 to 1 within them, and the drift watch runs once
TRAIN_STEPS = 4


def _loss_logits_grads(model, input_ids, call=None):
    """Loss, logits and every parameter's gradient of `model` from one forward + backward through `call`
    (the model itself, or its compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def _assert_same(reference, compiled, where: str) -> None:
    (loss, logits, grads), (c_loss, c_logits, c_grads) = reference, compiled
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-6, msg=f"{where}: logits")
    assert c_grads.keys() == grads.keys() and grads, f"{where}: parameters with a gradient differ"
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{where}: grad of {name}")


def _check_compiled_equals_eager(model, input_ids, where: str, backward: bool = True) -> None:
    """Compiled equals eager, and tracing warns about nothing in occult_hf's code (dynamo's warnings name the file)."""
    torch._dynamo.reset()
    model.train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    if backward:
        reference = _loss_logits_grads(model, input_ids)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _loss_logits_grads(model, input_ids, compiled)
        _assert_same(reference, result, where)
        ours = [str(w.message).splitlines()[0] for w in caught if "occult_hf" in str(w.message) or "occult_hf" in w.filename]
        assert not ours, f"{where}: tracing warned: {ours}"
        return
    with torch.no_grad():
        reference = model(input_ids=input_ids, labels=input_ids)
        out = compiled(input_ids=input_ids, labels=input_ids)
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-6, msg=f"{where}: logits")
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-5, atol=1e-6, msg=f"{where}: loss")


#: families whose stock transformers model (no occult_hf) cannot be compiled forward and backward on the CPU: there
#: the compiled forward is compared. Qwen3-Next's linear attention falls back to transformers' reference
#: `chunk_gated_delta_rule` without flash-linear-attention, whose backward AOTAutograd cannot replay ("view size is
#: not compatible with input tensor's size and stride"), stock model alike, up to transformers 5.24 (torch 2.13);
#: 5.25's compiles forward and backward, and there every family's gradients are compared.
FORWARD_ONLY = {"qwen3_next"} if Version(transformers.__version__) < Version("5.25") else set()


#: per family: one process with one device, 2 logical devices (the dedup dispatch to logical devices), and 2 logical
#: devices with router pruning to N_d=1 (the device walk, masked re-selection, the auxiliary loss's effective logits)
CASES = [(family, num_devices, prune) for num_devices, prune in ((1, None), (2, None), (2, "router")) for family in FAMILIES]


@pytest.mark.parametrize(("family", "num_devices", "prune"), CASES, ids=lambda v: str(v))
def test_compiled_model_equals_eager(family, num_devices, prune):
    model = tiny_model(family)
    settings = {"num_devices": num_devices}
    if prune:
        settings.update(prune=prune, max_devices_per_token=1)
    apply_occult(model, OccultConfig(**settings))
    where = f"{family} D={num_devices} {prune}"
    _check_compiled_equals_eager(model, tiny_batch(batch=BATCH, seq=SEQ, seed=1), where, backward=family not in FORWARD_ONLY)


@pytest.mark.parametrize("family", sorted(FORWARD_ONLY))
def test_the_forward_only_families_fail_to_compile_their_backward_in_stock_transformers(family):
    """What `FORWARD_ONLY` says, checked: the stock model's compiled backward fails (when this starts passing, compare
    those families' gradients too)."""
    model = tiny_model(family).train()
    input_ids = tiny_batch(batch=BATCH, seq=SEQ, seed=1)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        compiled(input_ids=input_ids, labels=input_ids).loss.backward()


def test_compiled_model_with_similarity_pruning_and_exact_logical_devices(tmp_path):
    from occult_hf.profile import RoutingProfile

    documents = [tiny_batch(batch=1, seq=32, seed=s)[0].tolist() for s in range(4)]
    profile = tmp_path / "olmoe.safetensors"
    RoutingProfile.collect(tiny_model("olmoe"), documents, progress=False).save(profile)
    for settings in ({"num_devices": 2}, {"num_devices": 2, "prune": "similarity", "max_devices_per_token": 1, "profile": str(profile)}):
        model = tiny_model("olmoe")
        apply_occult(model, OccultConfig(**settings))
        _check_compiled_equals_eager(model, tiny_batch(batch=BATCH, seq=SEQ, seed=2), f"olmoe {settings}")


def _compiled_counting_compilations(model, input_ids):
    """`(compiled model, list that grows by one entry per compilation)`, `fullgraph=True`. The model runs eagerly on
    `input_ids` first: transformers installs its output-capturing hooks on the first call, which dynamo cannot trace."""
    model(input_ids=input_ids)
    torch._dynamo.reset()
    compiles = []

    def counting_backend(graph, example_inputs):
        compiles.append(len(example_inputs))
        return graph.forward

    return torch.compile(model, backend=counting_backend, fullgraph=True), compiles


def test_a_changing_token_count_compiles_once_more_not_every_step():
    """Token counts of 24, 36, 16, 40 and 28: the first two compile (the second with the token dimension marked
    dynamic, as dynamo does on a changed size), the rest reuse that graph."""
    model = tiny_model("qwen2_moe")
    apply_occult(model, OccultConfig(num_devices=2))
    compiled, compiles = _compiled_counting_compilations(model, tiny_batch(batch=2, seq=8, seed=0))
    with torch.no_grad():
        for seq in (12, 18, 8, 20, 14):
            compiled(input_ids=tiny_batch(batch=2, seq=seq, seed=seq))
    assert len(compiles) == 2, f"{len(compiles)} compilations for 5 steps of different token counts"


def test_cpu_autocast_leaves_the_experts_in_their_dtype_eager_and_compiled_as_stock():
    """Under `torch.autocast("cpu", bfloat16)` stock's grouped GEMMs and occult's compiled operator run the experts in
    fp32; eager occult ran the portable reference through autocast, in bf16 (logits up to 4e-3 off stock's)."""
    input_ids = tiny_batch(batch=2, seq=12, seed=1)
    stock = tiny_model("olmoe").eval()
    model = apply_occult(tiny_model("olmoe").eval(), OccultConfig(num_devices=2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = stock(input_ids=input_ids).logits
        eager = model(input_ids=input_ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=input_ids).logits
    torch.testing.assert_close(eager, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)


def test_an_exported_pruned_model_runs_at_other_token_counts():
    """`torch.export` with dynamic batch and sequence of a model with router pruning: the pruner's token tally made
    a tensor of the traced token count, which fixed it (a guard failed at any other shape)."""
    from torch.export import Dim

    model = tiny_model("olmoe", output_router_logits=False).eval()
    apply_occult(model, OccultConfig(num_devices=2, prune="router", max_devices_per_token=1))
    shapes = {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)}, "use_cache": None}
    exported = torch.export.export(
        model, (), {"input_ids": tiny_batch(batch=2, seq=12, seed=1), "use_cache": False}, strict=False, dynamic_shapes=shapes
    ).module()
    input_ids = tiny_batch(batch=3, seq=7, seed=2)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    torch.testing.assert_close(exported(input_ids=input_ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-6)


def test_dynamic_compile_does_not_tie_the_expert_count_to_an_input_size():
    """`dynamic=True` with a first sequence as long as the experts are many (8): the placement's tensors were symbolic,
    so dynamo tied E to the sequence length and compiled once more than stock; now as often as stock."""
    counts = {}
    for name in ("stock", "occult"):
        model = tiny_model("olmoe")
        if name == "occult":
            apply_occult(model, OccultConfig(num_devices=2))
        model(input_ids=tiny_batch(batch=2, seq=8, seed=0))
        torch._dynamo.reset()
        compiles = []
        compiled = torch.compile(model, backend=lambda graph, _: compiles.append(1) or graph.forward, fullgraph=True, dynamic=True)
        with torch.no_grad():
            for batch, seq in ((2, 8), (3, 11), (2, 16)):
                compiled(input_ids=tiny_batch(batch=batch, seq=seq, seed=seq))
        counts[name] = len(compiles)
    assert counts["occult"] == counts["stock"], counts


def test_profiling_a_compiled_model_does_not_compile_it_again():
    """The occult blocks' profiler ranges read the profiler's state only in eager code: a compiled model run under
    `torch.profiler` is the graph compiled without it (one compilation), and its output is the same."""
    model = tiny_model("olmoe")
    apply_occult(model, OccultConfig(num_devices=2))
    input_ids = tiny_batch(batch=2, seq=8, seed=0)
    compiled, compiles = _compiled_counting_compilations(model, input_ids)
    with torch.no_grad():
        plain = compiled(input_ids=input_ids).logits
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            profiled = compiled(input_ids=input_ids).logits
    assert len(compiles) == 1, f"{len(compiles)} compilations: the profiler's state is guarded on"
    torch.testing.assert_close(profiled, plain, rtol=0, atol=0)


def test_static_cache_generate_runs_the_compiled_step_with_eager_tokens():
    """`generate(cache_implementation="static")` with a compile config (on the CPU transformers compiles only
    when asked: `_compile_all_devices`) decodes through the compiled forward: the same greedy tokens as eager
    generation, for the stock model and the occult one alike, and the compiled step was used."""
    from transformers import CompileConfig

    prompt = tiny_batch(batch=2, seq=6, seed=3)
    stock = tiny_model("olmoe")
    model = tiny_model("olmoe")
    apply_occult(model, OccultConfig(num_devices=2))
    kwargs = dict(max_new_tokens=5, do_sample=False, output_router_logits=False)
    expected = stock.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, **kwargs), expected)  # eager, dynamic cache
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    tokens = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(tokens, expected)
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile the decoding step"


def test_one_static_cache_passed_to_every_call_keeps_the_compiled_step_at_one_address():
    """docs/runtime.md's serving recipe: one `StaticCache` passed to every `generate()` (reset before each) decodes
    through the compiled step with the tokens of `cache_implementation="static"`, and the step's cache inputs sit at
    one address in every call, where `cache_implementation="static"` makes a new cache per call (on a GPU, a call
    whose cache lands at new addresses records another CUDA graph)."""
    from transformers import CompileConfig, StaticCache

    keys_seen = []  # the first layer's keys tensor at each compiled step, held so that no address is reused

    def recording_backend(graph, example_inputs, **_):
        names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
        keys = next(i for i, name in enumerate(names) if name.endswith("layers_0_keys"))

        def run(*args):
            keys_seen.append(args[keys])
            return graph(*args)

        return run

    model = apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=2))
    prompt = tiny_batch(batch=1, seq=6, seed=3)
    compile_config = CompileConfig(backend=recording_backend, fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_router_logits=False, compile_config=compile_config)
    torch._dynamo.reset()
    expected = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), expected)
    assert keys_seen[0].data_ptr() != keys_seen[-1].data_ptr(), "transformers kept its static cache: the recipe is moot"
    keys_seen.clear()
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + 5)
    for _ in range(3):
        cache.reset()
        assert torch.equal(model.generate(prompt, past_key_values=cache, **kwargs), expected)
    assert len(keys_seen) == 3 * 4 and {keys.data_ptr() for keys in keys_seen} == {cache.layers[0].keys.data_ptr()}


def _ep_world(rank, world_size):
    """Under EP (2 gloo ranks, different batches per rank) the compiled model equals eager, with each dispatcher
    that serves torch.distributed ranks (compiled, "all_to_all" exchanges through static capacities); and the ranks
    decode in lockstep through the compiled static-cache step with the tokens of the one-process model."""
    from occult_hf.placement import Placement

    results = {}
    for dispatcher in ("all_to_all", "padded"):
        model = tiny_model("olmoe")
        placement = Placement(8, 2, {layer: [(3 * e + layer) % 2 for e in range(8)] for layer in (0, 1)})
        apply_occult(model, OccultConfig(placement=placement, dispatcher=dispatcher))
        _check_compiled_equals_eager(model, tiny_batch(batch=BATCH, seq=SEQ, seed=10 + rank), f"rank {rank} {dispatcher}")
        results[dispatcher] = type(model.model.layers[0].mlp.dispatcher).__name__
    # decoding in lockstep: generate() with a static cache through the compiled step, each rank its own prompts
    from transformers import CompileConfig

    prompt = tiny_batch(batch=2, seq=6, seed=20 + rank)
    kwargs = dict(max_new_tokens=5, do_sample=False, output_router_logits=False)
    expected = tiny_model("olmoe").generate(prompt, **kwargs)
    model = apply_occult(tiny_model("olmoe"), OccultConfig())
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    tokens = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kwargs)
    results["static generate"] = bool(torch.equal(tokens, expected))
    # ranks that pass different token counts to a compiled step: an error on both, not gloo aborting the processes
    from occult_hf.dispatch.base import ExchangeError

    model = apply_occult(tiny_model("olmoe"), OccultConfig(placement=placement))
    model(tiny_batch(batch=2, seq=SEQ, seed=30))  # the first call eager (transformers' hooks)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(tiny_batch(batch=2, seq=SEQ, seed=31))
    try:
        compiled(tiny_batch(batch=2, seq=(SEQ, SEQ - 2)[rank], seed=32))
    except ExchangeError as error:
        results["unequal tokens"] = "a compiled forward under expert parallelism needs the same number of tokens" in str(error)
    model.to((torch.float32, torch.bfloat16)[rank])  # cast apart: the check names the row formats too
    try:
        compiled(tiny_batch(batch=2, seq=SEQ, seed=33))
    except ExchangeError as error:
        results["cast apart"] = f"EP rank {1 - rank} sends rows of format" in str(error)
    return results


@pytest.mark.world_size(2)
def test_compiled_model_equals_eager_on_2_ranks():
    expected = {"all_to_all": "AllToAllDispatcher", "padded": "PaddedDispatcher", "static generate": True, "unequal tokens": True,
                "cast apart": True}  # fmt: skip
    assert run_world(_ep_world, 2, timeout_s=600) == [expected] * 2


def test_a_failed_compile_leaves_the_eager_model_working():
    """A compile that raises (here: a backend that fails) does not touch the model: eager still computes the same."""
    model = tiny_model("olmoe")
    apply_occult(model, OccultConfig(num_devices=2))
    input_ids = tiny_batch(batch=BATCH, seq=SEQ, seed=4)
    with torch.no_grad():
        before = model(input_ids=input_ids).logits

    def failing_backend(graph, example_inputs):
        raise RuntimeError("backend failed on purpose")

    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend failed on purpose"):
        with torch.no_grad():
            torch.compile(model, backend=failing_backend, fullgraph=True)(input_ids=input_ids)
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits, before)


def _trainer_losses(model, output_dir: str, compile_: bool, callbacks=()):
    """The per-step losses of a Trainer run, compiled with `aot_eager` or eager. The backend is passed only with
    `compile_`: `TrainingArguments` turns `torch_compile` on whenever a backend is named, so the eager reference
    would be compiled too (and compared with itself)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = [tiny_batch(batch=1, seq=SEQ, seed=s)[0].tolist() for s in range(16)]
    args = TrainingArguments(
        output_dir, per_device_train_batch_size=2, max_steps=TRAIN_STEPS, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        torch_compile=compile_, torch_compile_backend="aot_eager" if compile_ else None, save_strategy="no", learning_rate=1e-3,
        disable_tqdm=True,
    )  # fmt: skip
    assert args.torch_compile == compile_
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}), callbacks=list(callbacks))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_torch_compile_equals_eager_with_no_graph_break(tmp_path):
    """`TrainingArguments(torch_compile=True)` (accelerate's dynamo plugin) on an occult model with collaboration
    pruning, `OccultCallback`'s N_d schedule and its drift watch (the profile collector's router hooks run inside the
    compiled forward), and with LoRA: the same per-step losses as eager training, and not one graph break.
    LoRA adapts the attention projections: peft's adapters on fused expert parameters (`target_parameters`, a
    parametrization that `set_`s the weight) do not compile with `fullgraph` on the stock model either. (Full
    fine-tuning's compiled gradients, experts included, are `test_compiled_model_equals_eager`'s.)"""
    import peft
    from torch._dynamo.utils import counters

    from occult_hf import OccultCallback
    from occult_hf.hf.peft_support import get_peft_model

    losses = {}
    for compile_ in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model("olmoe").train()
        apply_occult(model, OccultConfig(num_devices=2, prune="router", max_devices_per_token=1))
        torch.manual_seed(0)  # the adapters' initialisation: the same in both runs
        model = get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        warm_ids = tiny_batch(batch=1, seq=SEQ, seed=0)
        model(input_ids=warm_ids, labels=warm_ids)  # transformers' capture hooks are installed at the first call
        callback = OccultCallback(start_devices_per_token=2, schedule_steps=2, check_every=2)
        losses[compile_] = _trainer_losses(model, str(tmp_path / str(compile_)), compile_, [callback])
    assert len(losses[True]) == TRAIN_STEPS
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-6)
    assert counters["stats"]["unique_graphs"] > 0, "the Trainer did not compile the model"
    assert not counters["graph_break"], f"graph breaks: {list(counters['graph_break'])}"


#: where DDP's own forward leaves a compiled graph (torch.nn.parallel.distributed)
DDP_OWN_BREAKS = ("DistributedDataParallel._inside_ddp_forward", "set_runtime_stats_and_log")


class _RecordingStreamer:
    """A `generate()` streamer that keeps what it is given (transformers' `BaseStreamer` protocol)."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.detach().clone().reshape(-1))

    def end(self):
        self.ended = True


def test_compiled_static_generate_with_sampling_eos_streamer_and_left_padding():
    """What users pass to `generate()`, through the compiled static-cache step of an occult model with pruning to
    1 of 2 logical devices, gives the tokens of the same model's eager dynamic-cache `generate()`: left-padded
    prompts of different lengths at batch 3, greedy and sampled (the same seed), an EOS token that stops one
    sequence early (it is padded after it, the others go on), and a streamer that receives every new token."""
    from transformers import CompileConfig

    model = tiny_model("olmoe")
    apply_occult(model, OccultConfig(num_devices=2, prune="router", max_devices_per_token=1))
    model.eval()
    prompt = tiny_batch(batch=3, seq=7, seed=5)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding: sequence 1 has 4 tokens, sequence 2 has 6
    mask[2, :1] = 0
    prompt = prompt.masked_fill(mask == 0, 0)
    common = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0, output_router_logits=False)
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True

    def both(**kwargs):
        """(eager dynamic-cache tokens, compiled static-cache tokens) of the same call, sampling seeded alike."""
        torch.manual_seed(7)
        eager = model.generate(prompt, **common, **kwargs)
        torch.manual_seed(7)
        compiled = model.generate(prompt, **common, cache_implementation="static", compile_config=compile_config, **kwargs)
        return eager, compiled

    torch._dynamo.reset()
    greedy, compiled = both(do_sample=False)
    assert torch.equal(compiled, greedy)
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile the decoding step"
    sampled, compiled = both(do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(compiled, sampled) and not torch.equal(sampled, greedy)
    # EOS: the token sequence 0 greedily produces at its third step ends it there; padding follows
    eos = int(greedy[0, prompt.shape[1] + 2])
    stopped, compiled = both(do_sample=False, eos_token_id=eos)
    assert torch.equal(compiled, stopped)
    new = stopped[0, prompt.shape[1] :]
    first = int((new == eos).nonzero()[0])
    assert first <= 2 and (new[first + 1 :] == 0).all(), new
    streamer = _RecordingStreamer()
    torch.manual_seed(7)
    streamed = model.generate(prompt, **common, do_sample=False, cache_implementation="static", compile_config=compile_config, streamer=streamer)
    assert streamer.ended and torch.equal(torch.stack(streamer.chunks[1:], dim=1), streamed[:, prompt.shape[1] :])


def _ep_trainer_compiled(rank, world_size, output_dir):
    """One rank of an EP Trainer run (eager, then `torch_compile=True`) with OccultCallback and LoRA: its losses
    and the graph breaks of the compiled run."""
    import peft
    from torch._dynamo.utils import counters

    from occult_hf import OccultCallback
    from occult_hf.hf.peft_support import get_peft_model
    from occult_hf.placement import Placement

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29512",
    )
    losses = {}
    for compile_ in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model("olmoe", output_router_logits=False).train()
        placement = Placement(8, 2, {layer: [(3 * e + layer) % 2 for e in range(8)] for layer in (0, 1)})
        apply_occult(model, OccultConfig(placement=placement, prune="router", max_devices_per_token=1, dispatcher="padded"))
        torch.manual_seed(0)  # the adapters' initialisation: the same in both runs
        model = get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        warm_ids = tiny_batch(batch=1, seq=SEQ, seed=0)
        model(input_ids=warm_ids, labels=warm_ids)  # transformers' capture hooks are installed at the first call
        callback = OccultCallback(start_devices_per_token=2, schedule_steps=2, check_every=2)
        losses[compile_] = _trainer_losses(model, os.path.join(output_dir, f"{rank}-{compile_}"), compile_, [callback])
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    return losses, graphs, breaks


@pytest.mark.world_size(2)
def test_trainer_with_torch_compile_under_expert_parallelism(tmp_path):
    """`TrainingArguments(torch_compile=True)` on 2 gloo EP ranks, with OccultCallback's N_d schedule and LoRA: each
    rank's per-step losses equal its eager run's, the model was compiled, and the only graph breaks are DDP's own
    (accelerate compiles the DDP wrapper, whose forward dynamo deliberately leaves at `_inside_ddp_forward` and its
    logger; a stock model under DDP breaks there alike), none inside the model."""
    for losses, graphs, breaks in run_world(_ep_trainer_compiled, 2, str(tmp_path), timeout_s=600):
        assert len(losses[True]) == TRAIN_STEPS
        assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-6)
        assert graphs > 0, "the Trainer did not compile the model"
        outside_ddp = [reason for reason in breaks if not any(mark in reason for mark in DDP_OWN_BREAKS)]
        assert not outside_ddp, f"graph breaks: {outside_ddp}"
