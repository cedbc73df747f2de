"""Publishing the cluster view to every worker link, as cheaply as deployment scale needs.

    whole view   `RoutingUpdate`, to a link that has not seen the previous broadcast. That is a new
                 or re-registered worker, or one that asked with `ViewRequest`.
    delta        `ViewDelta` from the previous broadcast (fabric/view_delta.py), to every other link.
                 It is packed once for all of them. A death's is O(EWs + 1 worker) bytes, not the table.
    coalescing   `publish(soon=True)` (registrations, readiness) waits `COALESCE_S`. So a burst, such
                 as every worker registering again with a restarted orchestrator, goes out as one
                 broadcast. A death's goes at once.

Each broadcast is logged with its epoch, seq, wall time, when the last link took it, and bytes.
The log serves `GET /cluster` and the scale experiment, which measures how long the last AW takes
to apply it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from fabric.control_link import pack
from fabric.messages.control import ClusterView, RoutingUpdate
from fabric.view_delta import diff
from orchestrator.links import WorkerLink

COALESCE_S = 0.01
LOG_LENGTH = 64


class Broadcaster:
    def __init__(self, links: dict[str, WorkerLink], view: Callable[[int], ClusterView | None]) -> None:
        self.links = links  # the orchestrator's, live
        self.view = view  # seq -> the cluster's view now (None before the first table)
        self.seq = 0
        self.last: ClusterView | None = None
        self.log: collections.deque[dict[str, Any]] = collections.deque(maxlen=LOG_LENGTH)
        self._due: asyncio.TimerHandle | None = None
        self._packed: tuple[ClusterView, bytes] | None = None  # the last whole view packed

    def publish(self, soon: bool = False) -> dict[str, Any] | None:
        """Broadcasts now and returns the broadcast's log record, or broadcasts `soon`, coalesced."""
        if soon:
            if self._due is None:
                self._due = asyncio.get_running_loop().call_later(COALESCE_S, self.flush)
            return None
        return self.flush()

    def flush(self) -> dict[str, Any] | None:
        if self._due is not None:
            self._due.cancel()
            self._due = None
        view = self.view(self.seq + 1)
        if view is None:
            return None
        self.seq += 1
        prev, self.last = self.last, view
        delta = diff(prev, view) if prev is not None else None
        delta_data = pack(delta) if delta is not None else b""
        record: dict[str, Any] = {"seq": view.seq, "epoch": view.table.epoch if view.table else 0, "at": time.time(),
                                  "sent_at": None, "deltas": 0, "wholes": 0, "delta_bytes": len(delta_data)}
        cpu0 = time.process_time()

        # The last link's write ends the broadcast. The CPU used meanwhile is mostly its cost.
        def sent() -> None:
            record["sent_at"] = time.time()
            record["send_cpu_ms"] = 1e3 * (time.process_time() - cpu0)

        for link in list(self.links.values()):
            if delta is not None and prev is not None and link.view_seq == prev.seq:
                link.send_packed(delta_data, sent)
                record["deltas"] += 1
            else:
                link.send_packed(self._whole(view), sent)
                record["wholes"] += 1
            link.view_seq = view.seq
        self.log.append(record)
        return record

    def _whole(self, view: ClusterView) -> bytes:
        """`view` packed whole, once per broadcast however many links need it."""
        if self._packed is None or self._packed[0] is not view:
            self._packed = (view, pack(RoutingUpdate(view)))
        return self._packed[1]

    def log_json(self) -> list[dict[str, Any]]:
        """The broadcast log for `GET /cluster`, with the size the whole view would have had.

        The view is packed here, when asked, not on the failover path."""
        if self.last is not None and self.log and "whole_bytes" not in self.log[-1]:
            self.log[-1]["whole_bytes"] = len(self._whole(self.last))
        return list(self.log)

    def send_whole(self, link: WorkerLink) -> None:
        """Sends the last broadcast view, whole, to one link that asked or has just registered."""
        if self.last is not None:
            link.send_packed(self._whole(self.last))
            link.view_seq = self.last.seq
