"""Stop strings matched on detokenised text.

Text that could still be the start of a stop string is held back. So a stop string is never
emitted, not even in part.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text in -> (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            cut = min(i for i, _ in hits)
            self.held = ""
            return buf[:cut], True
        # Longest suffix of buf that is a proper prefix of some stop string.
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
