"""Placement planners: which EWs hold which (layer, expert), in routing order."""

from __future__ import annotations

import abc


class PlacementPlanner(abc.ABC):
    """Maps every logical expert to an ordered list of EWs (primary first, then shadows).
    Pure: no I/O, no state."""

    @abc.abstractmethod
    def place(self, units: list[tuple[int, int]], workers: list[str]) -> dict[tuple[int, int], list[str]]: ...


class BalancedPlanner(PlacementPlanner):
    """Primaries round-robin over the EWs (balanced by count). Each of the `shadows` inactive copies
    of a unit goes on the EW that follows the previous copy's, so the copies of one expert are on
    distinct EWs (any single EW failure leaves a live copy) and shadows are balanced too."""

    def __init__(self, shadows: int = 0) -> None:
        if shadows < 0:
            raise ValueError("shadows must be >= 0")
        self.shadows = shadows

    def place(self, units: list[tuple[int, int]], workers: list[str]) -> dict[tuple[int, int], list[str]]:
        if not workers:
            raise ValueError("no expert workers to place experts on")
        copies = 1 + min(self.shadows, len(workers) - 1)
        n = len(workers)
        return {unit: [workers[(i + j) % n] for j in range(copies)] for i, unit in enumerate(sorted(units))}
