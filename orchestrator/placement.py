"""Placement planners: which EW loads which (layer, expert)."""

from __future__ import annotations

import abc


class PlacementPlanner(abc.ABC):
    """Maps every logical expert to an ordered list of EWs. Pure: no I/O, no state."""

    @abc.abstractmethod
    def place(self, units: list[tuple[int, int]], workers: list[str]) -> dict[tuple[int, int], list[str]]: ...


class BalancedPlanner(PlacementPlanner):
    """Each expert on exactly one EW; EWs balanced by count (round-robin over a fixed order)."""

    def place(self, units: list[tuple[int, int]], workers: list[str]) -> dict[tuple[int, int], list[str]]:
        if not workers:
            raise ValueError("no expert workers to place experts on")
        return {unit: [workers[i % len(workers)]] for i, unit in enumerate(sorted(units))}
