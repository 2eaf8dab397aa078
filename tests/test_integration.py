"""Integration: from_pretrained(occult_config=...), save -> reload, unapply, generate, Trainer, errors.

One process: `from_pretrained` with an OccultConfig / dict / JSON path, through the Auto class and
the model class; a saved replaced model reloads as the vanilla model in plain transformers and as
the same occult setup with occult_hf; `unapply_occult` returns the trained original blocks; pruning
is wired in; clear errors.

A 2-rank gloo world: greedy `generate()` of every family with different prompt lengths and
different `max_new_tokens` per rank returns the reference tokens (ranks finish at different steps);
save -> reload round trips under EP after a training step (vanilla weights in plain transformers, the
placement restored with occult_hf, and loading the saved directory under EP); `unapply_occult`
under EP; a rank-0-only save without a snapshot fails with a clear error instead of hanging; errors
for a world size that differs from num_devices.

A 2-rank HF Trainer run (torchrun-like environment, DDP through accelerate, default gradient
clipping, checkpointing through the Trainer's own save) gives the same per-step losses, gradient
norms and final weights as a single-process Trainer run on the same data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from distributed import run_world
from occult_logs import occult_records
from tiny_models import FAMILIES, MOE_LAYERS, tiny_batch, tiny_checkpoint, tiny_model

TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _installed():
    from occult_hf.hf.apply import install

    install()
    yield


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def shuffled_placement(family: str, num_experts: int, num_devices: int):
    import numpy as np

    from occult_hf import Placement

    base = (np.arange(num_experts) * num_devices // num_experts).tolist()
    layers = {layer: np.random.default_rng(layer).permutation(base).tolist() for layer in MOE_LAYERS[family]}
    return Placement(num_experts, num_devices, layers, {"method": "shuffled"})


def load(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs).float().eval()


def train_one_step(model, ids, lr=0.05):
    """One SGD step on `ids` so that saved weights differ from the initial ones (under EP through DDP,
    which averages the replicated parameters' gradients and leaves the experts to the runtime)."""
    model.train()
    if torch.distributed.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)  # kept alive through backward: its hooks average the gradients
        ddp(input_ids=ids, labels=ids).loss.backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None
    model.eval()


def is_replaced(model) -> bool:
    return any(type(m).__name__ == "OccultMoE" for m in model.modules())


# ----- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["object", "dict", "json"])
def test_from_pretrained_accepts_occult_config(tmp_path, form):
    from transformers import OlmoeForCausalLM

    from occult_hf import OccultConfig
    from occult_hf.hf.apply import occult_config_of

    checkpoint = tiny_checkpoint("olmoe", tmp_path / "ckpt", seed=1)
    config = OccultConfig(placement=shuffled_placement("olmoe", 8, 2), dispatch="per_expert", num_devices=2)
    value = {"object": config, "dict": config.to_dict(), "json": str(tmp_path / "occult.json")}[form]
    config.save(tmp_path / "occult.json")
    ids = tiny_batch()
    vanilla = load(checkpoint)
    for model in (load(checkpoint, occult_config=value), OlmoeForCausalLM.from_pretrained(checkpoint, occult_config=value).eval()):
        assert is_replaced(model) and occult_config_of(model) == config
        assert rel_err(model(ids).logits, vanilla(ids).logits) <= TOLERANCE
    assert not is_replaced(vanilla)


