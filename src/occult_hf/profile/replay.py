"""Recorded routing replayed on a model: which per-token trace stands in for each model's routers (`occult bench
paper` drives the routers with it; the cost model, `occult_hf.scale`, replays it at D devices).

Shape legend: N trace tokens, L trace layers (MoE layers the trace recorded), k experts per token,
E routed experts.

A model with random weights has a random router: no co-activation structure, so placement cannot gain
on it. The paper's rows that show placement and pruning gains therefore replay real routing through
the model's own router (`benchmarks.paper_routing.TraceReplay`). The sources, per model (docs/paper_comparison.md):

* **Qwen1.5-MoE-A2.7B** (E=60, k=4): the real checkpoint's GSM8K trace, third-party data the package does not
  ship (`benchmarks.QWEN15_TRACE`; 4,384 tokens, MoE layer 0 only: that layer at every layer).
* **OLMoE-1B-7B** (E=64, k=8): no per-token trace of the real OLMoE was available (only its pair
  counts). The closest real routing is the project's own `study` model (docs/quality.md:
  an OLMoE-architecture model, E=64 fine-grained experts, top-8, 8 MoE layers, trained on the
  project's corpus in the quality study's GPU run of 2026-11-30). Its held-out routing,
  recorded per token in that run's profiles, ships as `STUDY_TRACE` (all 8 layers; OLMoE's 16
  layers read them in proportion: layer i of M MoE layers reads trace layer i*L//M). Its
  co-activation is about as concentrated as the real OLMoE's (the top 5% of expert pairs carry
  27-55% of co-activations per layer, median 29%; the real OLMoE-1B-7B-0125's pair counts:
  18-34%, median 28%; uniform random top-8: 6%).
* **DeepSeek-MoE-16B** (E=64, k=6): no trace of k=6 exists. The study model's trace again, each
  token's first 6 experts of its score-ordered top-8 (the file says its rows are score-ordered:
  `torch.topk` of the study model's router): the top-6 that router would choose. A different model's
  routing with k adapted, and the label says so.

`python -m occult_hf.profile.replay --profiles DIR --out PATH` makes `STUDY_TRACE` from the
quality study's `profiles/heldout_<domain>.safetensors` (its `profiles.tar.gz`).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

#: the study model's held-out routing, per token and layer (relative to the repository root)
STUDY_TRACE = "docs/quality_results/study_routing_h200.npz"
STUDY_DOMAINS = ("python_docs", "python_stdlib_code", "kernel_docs")


def fit_routing(ids_NLk: np.ndarray, meta: dict, path: str, num_experts: int, top_k: int) -> tuple[np.ndarray, str]:
    """`(ids [N, L, top_k], what was adapted)` for a model of `num_experts` and `top_k`, from a trace read by
    `profile.trace.read_trace_ids` (`meta`: the file's meta JSON).

    The trace's ids must span exactly `num_experts`. Its k must equal `top_k`, or be larger in a file
    whose `meta` says `score_ordered` (each row in its router's score order): then the first `top_k`
    of each row are the experts that router's top-`top_k` would choose.
    """
    trace_experts, trace_k = int(ids_NLk.max()) + 1, ids_NLk.shape[2]
    if trace_experts != num_experts:
        raise ValueError(f"routing trace {path!r}: its ids span {trace_experts} experts; the model has E={num_experts}")
    if trace_k == top_k:
        return ids_NLk, ""
    if trace_k > top_k and meta.get("score_ordered"):
        return ids_NLk[:, :, :top_k], f"each token's first {top_k} of its score-ordered top-{trace_k}"
    raise ValueError(
        f"routing trace {path!r} has k={trace_k}; the model has k={top_k} (a larger k is usable only from a file "
        f"whose meta says score_ordered)"
    )


def trace_layer(moe_index: int, moe_layers: int, trace_layers: int) -> int:
    """The trace layer that the `moe_index`-th of `moe_layers` MoE layers replays (depth in proportion)."""
    return moe_index * trace_layers // moe_layers


def pack_study_trace(profiles_dir: str, tokens_per_domain: int) -> tuple[np.ndarray, dict]:
    """`(ids [N, L, k] uint8, meta)`: the first `tokens_per_domain` tokens of every held-out domain's profile."""
    from safetensors.numpy import load_file

    parts = []
    for domain in STUDY_DOMAINS:
        tensors = load_file(os.path.join(profiles_dir, f"heldout_{domain}.safetensors"))
        layers = sorted(int(name.split(".")[1]) for name in tensors if name.endswith(".topk_sample"))
        if not layers:
            raise ValueError(f"{profiles_dir}/heldout_{domain}.safetensors has no per-token samples (topk_sample)")
        parts.append(np.stack([tensors[f"layer.{layer}.topk_sample"][:tokens_per_domain] for layer in layers], axis=1))
    ids_NLk = np.concatenate(parts)
    if ids_NLk.max() > 255:
        raise ValueError(f"expert ids up to {ids_NLk.max()} do not fit uint8")
    meta = {
        "format": "occult_hf.paper_routing/1",
        "model": "occult_hf `study` recipe (OlmoeForCausalLM, E=64, top-8, 8 MoE layers, 218.4M parameters), "
        "trained in the quality study's run on 2 H200s, 2026-11-30 14:42-14:47 UTC (docs/quality.md)",
        "text": f"held-out split, first {tokens_per_domain} tokens of each domain {list(STUDY_DOMAINS)}",
        "score_ordered": True,
        "rows": "row n of every layer is the same token (one profile stream per domain, the same sample seed)",
        "made_by": f"python -m occult_hf.profile.replay --profiles {profiles_dir} --tokens-per-domain {tokens_per_domain}",
    }
    return ids_NLk.astype(np.uint8), meta


def main(argv: list[str] | None = None) -> int:
    from occult_hf.utils.atomic import atomic_save_npz

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", required=True, help="the quality study's profiles/ (heldout_<domain>.safetensors)")
    parser.add_argument("--tokens-per-domain", type=int, default=2048)
    parser.add_argument("--out", default=STUDY_TRACE)
    args = parser.parse_args(argv)
    ids_NLk, meta = pack_study_trace(args.profiles, args.tokens_per_domain)
    atomic_save_npz(args.out, topk_ids=ids_NLk, meta=np.array(json.dumps(meta)))
    print(f"{args.out}: topk_ids {ids_NLk.shape} ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
