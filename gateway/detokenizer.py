"""Incremental detokenisation that never splits a multi-byte character.

Text is released only once the decoded suffix no longer ends in U+FFFD, which marks an incomplete
UTF-8 sequence.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        # Start of the decode window. It gives context to tokenizers whose pieces depend on it.
        self.prefix = 0
        self.read = 0  # ids before this are already released as text

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Returns whatever is left at the end.

        This may be a replacement character for a truncated sequence.
        """
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