@pytest.fixture
def reinstalled():
    """A test that uninstalls occult_hf's hooks gets them back at its end, passed or failed: the tests after it in
    the same process (a pytest-xdist worker runs whichever it is given) load through them."""
    from occult_hf.hf.apply import install

    yield
    install()


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek"])
def test_save_reload_round_trip_one_process(tmp_path, family, reinstalled):
    """Fused experts with transformers' checkpoint conversion (Qwen2-MoE) and with occult_hf's own (DeepSeek-MoE)."""
    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult, occult_config_of, uninstall

    placement = shuffled_placement(family, 8, 3)
    model = apply_occult(tiny_model(family, seed=2), OccultConfig(placement=placement))
    ids = tiny_batch(seed=4)
    train_one_step(model, ids)
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "saved")

    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config["occult_config"]["placement"]["layers"] == {str(k): v for k, v in placement.layers.items()}
    assert Placement.load(tmp_path / "saved") == placement
    # the weight files hold exactly what a vanilla model of this class saves
    tiny_model(family, seed=2).save_pretrained(tmp_path / "vanilla")
    assert _checkpoint_shapes(tmp_path / "saved") == _checkpoint_shapes(tmp_path / "vanilla")

    with_occult = load(tmp_path / "saved")
    assert is_replaced(with_occult) and occult_config_of(with_occult).placement == placement
    assert rel_err(with_occult(ids).logits, expected) <= TOLERANCE
    # an edit of the placement file alone was ignored without a word (config.json's copy loads): said, naming both;
    # the file itself loads when asked for
    edited = Placement(8, 3, {layer: [2 - d for d in placement.device_of(layer)] for layer in placement.layers})
    (tmp_path / "edited").mkdir()
    for file in (tmp_path / "saved").iterdir():
        (tmp_path / "edited" / file.name).write_bytes(file.read_bytes())
    edited.save(tmp_path / "edited" / "occult_placement.json")
    with occult_records() as records:
        assert occult_config_of(load(tmp_path / "edited")).placement == placement
    said = [r.getMessage() for r in records if "holds another placement than occult_config's own" in r.getMessage()]
    assert len(said) == 1 and "(expert -> device maps differ at layers [" in said[0], said
    reloaded = load(tmp_path / "edited", occult_config={"placement": str(tmp_path / "edited" / "occult_placement.json")})
    assert occult_config_of(reloaded).placement == edited and rel_err(reloaded(ids).logits, expected) <= TOLERANCE
    without = load(tmp_path / "saved", occult_config=None)
    assert not is_replaced(without) and rel_err(without(ids).logits, expected) <= TOLERANCE
    uninstall()  # plain transformers
    plain = load(tmp_path / "saved")
    assert not is_replaced(plain) and rel_err(plain(ids).logits, expected) <= TOLERANCE


def _checkpoint_shapes(directory: Path) -> dict[str, tuple]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def test_torch_save_and_load_keep_occult_methods(tmp_path):
    """`torch.save(model)` / `torch.load` of an occult model (pickle): the loaded model has occult's `save_pretrained`
    bound to itself, and its save holds the experts in transformers' order (stock transformers loads the logits)."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = apply_occult(tiny_model("olmoe", seed=2), OccultConfig(placement=shuffled_placement("olmoe", 8, 3)))
    torch.save(model, tmp_path / "model.pt")  # before a forward: transformers' output hooks do not pickle
    ids = tiny_batch(seed=4)
    expected = model(ids).logits
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.save_pretrained.__self__ is loaded and rel_err(loaded(ids).logits, expected) == 0
    loaded.save_pretrained(tmp_path / "saved")
    assert rel_err(load(tmp_path / "saved", occult_config=None)(ids).logits, expected) <= TOLERANCE


def test_hooks_on_a_replaced_block_are_named_in_a_warning():
    """Hooks a user put on the MoE block or its experts module stop running once the block is replaced (an
    output-changing one silently stopped applying)."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = tiny_model("olmoe", seed=2)
    block = model.model.layers[0].mlp
    block.register_forward_hook(lambda module, args, out: out * 2)
    block.experts.register_forward_pre_hook(lambda module, args: None)
    with occult_records() as records:
        apply_occult(model, OccultConfig(num_devices=2))
    (message,) = [r.getMessage() for r in records if "will not run" in r.getMessage()]
    assert message.startswith("layer 0 (OlmoeSparseMoeBlock): 1 forward hook(s) on the block, 1 forward pre-hook(s) on its experts module will not run")


