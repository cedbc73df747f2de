"""One AW as a gateway sees it (`AwClient`).

It holds the AW's connection, the requests in flight there and the queues their tokens go to, and
its reported load. It also tells whether the AW is hung, that is, gives no answer to probes for
longer than its messages usually take. Probes go to the AW's control port, a second connection
answered by its control plane. So a step that takes seconds is not silence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fabric.errors import PeerDeadError, ProtocolError, connection_ended
from fabric.messages.client import Attached, PromptLogprobs, PromptScores, RequestFailed, StepOutput, Submit, TokenOut
from fabric.messages.liveness import Ping, Pong
from fabric.transport.base import Connection

# The least silence, in seconds, that can declare an AW hung. A 300 ms GC pause cannot.
MIN_SILENCE = 0.5
# The least silence is raised, up to this, for an AW the orchestrator vouched for after such a
# verdict (`AwPool.vouched`).
MAX_SILENCE = 4.0
# Seconds an AW's load report counts once this gateway has nothing there.
REPORT_TTL = 1.0


@dataclass
class Event:
    """One item of a request's stream, a token or an error.

    The last token carries the finish reason.
    """

    token: int | None = None
    finish_reason: str | None = None
    logprob: float | None = None
    top: list[list[float]] | None = None
    error: str | None = None
    status: int = 0
    # The AW was lost, so the request can resume on another AW.
    retryable: bool = False
    # The AW was lost because its connection ended (a process that exited), not by a verdict of silence.
    death: bool = False
    prompt: PromptScores | None = None  # with the first token, if the request scores its prompt


def token_event(row: TokenOut) -> Event:
    return Event(token=row.token, finish_reason=row.finish, logprob=row.logprob, top=row.top)


@dataclass
class Pending:
    submit: Submit
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    work: int = 0
    attach: asyncio.Future[Attached] | None = None  # an Attach waiting for its answer
    prompt: PromptScores | None = None  # arrived ahead of the first token, which takes it along


class AwClient:
    def __init__(self, worker_id: str, conn: Connection, probe: Connection | None = None) -> None:
        self.worker_id = worker_id
        self.conn = conn
        self.probe = probe or conn  # where pings go: the AW's control port
        self.requests: dict[str, Pending] = {}
        self.reader: asyncio.Task[None] | None = None
        self.prober: asyncio.Task[None] | None = None
        self.probes = 0  # pings sent since it was last heard
        self.last_heard = time.monotonic()
        # Smoothed time between messages while requests are in flight (EWMA).
        self.gap = 0.0
        self.dead_reason: str | None = None
        # The suspect request in flight here, until it produces a token.
        self.suspect: str | None = None
        # The AW's outstanding work, of all gateways, at its last step output.
        self.reported_load = 0
        self.reported_at = 0.0
        self.submitted_since = 0  # work this gateway submitted since that report
        # The least silence that finds it hung. `AwPool.vouched` raises it.
        self.min_silence = MIN_SILENCE

    def _heard(self) -> None:
        now = time.monotonic()
        if self.requests:
            g = now - self.last_heard
            self.gap = g if not self.gap else 0.875 * self.gap + 0.125 * g
        self.last_heard = now

    def check(self, now: float, interval: float, misses: int, nonce: int) -> str | None:
        """One look at an AW with requests in flight; the pool's watcher calls it every tick.

        Returns why the AW is hung, or None. Before returning None, it pings the AW if it has been
        silent too long.

        A hung AW (SIGSTOP) keeps its connection open. So it is pinged while requests are in flight
        and the link has been silent for `interval` and for the usual gap between its messages. It is
        declared dead, and its requests resume elsewhere, after `misses` unanswered probes and a
        silence over 5x that usual gap and over `min_silence`. A busy AW answers between layers. But
        its first step warms torch up, and on a loaded host it may not be scheduled for a while.

        A false verdict costs a re-prefill of its requests, not tokens. A resume that lands on the
        slow AW again takes over its own run there. The verdict also raises this AW's `min_silence`.
        """
        silent = now - self.last_heard
        # An AW is silent for a whole step between its outputs. No probe is due before that.
        if silent < max(interval, self.gap):
            self.probes = 0
            return None
        if self.probes >= misses and silent > max(interval * (misses + 1), 5 * self.gap, self.min_silence):
            return f"no answer to {self.probes} probes in {silent * 1e3:.0f} ms"
        try:
            self.probe.send_nowait(Ping(nonce))
        except PeerDeadError:
            return None  # (its reader finds the connection gone)
        self.probes += 1
        return None

    async def close(self) -> None:
        if self.prober is not None:
            self.prober.cancel()
        await self.conn.close()
        if self.probe is not self.conn:
            await self.probe.close()

    @property
    def outstanding_work(self) -> int:
        """This AW's outstanding work as far as this gateway knows.

        It is the larger of two: the work of this gateway's own requests, or the AW's last report
        plus what this gateway sent since.
        """
        own = sum(p.work for p in self.requests.values())
        if not self.requests and time.monotonic() - self.reported_at > REPORT_TTL:
            return own  # nothing of ours there for a while: that report is stale
        return max(own, self.reported_load + self.submitted_since)

    async def probe_loop(self) -> None:
        """Reads the control port's answers.

        The control port's end is not news, unlike the data connection's. Once it ends, probes go on
        the data connection, which the AW answers too.
        """
        try:
            while True:
                if isinstance(await self.probe.recv(), Pong):
                    self._heard()
        except (PeerDeadError, ProtocolError):
            pass
        finally:
            self.probe = self.conn

    async def read_loop(self, on_lost: Callable[[AwClient, str, bool], None]) -> None:
        reason = "attention worker connection lost"
        death = False
        try:
            while True:
                msg = await self.conn.recv()
                self._heard()
                if isinstance(msg, Pong):
                    continue
                if isinstance(msg, StepOutput):
                    self.reported_load, self.submitted_since, self.reported_at = msg.load, 0, time.monotonic()
                    for row in msg.outputs:
                        p = self.requests.get(row.request_id)
                        # A resume's Attach not yet answered: the AW sent this row before the Attach reached it,
                        # to the stream being resumed, and the answer carries it with the rest.
                        if p is not None and (p.attach is None or p.attach.done()):
                            self._deliver(row.request_id, p, row)
                elif isinstance(msg, PromptLogprobs):
                    p = self.requests.get(msg.request_id)
                    if p is not None:
                        p.prompt = msg.scores
                elif isinstance(msg, Attached):
                    self._attached(msg)
                elif isinstance(msg, RequestFailed):
                    p = self.requests.pop(msg.request_id, None)
                    if p is not None:
                        p.queue.put_nowait(Event(error=msg.message, status=msg.status, retryable=msg.retryable))
        except (PeerDeadError, ProtocolError) as exc:
            reason = f"attention worker {self.worker_id} lost: {self.dead_reason or exc}"
            # `death`: its connection ended, meaning the process exited. The query-of-death rule counts it.
            # It is not this gateway's verdict on a hung AW's silence, nor a peer that stopped taking data.
            death = self.dead_reason is None and connection_ended(exc)
            if self.dead_reason is None:  # a hung one was reported by the pool's watcher
                on_lost(self, str(exc), death)
        finally:
            for p in self.requests.values():
                if p.attach is not None and not p.attach.done():
                    p.attach.set_result(Attached(p.submit.request_id, False, []))
                p.queue.put_nowait(Event(error=reason, status=503, retryable=True, death=death))
            self.requests.clear()

    def _deliver(self, rid: str, p: Pending, row: TokenOut) -> None:
        p.work = max(0, p.work - 1)
        if row.finish is not None:
            del self.requests[rid]
        ev = token_event(row)
        ev.prompt, p.prompt = p.prompt, None
        p.queue.put_nowait(ev)

    def _attached(self, msg: Attached) -> None:
        p = self.requests.get(msg.request_id)
        if p is None or p.attach is None or p.attach.done():
            return
        if not msg.found:
            del self.requests[msg.request_id]
        p.attach.set_result(msg)
        p.prompt = msg.prompt
        for row in msg.outputs:  # everything so far, then StepOutputs as usual
            self._deliver(msg.request_id, p, row)
