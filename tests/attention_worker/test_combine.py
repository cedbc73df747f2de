"""The REFE's combine (attention_worker/forwarding.py) adds each token's weighted expert results,
whatever pieces the results came back in: runs that tile the rows (joined as they are), runs out
of order, empty calls, index pieces (a replica's share of a hot expert), and rows no call covered
(left zero), always exactly as scattering every piece into place does."""

from __future__ import annotations

import random

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


def test_the_host_plan_is_the_torch_plan_bit_for_bit() -> None:
    """`plan_layer` plans host float tensors with numpy: the same rows, order, spans and weights as torch's plan."""
    from attention_worker.layer_plan import _plan_on_host, _plan_with_torch

    rng = random.Random(1)
    torch.manual_seed(1)
    for _ in range(200):
        t, k, e = rng.randint(1, 64), rng.randint(1, 4), 8
        x = torch.randn(t, 32)
        experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        weights = torch.rand(t, k)
        a, b = _plan_with_torch(3, x, experts, weights, e), _plan_on_host(3, x, experts, weights, e)
        assert torch.equal(a.xs, b.xs) and torch.equal(a.host, b.host) and a.spans == b.spans
        assert torch.equal(a.token_of_row, b.token_of_row) and torch.equal(a.weights, b.weights)
        assert (a.layer, a.tokens) == (b.layer, b.tokens)