def test_a_converted_model_moves_to_meta_and_refuses_a_jit_trace():
    """`.to("meta")` failed half-way ("Cannot copy out of meta tensor": the dispatcher's choice read the moved
    layout); a `torch.jit.trace` recorded one batch's dispatch and was wrong on any other batch of the same shape."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = apply_occult(tiny_model("qwen2_moe", seed=2), OccultConfig(placement=shuffled_placement("qwen2_moe", 8, 2)))
    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record an occult MoE block"):
        torch.jit.trace(Logits(model), (tiny_batch(seed=4),), strict=False, check_trace=False)
    model.to("meta")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("family", ["olmoe", "deepseek"])
def test_unapply_returns_the_trained_original_blocks(family):
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, unapply_occult

    model = tiny_model(family, seed=5)
    blocks = {name: module for name, module in model.named_modules() if name.endswith("mlp")}
    apply_occult(model, OccultConfig(num_devices=2))
    ids = tiny_batch(seed=6)
    train_one_step(model, ids)
    expected = model(ids).logits
    unapply_occult(model)
    assert not is_replaced(model) and not hasattr(model.config, "occult_config")
    assert all(model.get_submodule(name) is block for name, block in blocks.items())
    assert "save_pretrained" not in model.__dict__
    assert rel_err(model(ids).logits, expected) <= TOLERANCE


def test_pruning_is_applied_after_routing():
    """prune='router' with N_d=1 on 2 logical devices: each token's experts sit on one device."""
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = apply_occult(
        tiny_model("olmoe", seed=1), OccultConfig(num_devices=2, prune="router", max_devices_per_token=1)
    )
    model(tiny_batch())
    for module in occult_modules(model).values():
        devices_Tk = module.layout.device_of_E[module.last_topk_ids_Tk]
        assert torch.all(devices_Tk == devices_Tk[:, :1])
        assert int(module.stats.rows_sent.sum()) == module.last_topk_ids_Tk.shape[0]  # one row per token


def test_counters_report_rows_pairs_and_bytes():
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult, occult_modules, reset_counters

    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=4, dispatch="per_expert"))
    model(tiny_batch())
    model(tiny_batch(seed=1))
    for module in occult_modules(model).values():
        hidden, top_k = model.config.hidden_size, model.config.num_experts_per_tok
        assert int(module.stats.forwards) == 2 and int(module.stats.rows_sent.sum()) == 2 * 32 * top_k
        assert torch.equal(module.stats.pairs_sent, module.stats.rows_sent)
        assert torch.equal(module.stats.bytes_sent, module.stats.rows_sent * (hidden * 4 + 1 * (4 + 4)))
        # every count is a view of one buffer: a compiled forward adds to it in one kernel
        views = (module.stats.sent_D2, module.stats.rows_sent, module.stats.pairs_sent, module.stats.forwards)
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1 and len(list(module.stats.buffers())) == 2
    reset_counters(model)
    assert all(int(m.stats.rows_sent.sum()) == 0 and int(m.stats.forwards) == 0 for m in occult_modules(model).values())
    # rows of another size (fp64 activations and weights, fields 8-byte aligned) after the first forward's: their
    # bytes are theirs
    from occult_hf.dispatch.base import dispatch_format

    model.double()(tiny_batch())
    row_bytes = dispatch_format(hidden, torch.float64, 1, torch.float64).row_bytes
    for module in occult_modules(model).values():
        assert int(module.stats.forwards) == 1 and torch.equal(module.stats.bytes_sent, module.stats.rows_sent * row_bytes)
    # one device: static counts (every token one row in dedup, all pairs), twice the same T (the kept counts)
    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=1))
    model(tiny_batch())
    model(tiny_batch(seed=1))
    for module in occult_modules(model).values():
        assert module.stats.rows_sent.tolist() == [2 * 32] and module.stats.pairs_sent.tolist() == [2 * 32 * top_k]


def test_untracked_forwards_keep_no_routing_and_count_nothing_with_the_same_output():
    from occult_hf import OccultConfig, track_routing
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=4, prune="router", max_devices_per_token=2))
    tracked = model(tiny_batch()).logits
    kept = {name: module.last_topk_ids_Tk for name, module in occult_modules(model).items()}
    track_routing(model, False)
    untracked = model(tiny_batch(seed=1)).logits
    assert not torch.equal(untracked, tracked) and torch.equal(model(tiny_batch()).logits, tracked)
    for name, module in occult_modules(model).items():
        assert module.last_topk_ids_Tk is kept[name] and int(module.stats.forwards) == 1
    track_routing(model)
    model(tiny_batch(seed=1))
    for name, module in occult_modules(model).items():
        assert module.last_topk_ids_Tk is not kept[name] and int(module.stats.forwards) == 2


