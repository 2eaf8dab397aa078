"""The project's own recorded routing: the shipped tiny OLMoE on text it never trained on.

The studies and examples need real per-token routing. The session's third-party traces
(`../shared/data/routing/`) are not part of the project and may not be redistributed, so a fresh
clone or a pip install would have nothing to run them on. This module records, once, the routing of
the learned checkpoint that ships in the package (`occult_hf/data/tiny_olmoe`, made by
`occult train --recipe tiny`) on the **held-out documents** of its three training domains (the last
`heldout_fraction` of each domain's documents, exactly the split `occult train` held out, tokenized
with the checkpoint's own tokenizer), and ships the result as `occult_hf/data/tiny_olmoe_routing.npz`
in the trace format `occult profile --from-trace` reads (`profile.trace`):

    topk_ids  [T, Z, k] int16   expert ids of every token at MoE layers 0..Z-1 (E=32, k=4, Z=4)
    topk_weights [T, Z, k] float16  their routing weights (the router's softmax probabilities)
    domain    [T] int8          index into meta["domains"]
    split     [T] int8          0 = planning half, 1 = held-out half (128-token windows alternate,
                                per domain, so both halves hold every domain)
    meta      JSON string       n_experts, top_k, the model, the text and the command that made it

`plan_and_held_out()` and `domain_profiles()` give `RoutingProfile`s of it; they are the default
data of `studies.placement_study` and `studies.robust_placement_study` when no `--routing-dir` is
given. Regenerate (needs the corpus, which the project does not ship; about a minute of CPU):

    python -m occult_hf.eval.studies.tiny_routing --corpus-dir ../shared/data/corpus --out src/occult_hf/data/tiny_olmoe_routing.npz

Shape legend (docs/conventions.md): T tokens, Z layers, k experts per token, E experts, B windows
(sequences), S sequence length.
"""

from __future__ import annotations

import argparse
import sys
import io
import json
import os
from contextlib import nullcontext
from importlib import resources
from pathlib import Path

import numpy as np

from occult_hf.profile import RoutingProfile
from occult_hf.utils.errors import run_command

#: the shipped trace, inside the package's data folder
TINY_ROUTING = "tiny_olmoe_routing.npz"
#: trace format tag stored in the meta JSON
TRACE_FORMAT = "occult_hf.tiny_routing/1"
PLAN, HELD_OUT = 0, 1


def tiny_routing_path():
    """The path of the shipped trace (a file inside the installed package)."""
    return resources.files("occult_hf") / "data" / TINY_ROUTING


