"""Gather policies, which decide when an EW runs the expert calls it has collected.

This is layer-wise batching (Tarragon §2.1). Calls for the same layer from different AWs run
together, each expert once per batch. A policy only decides *which pending calls run now*. It
never changes the pending calls; the sync policy keeps what it measured of the waits and the batches.
"""

from __future__ import annotations

import abc
import statistics
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
    hurried = 0  # batches run without waiting for the AWs a sync gather waits for (stats)

    @abc.abstractmethod
    def select(self, pending: list[PendingCall], active_aws: set[str], now: float) -> tuple[list[PendingCall], float | None]:
        """Returns (calls to run now, seconds until the next time-based decision or None).

        `active_aws` are the AWs alive and currently running a batch. A dead or idle AW is never
        waited for.
        """

    def ran(self, seconds: float) -> None:  # noqa: B027 (a hook: most policies keep nothing)
        """Told after each batch how long it took."""


class SyncPolicy(GatherPolicy):
    """Runs once every active AW has delivered a call, and brings the AWs onto the same layer.

    Each AW has at most one outstanding call per EW, so all active AWs are then blocked here.
    `max_wait` bounds the wait for stragglers. Calls for one layer read each expert's weights once
    for all of them; calls for different layers read two layers' weights. AWs that drift apart would
    stay apart (each waits here for the other's call, whatever its layer), so when the calls are
    for different layers only the AWs furthest behind run, and the others wait for them to catch up
    (within `max_wait`). Layers are taken round the cycle of `num_layers`: the furthest behind is the
    layer after the widest gap (an AW at the last layer is just behind one at the first layer of its
    next step). Every EW sees the same layers and picks the same.

    Waiting pays while it is shorter than the batch it saves: calls run together read each expert once, so the
    most a wait can save is one batch. Where the experts cost less than the wait (a fast device, or no compute
    at all), the early calls are better run at once and the AWs left to go at their own pace. So the policy
    measures both: over a window of `WINDOW` batches run in step, the mean wait of a batch's first call against
    the mean batch (what waiting costs and saves on average: a rare long wait counts). Where the wait is longer,
    the next `HURRY` batches run as their calls come, then a window in step measures again (and brings the AWs
    back onto one layer, should the experts have grown costly meanwhile). Where it is shorter, the next window
    runs in step too. Nothing changes for one AW alone, which is never waited for.
    """

    WINDOW = 16  # batches run in step whose waits and times decide what comes next
    HURRY = 112  # batches run as their calls come before the next window (in step 1/8 of the time)

    def __init__(self, max_wait: float, num_layers: int = 0) -> None:
        self.max_wait = max_wait
        self.num_layers = num_layers
        self.waits: list[float] = []  # this window's: how long each batch's first call waited
        self.times: list[float] = []  # this window's batches, seconds each
        self.hurry = 0  # batches left to run as their calls come
        self.hurried = 0  # batches run so, all told (stats)

    def ran(self, seconds: float) -> None:
        if self.hurry:
            self.hurry -= 1
            self.hurried += 1
            return
        self.times.append(seconds)
        if len(self.times) >= self.WINDOW:
            # (A window of mostly replays, which skip the policy and wait for nobody, decides nothing.)
            if len(self.waits) >= self.WINDOW // 2 and statistics.fmean(self.waits) > statistics.fmean(self.times):
                self.hurry = self.HURRY
            self.waits, self.times = [], []

    def _waited(self, calls: list[PendingCall], now: float) -> list[PendingCall]:
        """The calls that run now, their first's wait taken into the window."""
        self.waits.append(now - min(p.arrived for p in calls))
        return calls

    def select(self, pending: list[PendingCall], active_aws: set[str], now: float) -> tuple[list[PendingCall], float | None]:
        if not pending:
            return [], None
        if self.hurry:
            return list(pending), None
        if len(pending) == 1:  # (the usual case at a few streams: one AW's call, and nobody else's to wait for)
            p = pending[0]
            if now - p.arrived >= self.max_wait or not active_aws or active_aws == {p.aw_id}:
                return self._waited(list(pending), now), None
            return [], p.arrived + self.max_wait - now
        delivered = {p.aw_id for p in pending}
        oldest = min(p.arrived for p in pending)
        if now - oldest >= self.max_wait:
            return self._waited(list(pending), now), None
        if not active_aws <= delivered:
            return [], oldest + self.max_wait - now
        layers = sorted({p.call.layer for p in pending})
        if len(layers) == 1 or self.num_layers <= 0:
            return self._waited(list(pending), now), None
        behind = behind_layer(layers, self.num_layers)
        run: list[PendingCall] = []
        held: list[PendingCall] = []
        for p in pending:
            (run if p.call.layer == behind or p.aw_id not in active_aws else held).append(p)
        return self._waited(run, now), (min(p.arrived for p in held) + self.max_wait - now) if held else None


def behind_layer(layers: list[int], num_layers: int) -> int:
    """The layer furthest behind of `layers` (sorted, distinct) on a cycle of `num_layers`: the one
    after the widest gap, the first such on a tie."""
    gaps = [(b - a) for a, b in zip(layers, layers[1:])] + [layers[0] + num_layers - layers[-1]]
    widest = gaps.index(max(gaps))
    return layers[(widest + 1) % len(layers)]


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


def make_policy(name: str, min_tokens: int, max_wait_ms: float, num_layers: int) -> GatherPolicy:
    if name == "sync":
        return SyncPolicy(max_wait_ms / 1000, num_layers)
    if name == "threshold":
        return ThresholdPolicy(min_tokens, max_wait_ms / 1000)
    raise ValueError(f"unknown gather policy {name!r}")
