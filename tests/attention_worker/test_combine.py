"""The REFE's combine (attention_worker/forwarding.py) adds each token's weighted expert results,
whatever pieces the results came back in: runs that tile the rows (joined as they are), runs out
of order, empty calls, index pieces (a replica's share of a hot expert), and rows no call covered
(left zero), always exactly as scattering every piece into place does."""

from __future__ import annotations

import random

import pytest
import torch

from attention_worker.layer_plan import Part, combine, plan_layer


def scattered(plan, parts: list[Part], like: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    y = torch.zeros_like(plan.xs)
    for rows, res in parts:
        y[rows] = res
    return torch.zeros_like(like).index_add_(0, plan.token_of_row, y * plan.weights[:, None])


def test_combine_equals_scattering_every_piece() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    kinds = set()
    for _ in range(400):
        t = rng.randint(1, 40)
        x = torch.randn(t, 16)
        experts = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
        plan = plan_layer(0, x, experts, torch.rand(t, 2), 8)
        r = plan.xs.shape[0]
        res = plan.xs * 3 + 1  # [R, D] stand-in results
        cuts = sorted(rng.sample(range(1, r), min(r - 1, rng.randint(0, 3))))
        bounds = [0, *cuts, r]
        parts: list[Part] = [(slice(a, b), res[a:b]) for a, b in zip(bounds, bounds[1:])]
        rng.shuffle(parts)
        kind = rng.choice(["runs", "empty call", "index piece", "gap"])
        if kind == "empty call":
            parts.append((slice(1, 1), res[1:1]))
        elif kind == "index piece":
            idx = torch.tensor([0, r - 1])
            parts = [(slice(1, r - 1), res[1:r - 1]), (idx, res[idx])]
        elif kind == "gap" and len(parts) > 1:
            parts = parts[:-1]
        kinds.add(kind)
        assert torch.equal(combine(plan, parts, x), scattered(plan, parts, x)), kind
    assert kinds == {"runs", "empty call", "index piece", "gap"}


def torch_plan(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, e: int):  # type: ignore[no-untyped-def]
    """The plan as torch's ops make it: rows [R, D], spans, token of each row [R], weights [R]."""
    k = experts.shape[1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    token_of_row = order // k
    counts = torch.bincount(experts.reshape(-1), minlength=e).tolist()
    spans, row = {}, 0
    for ex, n in enumerate(counts):
        if n:
            spans[ex] = (row, n)
        row += n
    return x.index_select(0, token_of_row), spans, token_of_row, weights.reshape(-1).index_select(0, order).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_plan_is_torchs_plan_bit_for_bit(dtype: torch.dtype) -> None:
    """`plan_layer` sorts with numpy in host memory (bfloat16 as integers of its size): the same rows, order,
    spans and weights, bit for bit, as torch's own ops."""
    rng = random.Random(1)
    torch.manual_seed(1)
    for _ in range(200):
        t, k, e = rng.randint(1, 64), rng.randint(1, 4), 8
        x = torch.randn(t, 32).to(dtype)
        experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        weights = torch.rand(t, k).to(dtype)
        plan = plan_layer(3, x, experts, weights, e)
        xs, spans, token_of_row, w = torch_plan(x, experts, weights, e)
        assert plan.xs.dtype == dtype and torch.equal(plan.xs, xs) and plan.spans == spans
        assert torch.equal(plan.token_of_row, token_of_row) and torch.equal(plan.weights, w)
        assert (plan.layer, plan.tokens) == (3, t)
        y = torch.randn(xs.shape).to(dtype)
        want = torch.zeros_like(x).index_add_(0, token_of_row, y * w[:, None])
        assert torch.equal(combine(plan, [(slice(0, xs.shape[0]), y)], x), want)