def record(corpus_dir: str | os.PathLike, tokens_per_domain: int = 2048, seq_len: int = 128, batch_size: int = 8) -> dict[str, np.ndarray]:
    """The arrays of the trace (module docstring): the shipped model's routing of each domain's held-out text.

    `tokens_per_domain` tokens (whole `seq_len` windows) of each domain's held-out documents, in
    document order; a domain with fewer held-out tokens is an error naming it.
    """
    import torch
    from transformers import AutoTokenizer, OlmoeForCausalLM

    from occult_hf.training import tiny_checkpoint_path
    from occult_hf.training.data import RECORD_SEPARATOR, load_documents, pack, split_heldout
    from occult_hf.training.evaluate import capture_routing
    from occult_hf.training.recipes import Recipe

    if tokens_per_domain < 2 * seq_len:
        raise ValueError(f"tokens_per_domain={tokens_per_domain} must be at least 2 * seq_len ({2 * seq_len}): one window per half")
    with resources.as_file(tiny_checkpoint_path()) as path:
        model = OlmoeForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        recipe = Recipe.from_dict(json.loads((Path(path) / "recipe.json").read_text()))  # its domains named
    domains = list(recipe.train_domains)
    documents = load_documents(corpus_dir, domains, separator=RECORD_SEPARATOR)  # the project corpus's format
    ids_parts, weight_parts, domain_parts, split_parts = [], [], [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 4-layer model at hidden 64: thread start-up costs more than it saves
    try:
        for index, domain in enumerate(domains):
            _, heldout = split_heldout(documents[domain], recipe.heldout_fraction, recipe.max_chars_per_domain)
            stream = [i for text in heldout["text"] for i in tokenizer(text, verbose=False)["input_ids"] + [tokenizer.eos_token_id]]
            windows_BS = pack(np.asarray(stream, dtype=np.int64), seq_len, tokens_per_domain)
            if windows_BS.size < tokens_per_domain - tokens_per_domain % seq_len:
                raise ValueError(
                    f"domain {domain!r} has {len(stream)} held-out tokens under {os.fspath(corpus_dir)!r}, "
                    f"fewer than tokens_per_domain={tokens_per_domain}"
                )
            with torch.no_grad():
                routing = capture_routing(model, windows_BS, batch_size)
            ids_TZk = np.stack([routing[layer][0] for layer in sorted(routing)], axis=1)
            ids_parts.append(ids_TZk.astype(np.int16))
            weight_parts.append(np.stack([routing[layer][1] for layer in sorted(routing)], axis=1).astype(np.float16))
            domain_parts.append(np.full(len(ids_TZk), index, dtype=np.int8))
            split_parts.append((np.arange(len(ids_TZk)) // seq_len % 2).astype(np.int8))
    finally:
        torch.set_num_threads(threads)
    meta = {
        "format": TRACE_FORMAT,
        "n_experts": int(model.config.num_experts),
        "top_k": int(model.config.num_experts_per_tok),
        "model": "occult_hf/data/tiny_olmoe (occult train --recipe tiny)",
        "text": (
            f"held-out documents (last {recipe.heldout_fraction:.0%} of each domain, first "
            f"{recipe.max_chars_per_domain} characters) of ../shared/data/corpus, {tokens_per_domain} tokens per domain"
        ),
        "domains": domains,
        "seq_len": seq_len,
        "split": "128-token windows alternate per domain: split 0 = planning half, 1 = held-out half".replace("128", str(seq_len)),
        "made_by": "python -m occult_hf.eval.studies.tiny_routing --corpus-dir ../shared/data/corpus",
    }
    return {
        "topk_ids": np.concatenate(ids_parts),
        "topk_weights": np.concatenate(weight_parts),
        "domain": np.concatenate(domain_parts),
        "split": np.concatenate(split_parts),
        "meta": np.asarray(json.dumps(meta)),
    }


def save(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write the trace atomically (compressed `.npz`), after reading the bytes back and checking them."""
    from occult_hf.utils.atomic import atomic_save_npz

    def validate(data: bytes) -> None:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            ids_TZk, meta = npz["topk_ids"], json.loads(str(npz["meta"]))
            rows = {len(ids_TZk), len(npz["domain"]), len(npz["split"])}
        if ids_TZk.ndim != 3 or len(rows) != 1 or ids_TZk.min() < 0 or ids_TZk.max() >= meta["n_experts"]:
            raise ValueError(f"trace for {os.fspath(path)!r}: topk_ids {ids_TZk.shape} (ids {ids_TZk.min()}..{ids_TZk.max()}, "
                             f"E={meta['n_experts']}) and the [T] arrays ({sorted(rows)} rows) do not fit together")

    atomic_save_npz(path, validate=validate, **arrays)


def load(path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(`topk_ids` `[T, Z, k]` int64, `domain` `[T]`, `split` `[T]`, meta) of a trace (default: the shipped one)."""
    with resources.as_file(tiny_routing_path()) if path is None else nullcontext(Path(path)) as file:
        with np.load(file, allow_pickle=False) as npz:
            missing = [key for key in ("topk_ids", "domain", "split", "meta") if key not in npz.files]
            if missing:
                raise ValueError(f"{os.fspath(file)!r} is not a tiny-routing trace: it lacks {missing} (keys: {npz.files})")
            meta = json.loads(str(npz["meta"]))
            return npz["topk_ids"].astype(np.int64), npz["domain"], npz["split"], meta


def plan_and_held_out(path: str | os.PathLike | None = None) -> tuple[RoutingProfile, RoutingProfile]:
    """Profiles (every layer, every token as the sample) of the planning half and of the held-out half."""
    from occult_hf.placement.validation import profile_from_sample

    ids_TZk, _, split_T, meta = load(path)
    return tuple(
        profile_from_sample(
            {layer: ids_TZk[split_T == part, layer] for layer in range(ids_TZk.shape[1])},
            meta["n_experts"],
            f"{TINY_ROUTING} {name}",
        )
        for part, name in ((PLAN, "planning half"), (HELD_OUT, "held-out half"))
    )


def domain_profiles(path: str | os.PathLike | None = None, split: int = PLAN) -> dict[str, RoutingProfile]:
    """One profile per domain of one half (default: the planning half), every layer."""
    from occult_hf.placement.validation import profile_from_sample

    ids_TZk, domain_T, split_T, meta = load(path)
    profiles = {}
    for index, name in enumerate(meta["domains"]):
        keep_T = (domain_T == index) & (split_T == split)
        layers = {layer: ids_TZk[keep_T, layer] for layer in range(ids_TZk.shape[1])}
        profiles[name] = profile_from_sample(layers, meta["n_experts"], f"{TINY_ROUTING} {name}")
    return profiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-dir", required=True, help="directory of <domain>.txt.gz files (../shared/data/corpus)")
    parser.add_argument("--out", required=True, help="the .npz to write")
    parser.add_argument("--tokens-per-domain", type=int, default=2048, help="held-out tokens recorded per domain")
    args = parser.parse_args(argv)
    arrays = record(args.corpus_dir, args.tokens_per_domain)
    save(arrays, args.out)
    print(f"wrote {args.out}: topk_ids {arrays['topk_ids'].shape}, {os.path.getsize(args.out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m occult_hf.eval.studies.tiny_routing", main))
