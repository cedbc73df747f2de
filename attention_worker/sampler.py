"""Sampling where a token depends only on (logits, seed, token index), so a request resumed on another
AW continues identically. Greedy (temperature 0) is argmax, ties to the lowest id, as transformers."""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15


def token_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, index: int) -> int:
    """logits [V] -> token id."""
    if temperature <= 0.0 or top_k == 1:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    gen = torch.Generator().manual_seed(token_seed(seed, index))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> list[object]:
    """[logprob of `token`, top-k [[id, logprob], ...]] under the raw distribution, or [None, None]
    when the request asked for none (k < 0)."""
    if k < 0:
        return [None, None]
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[list[float]] | None = None
    if k > 0:
        values, ids = torch.topk(logp, min(k, logp.shape[0]))
        top = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]
    return [float(logp[token]), top]
