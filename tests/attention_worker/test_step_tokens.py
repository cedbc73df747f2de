"""A step's tokens from its logits (attention_worker/step_tokens.py): each sampling chunk's token appended, the tokens
grouped by the gateway that receives them, finished requests given back, and a request whose sampling raises given
back as failed while the others' tokens are unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attention_worker import step_tokens
from attention_worker.model_runner import Chunk
from attention_worker.request import Sequence
from attention_worker.sampler import sample
from attention_worker.step_tokens import sample_step

V = 32
POISON = 4242


class Client:
    """A gateway connection: what it was sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_nowait(self, msg: Any) -> None:
        self.sent.append(msg)


def seq(name: str, client: Client, temperature: float, seed: int = 0, max_tokens: int = 8,
        outputs: int = 2) -> Sequence:
    s = Sequence(name, [3, 4, 5], [6 + i for i in range(outputs)], max_tokens, temperature, 1.0, -1, seed,
                 frozenset({2}), False, client=client)
    s.num_computed = s.num_tokens - 1  # a decode chunk: its last token is fed this step
    return s


def decode(*seqs: Sequence) -> list[Chunk]:
    return [Chunk(s, s.num_computed, 1) for s in seqs]


def logits_peaked_at(*tokens: int) -> torch.Tensor:
    out = torch.zeros(len(tokens), V)
    for row, t in enumerate(tokens):
        out[row, t] = 30.0
    return out


def test_tokens_go_to_their_gateways_and_finished_requests_come_back() -> None:
    x, y = Client(), Client()
    a = seq("a", x, 0.0)
    b = seq("b", y, 0.7, seed=9)
    c = seq("c", x, 0.0, max_tokens=3)  # its third token ends it
    d = seq("d", x, 0.0)
    d.num_computed -= 2  # a prefill chunk that does not reach the end: it samples nothing
    chunks = decode(a, b, c) + [Chunk(d, d.num_computed, 1)]
    before = [s.num_computed for s in (a, b, c, d)]
    out = sample_step(chunks, logits_peaked_at(11, 12, 2))
    assert out.rows == 3 and not out.failed
    assert [s.num_computed - n for s, n in zip((a, b, c, d), before, strict=True)] == [1, 1, 1, 1]
    assert a.output_ids[-1] == 11 and c.output_ids[-1] == 2 and len(d.output_ids) == 2
    assert b.output_ids[-1] == sample(logits_peaked_at(12)[0], 0.7, 1.0, -1, 9, 2)
    assert [(o.request_id, o.token, o.finish) for o in out.per_client[x]] == [("a", 11, None), ("c", 2, "stop")]
    assert [o.request_id for o in out.per_client[y]] == ["b"]
    assert out.finished == [c] and a.outputs[-1] is out.per_client[x][0]


def test_a_request_whose_sampling_raises_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def poisoned(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, *rest: Any) -> int:
        if seed == POISON:
            raise ValueError("a poisoned row")
        return sample(logits, temperature, top_p, top_k, seed, *rest)

    monkeypatch.setattr(step_tokens, "sample", poisoned)
    x = Client()
    a, bad, b = seq("a", x, 0.5, seed=1), seq("bad", x, 0.5, seed=POISON), seq("b", x, 0.0)
    out = sample_step(decode(a, bad, b), logits_peaked_at(7, 8, 9))
    assert out.rows == 3 and out.finished == []
    assert [(s.request_id, why) for s, why in out.failed] == [("bad", "sampling failed: a poisoned row")]
    assert bad.output_ids == [6, 7] and bad.outputs == []  # nothing appended, nothing sent
    assert (a.output_ids[-1], b.output_ids[-1]) == (7, 9)
    assert [o.request_id for o in out.per_client[x]] == ["a", "b"]
