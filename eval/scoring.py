"""Log-likelihood scoring of (context, continuation) requests with one host read per batch.

lm-eval's `HFLM._loglikelihood_tokens` scores each request on its own after the batch's forward: it builds the
input and the continuation as device tensors from Python lists (a blocking copy each) and reads the sum and the
greedy match back as Python values, four host synchronisations per request. On a GPU that other processes keep busy
(the quality study's workers under CUDA MPS) each one waits behind their kernels, and scoring runs at a few hundred
requests a second. `score_requests` makes the same forwards on the same batches (lm-eval's `Collator`, with HFLM's
order, batch size and one-token-continuation cache), copies to the device without waiting, and computes every
request's answer of a batch on the device at once, then reads them back together: one wait a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.models.utils import Collator
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from occult_hf.utils.logging import get_logger

logger = get_logger(__name__)

Request = tuple[tuple[str, str], list[int], list[int]]


def _longest_first(request: Request) -> tuple:
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _one_token_continuation_key(request: Request) -> list[int]:
    return request[-2] + request[-1][:-1]


def score_requests(lm, requests: list[Request], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """`(log-probability of the continuation, whether it is the greedy continuation)` of each request, in order.

    `lm`: a causal `HFLM` with an integer batch size (its `_model_call`, `max_length`, `device`, `softmax_dtype`,
    `logits_cache`, `cache_hook`, `rank`).
    """
    collator = Collator(requests, sort_fn=_longest_first, group_fn=_one_token_continuation_key,
                        group_by="contexts" if lm.logits_cache else None)  # fmt: skip
    answers: list[tuple[float, bool]] = []
    bar = tqdm(total=len(requests), disable=disable_tqdm or lm.rank != 0, desc="Running loglikelihood requests")
    for chunk in collator.get_batched(n=lm.batch_size):
        inputs = []
        for _, context, continuation in chunk:
            if not context or not continuation or len(continuation) > lm.max_length:
                raise ValueError(f"occult-hf: a request needs a context and a continuation of at most {lm.max_length} "
                                 f"tokens, got {len(context)} and {len(continuation)}")  # fmt: skip
            if len(context) + len(continuation) > lm.max_length + 1:
                logger.warning(f"context ({len(context)}) and continuation ({len(continuation)}) exceed the model's "
                               f"maximum length ({lm.max_length}): truncated from the left")  # fmt: skip
            inputs.append((context + continuation)[-(lm.max_length + 1) :][:-1])
        # right-padded with token 0, as HFLM pads; the copies to the device do not wait for the GPU
        padded_BS = pad_sequence([torch.tensor(tokens) for tokens in inputs], batch_first=True)
        logits_BSV = lm._model_call(padded_BS.to(lm.device, non_blocking=True))
        log_probs_BSV = F.log_softmax(logits_BSV, dim=-1, dtype=lm.softmax_dtype)

        # every scored token of the batch: its row, position and token, and the request (in the cache's order) it is in
        rows, positions, tokens, owners, keys = [], [], [], [], []
        for row, ((request_str, context, continuation), tokens_in) in enumerate(zip(chunk, inputs, strict=True)):
            # requests that share this one's input (the one-token-continuation cache) end where it ends
            for key, cont, _ in collator.get_cache(req_str=request_str, cxt_toks=context, cont_toks=continuation,
                                                   logits=log_probs_BSV[row : row + 1]):  # fmt: skip
                rows += [row] * len(cont)
                positions += range(len(tokens_in) - len(cont), len(tokens_in))
                tokens += cont
                owners += [len(keys)] * len(cont)
                keys.append(key)
        index = torch.tensor([rows, positions, tokens, owners]).to(lm.device, non_blocking=True)
        selected_NV = log_probs_BSV[index[0], index[1]]
        # summed in float64 whatever the model's dtype: `index_add_` rounds its running sum to the output dtype after
        # every token, so a bfloat16 sum drifts by nats and stops growing near -2048 (HFLM's `sum()` rounds once)
        scored_N = selected_NV.gather(1, index[2].unsqueeze(1)).squeeze(1).double()
        missed_N = (selected_NV.argmax(dim=-1) != index[2]).double()
        totals_2K = torch.zeros(2, len(keys), dtype=torch.float64, device=scored_N.device)
        totals_2K[0].index_add_(0, index[3], scored_N)
        totals_2K[1].index_add_(0, index[3], missed_N)
        sums, misses = totals_2K.tolist()  # the batch's one read back
        for key, total, missed in zip(keys, sums, misses, strict=True):
            answer = (total, missed == 0)
            answers.append(answer)
            if key is not None:
                lm.cache_hook.add_partial("loglikelihood", key, answer)
            bar.update(1)
    bar.close()
    return collator.get_original(answers)