def test_track_routing_as_a_context_manager_restores_each_layers_setting():
    from occult_hf import OccultConfig, track_routing
    from occult_hf.hf.apply import apply_occult, occult_modules

    model = apply_occult(tiny_model("olmoe", seed=1), OccultConfig(num_devices=2))
    first, second = occult_modules(model).values()
    second.track = False  # one layer already off: the block must give it back off
    with track_routing(model, False):
        assert not first.track and not second.track
        model(tiny_batch())
        assert first.last_topk_ids_Tk is None and int(first.stats.forwards) == 0
    assert first.track and not second.track
    model(tiny_batch())
    assert first.last_topk_ids_Tk is not None and int(first.stats.forwards) == 1 and int(second.stats.forwards) == 0


def test_a_bad_occult_config_fails_before_the_checkpoint_is_read(tmp_path):
    """from_pretrained(occult_config=<bad>) must not read a whole checkpoint (minutes for a real one) and
    only then reject the config: here the weights file is garbage, so reading it first would fail on it."""
    import transformers

    import occult_hf  # noqa: F401  (from_pretrained takes occult_config=)

    checkpoint = tiny_checkpoint("olmoe", tmp_path / "checkpoint")
    (checkpoint / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not a header")
    bad = [
        ({"num_device": 2}, "did you mean 'num_devices'"),
        ({"num_devices": 2, "prune": "router", "max_devices_per_token": 3}, "cannot exceed num_devices (2)"),
    ]
    for occult_config, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            transformers.AutoModelForCausalLM.from_pretrained(checkpoint, occult_config=occult_config)
    llama = tmp_path / "llama"  # a model without routed experts: known from its config alone
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(llama)
    (llama / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not a header")
    for model_class in (transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM):  # Auto, and the class itself
        with pytest.raises(ValueError, match=re.escape("occult_hf does not support model_type 'llama'; supported model types:")):
            model_class.from_pretrained(llama, occult_config={"num_devices": 2})


def test_clear_errors(tmp_path):
    import transformers

    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult, unapply_occult

    model = tiny_model("olmoe", seed=0)
    with pytest.raises(ValueError, match="placement is for num_experts=16 but the model has 8"):
        apply_occult(model, OccultConfig(placement=Placement.contiguous(16, 2, [0, 1])))
    with pytest.raises(ValueError, match=r"placement lacks MoE layers \[1\]"):
        apply_occult(model, OccultConfig(placement=Placement.contiguous(8, 2, [0])))
    with pytest.raises(ValueError, match="neither 'contiguous' nor an existing occult_placement.json"):
        apply_occult(model, OccultConfig(placement=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="does not have occult_hf applied"):
        unapply_occult(model)
    apply_occult(model, OccultConfig())
    with pytest.raises(ValueError, match="already has occult_hf applied"):
        apply_occult(model, OccultConfig())
    with pytest.raises(ValueError, match="state_dict=...\\) is not supported"):
        model.save_pretrained(tmp_path / "x", state_dict={})
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match=r"does not support model_type 'llama'; supported model types: \[.*'olmoe'.*\]"):
        apply_occult(llama, OccultConfig())
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load(tiny_checkpoint("olmoe", tmp_path / "c"), occult_config=str(tmp_path / "nope.json"))


def test_install_is_reversible(tmp_path, reinstalled):
    """Without the wrapper transformers rejects the keyword; install() twice wraps once; uninstall() undoes it, the
    wrappers on Trainer and on peft's PeftModel included."""
    from peft import PeftModel
    from transformers import OlmoeForCausalLM, PreTrainedModel, Trainer

    from occult_hf.hf.apply import install, is_installed, uninstall

    def originals():
        return {f"{owner.__name__}.{name}": getattr(owner.__dict__[name], "__occult_original__", None)
                for owner, name in [(Trainer, "_save_checkpoint"), (PeftModel, "save_pretrained"), (PeftModel, "load_adapter")]}  # fmt: skip

    checkpoint = tiny_checkpoint("olmoe", tmp_path / "ckpt")
    original = PreTrainedModel.__dict__["from_pretrained"].__func__.__occult_original__
    wrapped = originals()
    assert all(wrapped.values()), wrapped
    install()
    assert is_installed() and PreTrainedModel.__dict__["from_pretrained"].__func__.__occult_original__ is original
    assert originals() == wrapped
    uninstall()
    assert not is_installed() and PreTrainedModel.__dict__["from_pretrained"] is original
    assert not hasattr(PreTrainedModel.__dict__["_from_config"].__func__, "__occult_original__")
    assert originals() == dict.fromkeys(wrapped), "uninstall() left a wrapper on Trainer or PeftModel"
    with pytest.raises(TypeError):
        OlmoeForCausalLM.from_pretrained(checkpoint, occult_config={})
    install()
    assert is_replaced(OlmoeForCausalLM.from_pretrained(checkpoint, occult_config={}))


# ----- a 2-rank world ----------------------------------------------------------------------------------
PROMPTS = {0: (5, 4), 1: (9, 7)}  # rank -> (prompt length, max_new_tokens)


def _generate_prompt(rank: int) -> torch.Tensor:
    length, _ = PROMPTS[rank]
    return tiny_batch(batch=1, seq=length, seed=40 + rank)


def _reference_generations() -> dict:
    refs = {}
    for family in FAMILIES:
        model = tiny_model(family, seed=7)
        for rank, (_, new_tokens) in PROMPTS.items():
            refs[(family, rank)] = model.generate(_generate_prompt(rank), max_new_tokens=new_tokens, do_sample=False)
    return refs


def _check_generate(rank, world_size, references):
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    for family in FAMILIES:
        model = apply_occult(tiny_model(family, seed=7), OccultConfig(placement=shuffled_placement(family, 8, world_size)))
        tokens = model.generate(_generate_prompt(rank), max_new_tokens=PROMPTS[rank][1], do_sample=False, synced_gpus=False)
        assert torch.equal(tokens, references[(family, rank)]), f"{family} rank {rank}: {tokens} != {references[(family, rank)]}"


def _check_save_round_trip(rank, world_size, directory, family, replicated=False):
    """Train a step, save (collective), reload under EP and as the vanilla model, unapply. `replicated`:
    experts 0 and 1 have a second home (docs/design.md §6); the step must keep the copies identical, else the
    saved (one copy per expert) model would differ from the trained one on the other copy's tokens."""
    import torch.distributed as dist

    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult, occult_config_of, unapply_occult

    placement = shuffled_placement(family, 8, world_size)
    if replicated:
        extra = {l: {e: [(d[e] + 1) % world_size] for e in (0, 1)} for l, d in placement.layers.items()}
        placement = Placement(8, world_size, placement.layers, {"method": "replicated"}, replicas=extra)
    model = apply_occult(tiny_model(family, seed=8), OccultConfig(placement=placement))
    train_one_step(model, tiny_batch(seed=60 + rank))  # each rank its own batch: expert grads from both
    ids = tiny_batch(seed=70)
    expected = model(ids).logits
    target = Path(directory) / (f"{family}_replicated" if replicated else family)
    model.save_pretrained(target)  # collective: rank 0 writes
    dist.barrier()
    assert Placement.load(target) == placement

    reloaded = load(target)  # under EP: the saved setup, this rank's experts
    assert occult_config_of(reloaded).placement == placement and reloaded.get_submodule(
        f"model.layers.{MOE_LAYERS[family][0]}.mlp"
    ).ep.is_distributed
    assert rel_err(reloaded(ids).logits, expected) <= TOLERANCE
    vanilla = load(target, occult_config=None)
    assert not is_replaced(vanilla) and rel_err(vanilla(ids).logits, expected) <= TOLERANCE

    unapply_occult(model)  # all-gather: every rank gets the full trained model
    assert not is_replaced(model) and rel_err(model(ids).logits, expected) <= TOLERANCE
    dist.barrier()


def _check_rank0_only_save_fails_clearly(rank, world_size, directory):
    import torch.distributed as dist

    from occult_hf import OccultConfig
    from occult_hf import apply_occult, snapshot_experts

    model = apply_occult(tiny_model("olmoe", seed=9), OccultConfig())
    snapshot_experts(model)  # what the Trainer save hook (trainer_ep) does on every rank
    if rank == 0:
        model.save_pretrained(Path(directory) / "from_snapshot")  # rank 0 alone: the snapshot is current
    dist.barrier()
    assert (Path(directory) / "from_snapshot" / "config.json").is_file()
    train_one_step(model, tiny_batch(seed=rank))  # the snapshot is stale now
    if rank == 0:
        with pytest.raises(RuntimeError, match="collective: call them on every rank.*hooks Trainer.save_model"):
            model.save_pretrained(Path(directory) / "stale")
    dist.barrier()


def _check_errors(rank, world_size):
    from occult_hf import OccultConfig, Placement
    from occult_hf.hf.apply import apply_occult

    with pytest.raises(ValueError, match=r"num_devices \(4\) must equal the expert-parallel group size \(2\)"):
        apply_occult(tiny_model("olmoe"), OccultConfig(num_devices=4))
    with pytest.raises(ValueError, match="placement is for num_devices=4 but the expert-parallel group has 2"):
        apply_occult(tiny_model("olmoe"), OccultConfig(placement=Placement.contiguous(8, 4, [0, 1])))


def _ep_world(rank, world_size, references, directory):
    from occult_hf.hf.apply import install

    install()
    _check_errors(rank, world_size)
    _check_generate(rank, world_size, references)
    for family in ("qwen2_moe", "deepseek"):
        _check_save_round_trip(rank, world_size, directory, family)
    _check_save_round_trip(rank, world_size, directory, "olmoe", replicated=True)
    _check_rank0_only_save_fails_clearly(rank, world_size, directory)


@pytest.mark.world_size(2)
def test_generate_save_load_and_errors_on_2_ranks(tmp_path):
    run_world(_ep_world, 2, _reference_generations(), str(tmp_path), env={"OCCULT_SAVE_TIMEOUT_S": "5", "OCCULT_JOIN_TIMEOUT_S": "5"})


# ----- HF Trainer -----------------------------------------------------------------------------------
TRAIN_STEPS = 3


def _trainer_dataset():
    ids = tiny_batch(batch=4 * TRAIN_STEPS, seq=16, seed=90)
    return [{"input_ids": row, "labels": row} for row in ids]


def _run_trainer(output_dir: str, per_device_batch: int, model, callbacks=()):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=TRAIN_STEPS,
        learning_rate=0.05,
        optim="sgd",  # Adam's g / sqrt(v) would magnify fp32 rounding in near-zero gradients past 1e-5
        logging_steps=1,
        save_strategy="steps",
        save_steps=TRAIN_STEPS,
        save_only_model=True,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_trainer_dataset(), callbacks=list(callbacks))
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "final"))
    return [(log["loss"], log["grad_norm"]) for log in trainer.state.log_history if "loss" in log]


