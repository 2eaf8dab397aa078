"""A finer-grained routing made from a real one: each expert split into m, co-activation kept (DeepSeek-V3's 256
experts from the study model's 64).

No per-token routing of a 256-expert model exists here. DeepSeek-V3's experts are finer (256 of width 2048) than
the study model's (64), so the synthesis splits each real expert e into m children `e * m + j` (before a seeded
shuffle of the ids) and keeps every token's real choices: a token that chose e chooses one of e's children.
Which child: each (token, layer) draws a sub-topic s, uniform over m, and each of its k experts takes child s with
probability `coherence`, else a uniform child. So

* the tokens, their k and their real co-activation between experts are kept: children of two experts are
  co-activated exactly as often as the experts were (no new pairs across experts, none lost);
* within that, a token's experts agree on the sub-topic: a pair of co-activated experts lands on matching children
  (j, j) with probability `coherence**2 + (1 - coherence**2) / m` instead of 1/m: the finer routing has finer
  co-activation structure, as a model trained with more experts would (`coherence=0`: children uniform, the
  structure no finer than the real one; the default 0.75 is an assumption, stated with every table);
* each child carries about 1/m of its parent's load;
* the shuffle keeps contiguous ids from meaning siblings (a contiguous placement would otherwise co-locate them).

Shape legend (docs/conventions.md): N tokens, k experts per token, E experts; local to this file: L layers.
"""

from __future__ import annotations

import numpy as np

#: the probability that an expert takes its token's sub-topic child (module docstring)
DEFAULT_COHERENCE = 0.75


def split_experts(ids_NLk: np.ndarray, num_experts: int, factor: int, coherence: float = DEFAULT_COHERENCE, seed: int = 0) -> np.ndarray:
    """`[N, L, k]` int64 ids over `num_experts * factor` experts, each real expert split into `factor` (docstring)."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if not 0.0 <= coherence <= 1.0:
        raise ValueError(f"coherence must lie in [0, 1], got {coherence}")
    ids = np.asarray(ids_NLk, dtype=np.int64)
    rng = np.random.default_rng(seed)
    topic_NL1 = rng.integers(factor, size=ids.shape[:2] + (1,))
    own_NLk = rng.random(ids.shape) < coherence
    child_NLk = np.where(own_NLk, topic_NL1, rng.integers(factor, size=ids.shape))
    shuffle = rng.permutation(num_experts * factor)
    return shuffle[ids * factor + child_NLk]


__all__ = ["DEFAULT_COHERENCE", "split_experts"]
