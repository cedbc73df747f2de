"""The architecture map (and the README) link main loops and decisions by line number; a refactor
that moves one must move its link too, or the map sends a reader to the wrong place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[`(?:\w+\.)?(\w+)`\]\((?:\.\./)?([\w/]+\.py)#L(\d+)\)")


@pytest.mark.parametrize(("doc", "least"), [("docs/architecture.md", 7), ("README.md", 2)])
def test_code_links_point_at_their_definitions(doc: str, least: int) -> None:
    links = LINK.findall((ROOT / doc).read_text())
    assert len(links) >= least, f"{doc} lost its links to the code"
    for name, path, line in links:
        lines = (ROOT / path).read_text().splitlines()
        target = lines[int(line) - 1]
        assert re.search(rf"\b(def|class) {name}\b", target), f"{path}#L{line} is not {name}: {target!r}"
