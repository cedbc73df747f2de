"""A layer's expert calls as the REFE makes them (attention_worker/forwarding.py): the pieces of the expert-sorted
rows that go to one replica each, and a call per EW with its experts and rows.

Legend: R rows of the layer, R' rows of one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from attention_worker.layer_plan import Rows


class Piece(NamedTuple):
    """Rows [start, start + rows) of the expert-sorted rows, all routed to `expert`.

    It is the expert's `part`-th share when the expert is spread over several replicas. (A tuple: a layer makes
    one per expert, and a frozen dataclass costs ~1 µs to make.)"""

    expert: int
    start: int
    rows: int
    part: int


@dataclass(slots=True)
class Call:
    """One call of a layer: to `ew`, the rows of `experts` (`counts` rows each, from `starts`), `rows` of the plan's
    rows; `pieces` where the general way routed them (a replay keeps each piece's part), None in the usual case."""

    ew: str
    experts: list[int]
    counts: list[int]
    starts: list[int]
    rows: Rows
    pieces: list[Piece] | None = None

    def as_pieces(self) -> list[Piece]:
        """Its pieces: the general way's, or one whole piece an expert (the usual way)."""
        if self.pieces is not None:
            return self.pieces
        return [Piece(e, start, n, 0) for e, start, n in zip(self.experts, self.starts, self.counts)]


def rows_of(pieces: list[Piece]) -> Rows:
    """The rows of `pieces`, in order.

    Where they are one run, as for an EW hosting consecutive experts, this is a slice (a view, no
    copy). Otherwise it is their indices [R']."""
    if all(a.start + a.rows == b.start for a, b in zip(pieces, pieces[1:])):
        return slice(pieces[0].start, pieces[-1].start + pieces[-1].rows) if pieces else slice(0, 0)
    return torch.tensor([r for p in pieces for r in range(p.start, p.start + p.rows)], dtype=torch.long)
