"""Sampling where a token depends only on (logits, seed, token index).

So a request resumed on another AW continues identically. Greedy (temperature 0) is argmax, with
ties going to the lowest id, as in transformers.

No sampling parameter can crash the worker. A temperature below `GREEDY_BELOW` is greedy, as vLLM
treats it: 1/temperature would overflow float32, and the softmax of an overflow is NaN. A
distribution that is not finite (NaN or inf logits from the model) falls back to greedy on the
finite logits. It never reaches `torch.multinomial`, which raises on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fabric.logprobs import finite
from fabric.messages.client import PromptScores

_MIX = 0x9E3779B97F4A7C15
GREEDY_BELOW = 1e-5


def token_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def greedy(logits: torch.Tensor) -> int:
    """argmax, NaN counting as the lowest value."""
    return greedy_rows(logits[None])[0]


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """`greedy` of every row of logits [S, V] at once -> S token ids.

    On the host in numpy's argmax: torch's reads a row of this CPU's at ~1 ns a value (280 µs for 32 rows of 8192
    on this machine, 20 in numpy). numpy's counts NaN as the highest value, so a row whose pick is NaN (and only
    such a row has one) is done again with NaN made -inf. Ties go to the lowest id in both."""
    if not logits.shape[0]:
        return []
    if not logits.is_cpu:
        return _greedy_torch(logits)
    a = logits.detach().float().numpy()  # [S, V]
    picked = np.argmax(a, axis=1)  # [S]
    # Rows whose pick is NaN, in Python: a row's numpy calls cost more than S comparisons (21 µs in place for one).
    nan = [i for i, v in enumerate(a[np.arange(a.shape[0]), picked].tolist()) if v != v]
    if nan:
        picked[nan] = _greedy_torch(logits[nan])
    return picked.tolist()


def _greedy_torch(logits: torch.Tensor) -> list[int]:
    return torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=1).tolist()


def is_greedy(temperature: float, top_k: int) -> bool:
    return not temperature >= GREEDY_BELOW or top_k == 1  # also catches a NaN temperature


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, index: int,
           greedy_token: int | None = None) -> int:
    """logits [V] -> token id.

    `greedy_token` is this row's `greedy`, where the caller has it."""
    if is_greedy(temperature, top_k):
        return greedy(logits) if greedy_token is None else greedy_token
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p. The first always stays.
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return greedy(logits)
    gen = torch.Generator().manual_seed(token_seed(seed, index))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float | None, list[list[Any]] | None]:
    """(logprob of `token`, top-k [[id, logprob], ...]) under the raw distribution.

    Returns (None, None) when the request asked for none (k < 0). A non-finite value becomes
    `FLOOR_LOGPROB` (fabric/logprobs.py)."""
    if k < 0:
        return None, None
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[list[Any]] | None = None
    if k > 0:
        values, ids = torch.topk(logp, min(k, logp.shape[0]))
        top = [[int(i), finite(float(v))] for i, v in zip(ids.tolist(), values.tolist())]
    return finite(float(logp[token])), top


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptScores:
    """Scores each row's next token under the raw distribution.

    Takes logits [R, V] and the token that followed each row [R]. Returns each token's logprob and
    rank, and the k most likely tokens. The gateway floors non-finite values."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    lp = logp.gather(1, targets[:, None])  # [R, 1]
    ranks = (logp > lp).sum(dim=1) + 1  # [R]
    values, ids = torch.topk(logp, min(k, logp.shape[1]), dim=1)  # [R, k]
    return PromptScores(lp[:, 0].cpu().numpy(), ranks.long().cpu().numpy(), ids.long().cpu().numpy(), values.cpu().numpy())

