"""One AW's link to one EW (Tarragon §4.2).

A link has a control and a data channel and the futures of the calls in flight on it. It also holds
what tells whether the EW can be used: its traffic, answers to probes, and results.
attention_worker/ew_links.py owns the links and their one watcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fabric import trace
from fabric.errors import FabricError, PeerDeadError, PeerSilentError, PeerStalledError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.expert import ExpertError, ExpertResult
from fabric.messages.liveness import Ping, Pong
from fabric.routing import EwAddress
from fabric.transport.base import Connection


class ExpertCallError(FabricError):
    """The EW refused a call (e.g. the expert is not hosted there)."""

    recoverable = True


@dataclass
class EwLink:
    addr: EwAddress
    control: Connection
    data: Connection
    pending: dict[int, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    dead: bool = False
    last_heard: float = field(default_factory=time.monotonic)  # any message from this EW
    last_data: float = field(default_factory=time.monotonic)  # an expert result (or error) from this EW
    sent_at: dict[int, float] = field(default_factory=dict)  # call id -> send time
    latency: float = 0.0  # smoothed call latency (EWMA)
    # Smoothed round trip of a probe (EWMA), the yardstick of "silent too long".
    rtt: float = 0.0
    probes: int = 0  # pings sent since it was last heard
    # How many of this AW's calls the EW said it holds in its last Pong, and since when its batch
    # under way has run (None if there is none).
    held: int = 0
    busy_since: float | None = None
    pinged_at: dict[int, float] = field(default_factory=dict)  # probe nonce -> when it was sent
    # Whether this AW sends the EW an empty call at a layer that has no rows for it: while another AW has a
    # batch running there, as the EW's last result said (`ExpertResult.others`). `said_pads` is what this AW's
    # last message to it said; the EW waits for it only while that is true.
    pads: bool = True
    said_pads: bool = True
    batch_s: float = 0.0  # how long the EW's batch took that computed the last result (`ExpertResult.batch_s`)
    own_s: float = 0.0  # the last result's time since its call went out, less `batch_s`: the messages' and waits' own
    unread: int = 0  # bytes unread on the data channel at the last look past the deadline (`_arriving`)
    # Closed by this AW, by a table without it. Its end is no news.
    closing: bool = False
    on_dead: Callable[[EwLink, FabricError], None] | None = None  # told once, when the link dies

    def start_reading(self) -> None:
        """Routes the data channel's results to the futures of their calls, as they arrive (no reader task).

        Traffic is the implicit heartbeat. The channel's end fails the link."""
        self.data.deliver(self._on_data, self.fail)

    def _on_data(self, msg: Message) -> None:
        # A nudge: someone claimed this AW's id there (`bound_elsewhere`).
        if isinstance(msg, Pong):
            return
        self.last_heard = self.last_data = now = time.monotonic()
        call_id = getattr(msg, "call_id", -1)
        trace.stamp("result", "", call_id)
        sent = self.sent_at.pop(call_id, None)
        took = 0.0 if sent is None else now - sent
        if sent is not None:
            self.latency = took if not self.latency else 0.875 * self.latency + 0.125 * took
        fut = self.pending.pop(call_id, None)
        if fut is None or fut.done():
            return
        if isinstance(msg, ExpertResult):
            self.pads = msg.others
            self.batch_s = msg.batch_s
            self.own_s = max(took - msg.batch_s, 0.0)
            fut.set_result(msg.y)
        elif isinstance(msg, ExpertError):
            fut.set_exception(ExpertCallError(msg.message))

    async def control_loop(self) -> None:
        """Reads the control channel; the answers to this AW's probes refresh `last_heard` and `held`."""
        try:
            while True:
                msg = await self.control.recv()
                sent = self.pinged_at.pop(msg.nonce, None) if isinstance(msg, Pong) else None
                if not isinstance(msg, Pong) or sent is None:  # a nudge (`bound_elsewhere`)
                    continue
                self.last_heard = now = time.monotonic()
                self.held = msg.held
                self.busy_since = now - msg.busy_s if msg.busy_s > 0 else None
                self.rtt = now - sent if not self.rtt else 0.875 * self.rtt + 0.125 * (now - sent)
                self.pinged_at = {n: t for n, t in self.pinged_at.items() if n > msg.nonce}
        except (PeerDeadError, ProtocolError) as exc:
            self.fail(exc)

    def check(self, now: float, interval: float, misses: int, deadline: float, nonce: int) -> FabricError | None:
        """One look at a link with calls outstanding; the watcher calls it every tick.

        Returns why this AW cannot use the EW now, or None. Before returning None it pings the EW if
        it has been silent too long. A returned error is a suspicion: the link is routed around and
        tried again (ew_links.py).

        Probes. After `interval` of silence, it pings on the control channel. The EW fails after
        `misses` probes without an answer. That is a hung process, whose connections stay open, so
        only probes can tell. "Without an answer" also means silent for longer than 10x the link's
        smoothed probe round trip, as TCP's retransmission timeout scales with the measured RTT. On
        a loaded host (two busy loops that share their cores with compute), a healthy EW's answer
        can take tens of ms.

        Stall. The EW fails when there is no result for `deadline` (the send deadline) although it
        answers probes, and its last answer says two things. It holds none of this AW's calls. Its
        batch under way, if any, began after they went out. Then its data path lost them, e.g. a
        port that drops packets or a reader that stopped reading. An EW that holds them is slow, not
        stuck (a batch can take seconds). So is one whose batch began before they could be read,
        while they wait in its socket. It is waited for while it answers. Its watchdog ends it if its
        loop stays blocked. And so is a result that is arriving: an answer can overtake it, as the two
        travel on different connections."""
        if now - self.last_data <= deadline:
            self.unread = 0  # (each wait past the deadline looks at its own bytes)
        elif not self._held() and not self._arriving():
            return PeerStalledError(self.addr.worker_id, f"no expert result for {(now - self.last_data) * 1e3:.0f} ms "
                                                         "with calls outstanding")
        silent = now - self.last_heard
        if interval <= 0 or silent < max(interval, self.rtt):  # not due before a usual answer
            self.probes = 0
            return None
        if self.probes >= misses and silent > max(interval * (misses + 1), 10 * self.rtt):
            return PeerSilentError(self.addr.worker_id, f"no answer to {self.probes} probes in {silent * 1e3:.0f} ms")
        try:
            self.control.send_nowait(Ping(nonce))
        except PeerDeadError as exc:
            return exc
        self.pinged_at[nonce] = now
        self.probes += 1
        return None

    def _held(self) -> bool:
        """Whether the EW's last answer says it has this AW's outstanding calls, or may have them unread.

        Its count includes calls that wait unread on its data connection, where the transport can tell
        (tcp). Failing that, they may be unread if its batch under way began before the oldest went
        out, plus a round trip."""
        if self.held:
            return True
        return self.busy_since is not None and bool(self.sent_at) and \
            self.busy_since <= min(self.sent_at.values()) + self.rtt

    def _arriving(self) -> bool:
        """Whether a message is arriving on the data channel: bytes wait unread, and not as many as at the last look.

        Bytes that stopped moving are no result: a path cut part-way through one."""
        n = self.data.unread()
        moved, self.unread = n > 0 and n != self.unread, n
        return moved

    def fail(self, error: FabricError) -> None:
        """Marks the link dead and fails every call waiting on it; those calls are then replayed.

        The engine hears of it at once. The EW is no longer routed to, whether calls were out or not."""
        was_dead, self.dead = self.dead, True
        if not was_dead and not self.closing and self.on_dead is not None:
            self.on_dead(self, error)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()
        self.sent_at.clear()

    async def close(self) -> None:
        self.closing = True
        for t in self.tasks:
            t.cancel()
        await self.control.close()
        await self.data.close()
