"""Constrained decoding's engine side (fabric/grammar.py) on the demo tokenizer: every kind of
constraint compiles, a bad one is a ConstraintError, masked sampling from random logits yields
output that matches (JSON that parses, with no raw control bytes), and a matcher rebuilt from a
prefix of tokens continues exactly as the one that made them."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from fabric import grammar
from fabric.messages.client import Constraint
from fabric.model.demo import write_demo_model
from tests.helpers import poll_until

pytestmark = pytest.mark.skipif(not grammar.available(), reason="needs the grammar engine (the structured extra)")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "mood": {"type": "string", "enum": ["calm", "busy"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "mood", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("g") / "demo", arch="mixtral", seed=3)


@pytest.fixture(scope="module")
def demo(demo_model: Path) -> tuple[grammar.Grammars, object]:
    from tokenizers import Tokenizer

    model = demo_model
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


def test_compiles_past_their_deadline_keep_their_threads_and_a_full_house_refuses_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiles queue for a thread within their deadline; one that outlasts it is refused to its caller but holds
    its thread until it ends. With every thread so held the next compile is refused at once (not queued), while
    the loop's default executor (the gateway's tokenizing) serves on; once the stuck ones end, compiles run again."""
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.3)
    slots = grammar.CompileSlots(2)
    release = threading.Event()

    def stuck() -> str:  # a grammar whose compile takes as long as the test wants
        release.wait(30)
        return "compiled"

    def quick(i: int) -> int:
        time.sleep(0.02)
        return i

    async def scenario() -> None:
        # A burst of quick compiles, more than the threads: they queue, none is refused.
        assert await asyncio.gather(*(slots.run(quick, i) for i in range(6))) == list(range(6))
        assert slots.stuck == 0
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await slots.run(stuck)
        assert slots.stuck == 2
        refused = slots.run(quick, 0)
        with pytest.raises(grammar.GrammarBusyError, match="all 2 of its threads"):
            refused.send(None)  # at its first step, before any wait: refused, not queued behind the stuck ones
        assert await asyncio.to_thread(lambda: "tokenized") == "tokenized"
        release.set()
        assert await asyncio.to_thread(poll_until, lambda: slots.stuck == 0)  # (the stuck compiles end)
        assert await slots.run(quick, 7) == 7

    asyncio.run(scenario())


def test_the_gateway_answers_a_busy_compiler_with_a_503_and_a_costly_grammar_with_a_400(
        demo: tuple[grammar.Grammars, object], demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.protocol import ApiError
    from gateway.structured import fields

    g = demo[0]
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(grammar, "COMPILES", grammar.CompileSlots(1))
    model = str(demo_model)
    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
    got = asyncio.run(fields(body, False, model, g.vocab_size, g.stop_token_ids))
    assert got["constraint"].kind == "json_schema"  # a real schema compiles on the compile thread
    release = threading.Event()
    slow = grammar.Grammars.compile

    def costly(self: grammar.Grammars, c: Constraint) -> object:
        release.wait(30)  # as a grammar that compiles for longer than the deadline
        return slow(self, c)

    monkeypatch.setattr(grammar.Grammars, "compile", costly)
    with pytest.raises(ApiError) as err:
        asyncio.run(fields(body, False, model, g.vocab_size, g.stop_token_ids))
    assert err.value.status == 400 and "too costly" in err.value.message and err.value.param == "response_format"
    with pytest.raises(ApiError) as err:  # its compile still holds the only thread
        asyncio.run(fields(body, False, model, g.vocab_size, g.stop_token_ids))
    assert err.value.status == 503 and err.value.headers == {"Retry-After": "1"} and "busy" in err.value.message
    release.set()
    assert poll_until(lambda: grammar.COMPILES.stuck == 0)  # the stuck compile ends: nothing outlives the test