def _trainer_model():
    return tiny_model("olmoe", seed=11, output_router_logits=False)


def _single_process_trainer(rank, world_size, output_dir):
    return _run_trainer(output_dir, 4, _trainer_model())


def _ep_trainer(rank, world_size, output_dir):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29511",
    )
    from occult_hf import OccultConfig
    from occult_hf.hf.apply import apply_occult

    model = apply_occult(_trainer_model(), OccultConfig(placement=shuffled_placement("olmoe", 8, world_size)))
    return _run_trainer(output_dir, 2, model)


@pytest.mark.world_size(2)
def test_trainer_on_2_ranks_equals_single_process(tmp_path):
    (reference,) = run_world(_single_process_trainer, 1, str(tmp_path / "single"))
    ep_logs = run_world(_ep_trainer, 2, str(tmp_path / "ep"))
    assert len(reference) == len(ep_logs[0]) == len(ep_logs[1]) == TRAIN_STEPS
    for step, (loss, norm) in enumerate(reference):
        for rank_logs in ep_logs:  # each rank's norm sums its own experts and the carrier: equal up to rounding
            ep_loss, ep_norm = rank_logs[step]
            assert abs(ep_loss - loss) <= 1e-5 * abs(loss) and abs(ep_norm - norm) <= 1e-5 * norm, (step, rank_logs)
    assert reference[0][1] > 1.0, "gradient clipping at 1.0 should be active in this test"
    single = load(tmp_path / "single" / "final")
    for directory in (tmp_path / "ep" / "final", tmp_path / "ep" / f"checkpoint-{TRAIN_STEPS}"):
        saved = load(directory, occult_config=None)
        reference_weights = dict(single.named_parameters())
        for name, param in saved.named_parameters():
            assert rel_err(param, reference_weights[name]) <= 1e-5, name
