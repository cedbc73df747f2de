"""The KV an AW's steps wrote, held until it goes to the checkpoint store, four steps to a message.

A step's layers are stacked once, at its end, into one segment (k, v [L, T, K, d]). Whole steps are
then held until `steps` are (or MAX_BYTES), and go as one message in which each request's consecutive
tokens are one span: the store wakes, reads and writes a span once for four tokens, which halved its
CPU a token (docs/performance.md). The checkpointed frontier then trails the live one by up to `steps`
tokens (three held, a fourth's message not yet out), where it trailed by one: a restore recomputes them
(attention_worker/checkpointer.py). A step stopped part-way, or too large for one message, goes as its
layers come, after what is held, in order.

Legend: L layers, m of them, T rows of a step, K kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Span = tuple[str, int, int]  # (request, first token, tokens)
Send = Callable[[int, list[Span], torch.Tensor, torch.Tensor], None]  # (first layer, spans, k, v [m, T, K, d])

# A message's bytes at most: consecutive layers of a step, or whole steps, are joined up to this. A step of
# 64 decodes of the bench model is 1 MiB.
MAX_BYTES = 4 << 20


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
    """A step's layers, and whole steps, until they go through `send`."""

    def __init__(self, num_layers: int, steps: int, send: Send, max_bytes: int = MAX_BYTES) -> None:
        self.num_layers = num_layers
        self.steps = steps
        self.send = send
        self.max_bytes = max_bytes
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # a step's layers, not yet a segment
        self._pending_layer = 0  # the first of them
        self._pending_spans: list[Span] = []
        self._held: list[tuple[list[Span], torch.Tensor, torch.Tensor]] = []  # whole steps: spans, k, v [L, T, K, d]
        self._bytes = 0

    def clear(self) -> None:
        self._pending, self._held, self._bytes = [], [], 0

    def record_step(self, spans: list[Span], layers: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """A step's layers (layer, k, v [T, K, d]), in order. A whole step that fits one message is stacked at once."""
        if not layers:
            return
        k0 = layers[0][1]
        if not self._pending and layers[0][0] == 0 and len(layers) == self.num_layers \
                and 2 * len(layers) * k0.numel() * k0.element_size() < self.max_bytes:
            self._pending_layer, self._pending_spans = 0, spans
            self._pending = [(k, v) for _, k, v in layers]
            self._segment()
            return
        for layer, k, v in layers:
            self.record_layer(layer, spans, k, v)

    def record_layer(self, layer: int, spans: list[Span], k: torch.Tensor, v: torch.Tensor) -> None:
        """One layer's k, v [T, K, d]. Consecutive layers of a step are joined, up to `max_bytes` and always
        at the last layer."""
        if self._pending and (layer != self._pending_layer + len(self._pending) or spans != self._pending_spans):
            # A step that stopped part-way. Its data is still right, as KV is deterministic.
            self._segment()
        if not self._pending:
            self._pending_layer, self._pending_spans = layer, spans
        self._pending.append((k, v))  # every layer of a step has the same shape
        if layer == self.num_layers - 1 or 2 * len(self._pending) * k.numel() * k.element_size() >= self.max_bytes:
            self._segment()

    def flush(self) -> None:
        """Sends everything held, in order (before a request's end goes to the store)."""
        self._segment()
        self._send_held()

    def _segment(self) -> None:
        """The layers recorded of a step, stacked: held if they are the whole step, else sent behind those held."""
        if not self._pending:
            return
        spans, layer = self._pending_spans, self._pending_layer
        k = torch.stack([kk for kk, _ in self._pending])  # [m, T, K, d]
        v = torch.stack([vv for _, vv in self._pending])
        self._pending = []
        if layer == 0 and k.shape[0] == self.num_layers and self.steps > 1:
            self._held.append((spans, k, v))
            self._bytes += 2 * k.numel() * k.element_size()
            if len(self._held) >= self.steps or self._bytes >= self.max_bytes:
                self._send_held()
            return
        self._send_held()  # (in order: the store counts segments that arrive out of order)
        self.send(layer, spans, k, v)

    def _send_held(self) -> None:
        """Every whole step held, as one message: each request's consecutive tokens one span, k, v [L, sum T, K, d]
        in their order."""
        held, self._held, self._bytes = self._held, [], 0
        if not held:
            return
        if len(held) == 1:
            self.send(0, *held[0])
        elif (spans := in_lockstep([s for s, _, _ in held])) is not None:
            # Steady decoding: the same requests, a token each, in the same order every step. Joining them is
            # stacking the steps beside each column: [L, T, S, K, d] viewed as [L, T*S, K, d], one copy.
            self.send(0, spans, torch.stack([kk for _, kk, _ in held], 2).flatten(1, 2),
                      torch.stack([vv for _, _, vv in held], 2).flatten(1, 2))
        else:
            spans, cols = join_spans([s for s, _, _ in held])
            idx = torch.tensor(cols, dtype=torch.long, device=held[0][1].device)
            k = torch.cat([kk for _, kk, _ in held], 1).index_select(1, idx)
            v = torch.cat([vv for _, _, vv in held], 1).index_select(1, idx)
            self.send(0, spans, k, v)
