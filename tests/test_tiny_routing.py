"""The project's own recorded routing (`occult_hf/data/tiny_olmoe_routing.npz`), the default data of the studies.

The shipped file is checked as it is in the package (format, readers, that it came from the shipped
checkpoint's config and is learned, not uniform); `record` is run on a generated corpus and compared
with the model's own routing; the studies run on it without `../shared`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import OlmoeConfig

from occult_hf.profile import RoutingProfile
from occult_hf.eval.studies import placement_study, robust_placement_study, tiny_routing
from occult_hf.training import tiny_checkpoint_path
from occult_hf.training.evaluate import load_entropy, top_pair_share
from corpus_files import write_corpus  # noqa: E402  (the generated three-domain corpus)


def test_shipped_trace_matches_the_shipped_checkpoint():
    ids_TZk, domain_T, split_T, meta = tiny_routing.load()
    config = OlmoeConfig.from_pretrained(str(tiny_checkpoint_path()))
    assert ids_TZk.shape[1:] == (config.num_hidden_layers, config.num_experts_per_tok)
    assert meta["n_experts"] == config.num_experts and meta["top_k"] == config.num_experts_per_tok
    assert 0 <= ids_TZk.min() and ids_TZk.max() < config.num_experts
    # distinct experts per (token, layer), as a top-k router gives
    assert (np.sort(ids_TZk, axis=2)[:, :, 1:] != np.sort(ids_TZk, axis=2)[:, :, :-1]).all()
    for domain in range(len(meta["domains"])):  # both halves hold every domain
        for part in (tiny_routing.PLAN, tiny_routing.HELD_OUT):
            assert ((domain_T == domain) & (split_T == part)).sum() >= 512
    # learned routing: far from a router that learned nothing (uniform load ~ 1.0, top-10% pairs ~ 10%)
    layer0_Nk = ids_TZk[:, 0]
    assert load_entropy(layer0_Nk, config.num_experts) < 0.97
    assert top_pair_share(layer0_Nk, config.num_experts) > 0.2


def test_shipped_trace_is_a_trace_occult_profile_reads(tmp_path):
    from occult_hf.cli import main

    profile = RoutingProfile.from_trace(tiny_routing.tiny_routing_path())
    assert (profile.num_experts, profile.top_k, sorted(profile.layers)) == (32, 4, [0, 1, 2, 3])
    plan_half, held_out = tiny_routing.plan_and_held_out()
    assert plan_half.layer(0).token_count + held_out.layer(0).token_count == profile.layer(0).token_count
    out = tmp_path / "tiny.safetensors"
    assert main(["profile", "--from-trace", str(tiny_routing.tiny_routing_path()), "--model-type", "olmoe", "--out", str(out)]) == 0
    assert sorted(RoutingProfile.load(out).layers) == [0, 1, 2, 3]


def test_record_is_the_models_routing_of_held_out_text(tmp_path):
    from transformers import AutoTokenizer, OlmoeForCausalLM

    from occult_hf.training.data import RECORD_SEPARATOR, load_documents, split_heldout
    from occult_hf.training.evaluate import capture_routing

    corpus = write_corpus(tmp_path / "corpus", docs=60, lines=(20, 30))
    arrays = tiny_routing.record(corpus, tokens_per_domain=256, seq_len=64)
    path = tmp_path / "trace.npz"
    tiny_routing.save(arrays, path)
    ids_TZk, domain_T, split_T, meta = tiny_routing.load(path)
    assert ids_TZk.shape == (768, 4, 4) and list(split_T[:128]) == [0] * 64 + [1] * 64
    assert meta["domains"] == ["python_docs", "python_stdlib_code", "kernel_docs"]
    # the first window of the first domain is the first held-out document's tokens, routed by the model
    model = OlmoeForCausalLM.from_pretrained(str(tiny_checkpoint_path())).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint_path()))
    _, heldout = split_heldout(load_documents(corpus, ["python_docs"], separator=RECORD_SEPARATOR)["python_docs"], 0.05, 400_000)
    first = tokenizer(heldout["text"][0], verbose=False)["input_ids"][:64]
    assert len(first) == 64
    with torch.no_grad():
        routing = capture_routing(model, np.asarray([first]))
    expected_TZk = np.stack([routing[layer][0] for layer in range(4)], axis=1)
    np.testing.assert_array_equal(ids_TZk[:64], expected_TZk)
    np.testing.assert_allclose(arrays["topk_weights"][:64, 0].astype(np.float32), routing[0][1], atol=1e-3)
    with pytest.raises(ValueError, match="tokens_per_domain=100 must be at least 2 \\* seq_len"):
        tiny_routing.record(corpus, tokens_per_domain=100, seq_len=64)


def test_studies_default_to_the_shipped_routing(tmp_path):
    torch.set_num_threads(1)
    result = placement_study.run_placement_study(devices=(4,), progress=False, out_dir=tmp_path)
    assert "Learned tiny OLMoE (E=32, k=4, 4 layers)" in result.markdown()
    (rows,) = result.tables.values()
    ct = {row["method"]: row["CT held-out (mean over layers)"] for row in rows}
    assert ct["occult"] < ct["contiguous"] and ct["refined"] < ct["contiguous"]
    assert (tmp_path / "placement_study.png").is_file()
    rows = robust_placement_study.tiny_rows(devices=(4,))
    assert [r["method"] for r in rows][:2] == ["contiguous", "refined (today)"]
    assert rows[1]["CT held-out"] < rows[0]["CT held-out"]
    with pytest.raises(SystemExit):  # the figure belongs to the --routing-dir tables: never silently ignored
        robust_placement_study.main(["--out-dir", str(tmp_path)])
