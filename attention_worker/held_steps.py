"""Whole steps' checkpoint KV held back by the AW, to go to the store as one message.

With four steps a message the store wakes, reads and writes once for every request's four new tokens
instead of four times. The checkpointed frontier trails the live one by up to that many tokens more,
which a restore recomputes (attention_worker/checkpointer.py).

Legend: L layers, T rows of a step, K kv heads, d head dim.
"""

from __future__ import annotations

import torch

Span = tuple[str, int, int]  # (request, first token, tokens)


def join_spans(steps: list[list[Span]]) -> tuple[list[Span], list[int]]:
    """Joins each request's consecutive tokens across steps.

    `steps` holds each step's spans (request, first token, tokens), columns in order, the steps'
    columns one after another. Returns the joined spans and, for each of their columns in order, its
    column among the steps'."""
    runs: dict[str, list[tuple[int, list[int]]]] = {}  # request -> its runs: (first token, their columns)
    col = 0
    for spans in steps:
        for rid, start, n in spans:
            rs = runs.setdefault(rid, [])
            if rs and rs[-1][0] + len(rs[-1][1]) == start:
                rs[-1][1].extend(range(col, col + n))
            else:
                rs.append((start, list(range(col, col + n))))
            col += n
    out: list[Span] = []
    order: list[int] = []
    for rid, rs in runs.items():
        for start, c in rs:
            out.append((rid, start, len(c)))
            order.extend(c)
    return out, order


class HeldSteps:
    """Whole steps, each its spans and k, v [L, T, K, d], until `steps` are held or `max_bytes`."""

    def __init__(self, steps: int, max_bytes: int) -> None:
        self.steps = steps
        self.max_bytes = max_bytes
        self._held: list[tuple[list[Span], torch.Tensor, torch.Tensor]] = []
        self._bytes = 0

    def clear(self) -> None:
        self._held, self._bytes = [], 0

    def add(self, spans: list[Span], k: torch.Tensor, v: torch.Tensor) -> bool:
        """Holds a step (k, v its own copies). Returns whether enough steps or bytes are held to send."""
        self._held.append((spans, k, v))
        self._bytes += 2 * k.numel() * k.element_size()
        return len(self._held) >= self.steps or self._bytes >= self.max_bytes

    def take(self) -> tuple[list[Span], torch.Tensor, torch.Tensor] | None:
        """Every step held as one: each request's consecutive tokens one span, k, v [L, sum T, K, d] in their
        order. None if none is held."""
        held = self._held
        self.clear()
        if len(held) <= 1:
            return held[0] if held else None
        spans, cols = join_spans([s for s, _, _ in held])
        idx = torch.tensor(cols, dtype=torch.long, device=held[0][1].device)
        k = torch.cat([kk for _, kk, _ in held], 1).index_select(1, idx)
        v = torch.cat([vv for _, _, vv in held], 1).index_select(1, idx)
        return spans, k, v
