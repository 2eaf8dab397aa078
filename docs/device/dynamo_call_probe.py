"""Dynamo's own work per call of a compiled decode forward: stock OLMoE against occult (tracked and untracked).

A tiny 16-layer OLMoE (64 experts, top-8: the real layer count and routing width, toy sizes) decodes one token against a
static cache through dynamo (`fullgraph`) with a backend that returns its first outputs without computing again, so
each timed call is what dynamo does around a graph (frame evaluation, the guard check, the argument and output
handling, the replay of attribute stores), not the model. With `--aot` the backend is AOTAutograd's around the same
replay, which adds its runtime wrappers around the graph: the handling of its outputs, and copies of mutated buffers
back that inductor's inference graphs make inside the graph instead. `--drop REGEX` leaves out the guards whose source
matches REGEX (unsafe: to find which guards cost, e.g. `--drop _original`). Runs on the CPU
(`python docs/device/dynamo_call_probe.py [--aot] [--drop REGEX]`); prints microseconds per call, the least of 5
rounds of 200 calls, and the guards kept, for stock, occult tracked and untracked.
"""

import argparse
import copy
import re
import time
import warnings

import torch
from transformers import OlmoeConfig, OlmoeForCausalLM, StaticCache

from occult_hf import apply_occult, track_routing

CALLS, ROUNDS = 200, 5


def replay_first_outputs(graph_module, example_inputs):
    """A dynamo backend whose compiled graph computes once and then returns those outputs."""
    outputs = None

    def run(*args):
        nonlocal outputs
        if outputs is None:
            outputs = graph_module(*args)
        return outputs

    return run


def aot_replay_first_outputs(graph_module, example_inputs):
    """`replay_first_outputs` behind AOTAutograd: the functionalized graph, replayed by AOT's runtime wrappers."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compile_replay(graph, inputs):
        return make_boxed_func(replay_first_outputs(graph, inputs))

    return aot_autograd(fw_compiler=compile_replay)(graph_module, example_inputs)


def us_per_call(model, config, backend, drop: str | None) -> tuple[float, int, int]:
    """`(µs per call, guards kept, guards)` of `model.forward` compiled with `backend`, the guards matching `drop`
    left out."""
    cache = StaticCache(config=config, max_cache_len=64)
    input_ids = torch.randint(0, config.vocab_size, (1, 1))
    torch._dynamo.reset()
    kept = []

    def keep_guards(entries):
        keep = [drop is None or not re.search(drop, entry.name) for entry in entries]
        kept.extend(keep)
        return keep

    forward = torch._dynamo.optimize(backend, nopython=True, guard_filter_fn=keep_guards)(model.forward)
    call = lambda position: forward(input_ids=input_ids, past_key_values=cache, cache_position=torch.tensor([position]), use_cache=True)
    rounds = []
    with torch.no_grad():
        for position in range(3):
            call(position)
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(CALLS):
                call(5)
            rounds.append((time.perf_counter() - start) / CALLS * 1e6)
    return min(rounds), sum(kept), len(kept)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    stock = OlmoeForCausalLM(config).eval()
    occult = apply_occult(copy.deepcopy(stock), {"num_devices": 1}).eval()
    untracked = apply_occult(copy.deepcopy(stock), {"num_devices": 1}).eval()
    track_routing(untracked, False)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aot", action="store_true", help="the replaying backend behind AOTAutograd")
    parser.add_argument("--drop", default=None, help="leave out the guards whose source matches this regex")
    args = parser.parse_args()
    backend = aot_replay_first_outputs if args.aot else replay_first_outputs
    for name, model in (("stock", stock), ("occult", occult), ("occult untracked", untracked)):
        us, kept, guards = us_per_call(model, config, backend, args.drop)
        print(f"{name}: {us:.0f} us per call, {kept} of {guards} guards", flush=True)


if __name__ == "__main__":
    main()
