"""Gather policies, which decide when an EW runs the expert calls it has collected.

This is layer-wise batching (Tarragon §2.1). Calls for the same layer from different AWs run
together, each expert once per batch. A policy only decides *which pending calls run now*. It
never mutates.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

from fabric.messages.expert import ExpertCall
from fabric.transport.base import Connection


@dataclass
class PendingCall:
    aw_id: str
    conn: Connection
    call: ExpertCall
    arrived: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return int(self.call.x.shape[0])


class GatherPolicy(abc.ABC):
    @abc.abstractmethod
    def select(self, pending: list[PendingCall], active_aws: set[str], now: float) -> tuple[list[PendingCall], float | None]:
        """Returns (calls to run now, seconds until the next time-based decision or None).

        `active_aws` are the AWs alive and currently running a batch. A dead or idle AW is never
        waited for.
        """


class SyncPolicy(GatherPolicy):
    """Runs once every active AW has delivered a call.

    Each AW has at most one outstanding call per EW, so all active AWs are then blocked here.
    `max_wait` bounds the wait for stragglers.
    """

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait

    def select(self, pending: list[PendingCall], active_aws: set[str], now: float) -> tuple[list[PendingCall], float | None]:
        if not pending:
            return [], None
        delivered = {p.aw_id for p in pending}
        oldest = min(p.arrived for p in pending)
        if active_aws <= delivered or now - oldest >= self.max_wait:
            return list(pending), None
        return [], oldest + self.max_wait - now


class ThresholdPolicy(GatherPolicy):
    """Runs a layer's calls when they reach `min_tokens` rows or the oldest waited `max_wait`."""

    def __init__(self, min_tokens: int, max_wait: float) -> None:
        self.min_tokens = min_tokens
        self.max_wait = max_wait

    def select(self, pending: list[PendingCall], active_aws: set[str], now: float) -> tuple[list[PendingCall], float | None]:
        by_layer: dict[int, list[PendingCall]] = {}
        for p in pending:
            by_layer.setdefault(p.call.layer, []).append(p)
        run: list[PendingCall] = []
        next_check: float | None = None
        for calls in by_layer.values():
            oldest = min(p.arrived for p in calls)
            if sum(p.rows for p in calls) >= self.min_tokens or now - oldest >= self.max_wait:
                run.extend(calls)
            else:
                wait = oldest + self.max_wait - now
                next_check = wait if next_check is None else min(next_check, wait)
        return run, next_check


def make_policy(name: str, min_tokens: int, max_wait_ms: float) -> GatherPolicy:
    if name == "sync":
        return SyncPolicy(max_wait_ms / 1000)
    if name == "threshold":
        return ThresholdPolicy(min_tokens, max_wait_ms / 1000)
    raise ValueError(f"unknown gather policy {name!r}")
