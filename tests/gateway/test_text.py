"""Incremental detokenisation and stop strings, on the demo model's real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from fabric.model.demo import write_demo_model
from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopMatcher


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = write_demo_model(tmp_path_factory.mktemp("tok") / "m")
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_incremental_detokenisation_never_splits_a_character(tok: Tokenizer) -> None:
    text = "héllo wörld 你好 🚀 serving"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_are_held_back_and_never_emitted() -> None:
    m = StopMatcher(["END", "xyz"])
    out = []
    for piece in ["hello E", "N", "D tail"]:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "hello " and hit
    m = StopMatcher(["END"])
    assert m.feed("a E")[0] == "a " and m.feed("x")[0] == "Ex"  # a false start is released
    assert m.feed("EN")[0] == "" and m.flush() == "EN"
