"""Constrained decoding's engine side (fabric/grammar.py) on the demo tokenizer: every kind of
constraint compiles, a bad one is a ConstraintError, masked sampling from random logits yields
output that matches (JSON that parses, with no raw control bytes), and a matcher rebuilt from a
prefix of tokens continues exactly as the one that made them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fabric import grammar
from fabric.messages.client import Constraint
from fabric.model.demo import write_demo_model

pytestmark = pytest.mark.skipif(not grammar.available(), reason="needs the grammar engine (the structured extra)")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "mood": {"type": "string", "enum": ["calm", "busy"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "mood", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[grammar.Grammars, object]:
    from tokenizers import Tokenizer

    model = write_demo_model(tmp_path_factory.mktemp("g") / "demo", arch="mixtral", seed=3)
    cfg = json.loads((Path(model) / "config.json").read_text())
    return grammar.Grammars(str(model), cfg["vocab_size"], [cfg["eos_token_id"]]), \
        Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def decode(g: grammar.Grammars, c: Constraint, seed: int, limit: int = 200, complete: bool = True) -> list[int]:
    """Masked greedy decoding from random logits until the grammar is complete (or `limit` tokens,
    unless `complete` requires it)."""
    m = g.matcher(c, [])
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not m.done and len(out) < limit:
        logits = torch.randn(g.vocab_size, generator=gen)
        m.mask(logits)
        out.append(int(torch.argmax(logits)))
        m.advance(out[-1])
        assert not m.broken
    assert m.done or not complete, "the grammar did not complete"
    return out if m.done else []


@pytest.mark.parametrize("seed", range(6))
def test_masked_output_matches_each_kind(demo: tuple[grammar.Grammars, object], seed: int) -> None:
    g, tok = demo
    text = tok.decode(decode(g, Constraint("json_schema", json.dumps(SCHEMA)), seed))  # type: ignore[attr-defined]
    value = json.loads(text)  # strict: a raw control character would not parse
    assert set(value) == {"name", "mood", "ok"} and value["mood"] in ("calm", "busy") and len(value["name"]) <= 12
    # Any object: random logits may write one longer than the limit (an unbounded string).
    whole = decode(g, Constraint("json_object"), seed, complete=False)
    assert not whole or isinstance(json.loads(tok.decode(whole)), dict)  # type: ignore[attr-defined]
    assert re.fullmatch(r"[a-c]{2,5}x", tok.decode(decode(g, Constraint("regex", "[a-c]{2,5}x"), seed)))  # type: ignore[attr-defined]
    assert tok.decode(decode(g, Constraint("choice", '["red", "green"]'), seed)) in ("red", "green")  # type: ignore[attr-defined]
    ebnf = 'root ::= "(" [0-9] ("+" [0-9])? ")"'
    assert re.fullmatch(r"\(\d(\+\d)?\)", tok.decode(decode(g, Constraint("grammar", ebnf), seed)))  # type: ignore[attr-defined]


def test_a_matcher_rebuilt_from_tokens_continues_the_same(demo: tuple[grammar.Grammars, object]) -> None:
    g, _ = demo
    c = Constraint("json_schema", json.dumps(SCHEMA))
    full = decode(g, c, 7)
    half = len(full) // 2
    m = g.matcher(c, full[:half])  # a request resumed on another AW after `half` tokens
    a, b = torch.randn(g.vocab_size), torch.zeros(g.vocab_size)
    first = g.matcher(c, [])
    for t in full[:half]:
        first.advance(t)
    m.mask(a)
    first.mask(b)
    assert torch.equal(torch.isinf(a), torch.isinf(b))  # the same tokens allowed next


@pytest.mark.parametrize(("c", "what"), [
    (Constraint("json_schema", '{"type": "no-such-type"}'), "json_schema"),
    (Constraint("json_schema", "{not json"), "json_schema"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("grammar", "root ::= missing_rule"), "grammar"),
    (Constraint("choice", "[]"), "choice"),
    (Constraint("nonsense", ""), "nonsense"),
])
def test_a_bad_constraint_is_a_constraint_error(demo: tuple[grammar.Grammars, object], c: Constraint,
                                                what: str) -> None:
    with pytest.raises(grammar.ConstraintError, match=what):
        demo[0].compile(c)
