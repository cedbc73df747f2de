"""The torch path's decode metadata, built for all decode tokens at once (ModelRunner._dense_decode),
equals its definition per sequence: slot `table[p // S] * S + p % S` for every position before
the token's length (0 after), and a mask of the positions it sees (causal, within the window)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from attention_worker.kv_cache import BlockManager
from attention_worker.model_runner import ModelRunner


@pytest.mark.parametrize("window", [None, 5, 40])
def test_decode_slots_and_masks_equal_the_per_sequence_definition(window: int | None) -> None:
    rng = random.Random(window or 0)
    size = 8
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv = SimpleNamespace(blocks=BlockManager(64, size))  # type: ignore[assignment]
    runner.cfg = SimpleNamespace(sliding_window=window)  # type: ignore[assignment]
    for _ in range(100):
        lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 7))]
        tables = [rng.sample(range(64), -(-n // size)) for n in lens]
        widest = max(len(t) for t in tables)
        padded = torch.tensor([t + [-1] * (widest - len(t)) for t in tables])
        slots, mask = runner._dense_decode(padded, torch.tensor(lens))
        longest = max(lens)
        assert slots.shape == (len(lens), longest) and mask.shape == (len(lens), 1, 1, longest)
        for i, (n, table) in enumerate(zip(lens, tables)):
            want = [table[p // size] * size + p % size for p in range(n)] + [0] * (longest - n)
            assert slots[i].tolist() == want
            sees = [p < n and (window is None or p > n - 1 - window) for p in range(longest)]
            assert mask[i, 0, 0].tolist() == sees


def test_no_decode_tokens() -> None:
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv = SimpleNamespace(blocks=BlockManager(4, 8))  # type: ignore[assignment]
    runner.cfg = SimpleNamespace(sliding_window=None)  # type: ignore[assignment]
    slots, mask = runner._dense_decode(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert slots.shape == (0, 0) and mask.shape == (0, 1, 1, 0)
