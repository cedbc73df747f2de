"""The KV an AW's steps wrote, held until it goes to the checkpoint store, four steps to a message.

A step's KV is already in the AW's paged cache, and its slots there do not change while its requests run. So a
step is held as its spans and its rows' cache slots, no copy, and a message goes out as the slots of its columns: the
checkpointer gathers their K and V out of the cache, every layer in one op, when it sends the message. Whole steps
are held until `steps` are (or MAX_BYTES), and go as one message in which each request's consecutive tokens are one
span: the store wakes, reads and writes a span once for four tokens, which halved its CPU a token
(docs/performance.md). The checkpointed frontier then trails the live one by up to `steps`
tokens (three held, a fourth's message not yet out), where it trailed by one: a restore recomputes them
(attention_worker/checkpointer.py). A step too large for one message goes at once, after what is held, a run of
its layers a message.

What is held, and what is queued to be gathered, must be gathered before the cache blocks it reads are freed
(`Checkpointer.before_release`).

Legend: L layers, m of them, T rows of a step, S steps held, K kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Span = tuple[str, int, int]  # (request, first token, tokens)
# (first layer, end layer, spans, cache slots [T] of the spans' columns in order): a message of those layers' K and V.
Send = Callable[[int, int, list[Span], torch.Tensor], None]

# A message's bytes at most: whole steps are joined up to this, and a larger step's layers are sent in runs of at most
# this. A step of 64 decodes of the bench model is 1 MiB.
MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class ToGather:
    """A KvAppend whose K and V are still in the cache, at `slots`: gathered when it goes, or before a block of the
    cache is freed (`Checkpointer.before_release`)."""

    seq_no: int
    first: int  # layers first .. end-1
    end: int
    spans: list[Span]
    slots: torch.Tensor  # [n] the spans' columns
    nbytes: int

    def gather(self, kv_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Its layers' rows at its slots out of the cache kv_all [2, L, B*S, K, d] (K and V) in one op: k, v [m, n, K, d],
        the halves of one copy."""
        kv = kv_all[:, self.first:self.end].index_select(2, self.slots.to(kv_all.device))
        return kv[0], kv[1]


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


def in_lockstep(steps: list[list[Span]]) -> list[Span] | None:
    """`join_spans`'s spans where every step holds the same requests, one token each, in the same order, each a
    token on from the step before (so the joined columns are each request's tokens step after step); else None."""
    first = steps[0]
    if any(n != 1 for _, _, n in first):
        return None
    for i, spans in enumerate(steps[1:], 1):
        if spans != [(rid, start + i, 1) for rid, start, _ in first]:
            return None
    return [(rid, start, len(steps)) for rid, start, _ in first]


class HeldSteps:
    """Whole steps, as their spans and cache slots, until they go through `send`."""

    def __init__(self, num_layers: int, row_bytes: int, steps: int, send: Send, max_bytes: int = MAX_BYTES) -> None:
        self.num_layers = num_layers
        self.row_bytes = row_bytes  # one token's K and V in one layer
        self.steps = steps
        self.send = send
        self.max_bytes = max_bytes
        self._held: list[tuple[list[Span], torch.Tensor]] = []  # (spans, slots [T]) of each step held
        self._bytes = 0

    def clear(self) -> None:
        self._held, self._bytes = [], 0

    def record_step(self, spans: list[Span], slots: torch.Tensor) -> None:
        """A step's spans and the cache slots its rows [T] wrote in every layer."""
        step_bytes = self.num_layers * slots.numel() * self.row_bytes
        if step_bytes >= self.max_bytes or self.steps == 1:
            self.flush()  # (in order: the store counts segments that arrive out of order)
            per = max(1, self.max_bytes // max(1, slots.numel() * self.row_bytes))  # layers a message
            for first in range(0, self.num_layers, per):
                self.send(first, min(self.num_layers, first + per), spans, slots)
            return
        self._held.append((spans, slots))
        self._bytes += step_bytes
        if len(self._held) >= self.steps or self._bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        """Every step held, as one message: each request's consecutive tokens one span, the slots of their columns in
        order."""
        held, self._held, self._bytes = self._held, [], 0
        if not held:
            return
        if len(held) == 1:
            spans, slots = held[0]
        elif (joined := in_lockstep([s for s, _ in held])) is not None:
            # Steady decoding: the same requests, a token each, in the same order every step. Each request's tokens
            # are its column of every step: the steps' slots [S, T] read down the columns.
            spans, slots = joined, torch.stack([s for _, s in held], 1).flatten()
        else:
            spans, cols = join_spans([s for s, _ in held])
            slots = torch.cat([s for _, s in held])[torch.tensor(cols, dtype=torch.long, device=held[0][1].device)]
        self.send(0, self.num_layers, spans, slots)
