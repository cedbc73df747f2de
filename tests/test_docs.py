"""The architecture map links each main loop by line number; a refactor that moves a loop must
move its link too, or the map sends a reader to the wrong place."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[`(?:\w+\.)?(\w+)`\]\(\.\./([\w/]+\.py)#L(\d+)\)")


def test_architecture_links_point_at_their_definitions() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    links = LINK.findall(text)
    assert len(links) >= 7, "the main-loop table lost its links"
    for name, path, line in links:
        lines = (ROOT / path).read_text().splitlines()
        target = lines[int(line) - 1]
        assert re.search(rf"\b(def|class) {name}\b", target), f"{path}#L{line} is not {name}: {target!r}"
