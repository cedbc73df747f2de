"""The gateway's connections to AWs and the choice of AW for each request.

Each new request goes to the AW with the least outstanding work (prompt tokens still to prefill
plus tokens still to decode, FailSafe §3.1), counted here from what this gateway sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import PeerDeadError, ProtocolError
from fabric.messages.client import Abort, RequestFailed, StepOutput, Submit
from fabric.messages.expert import Ping, Pong
from fabric.transport.base import Connection, Transport

log = logging.getLogger(__name__)


MIN_SILENCE = 0.25  # seconds: the least silence that can declare an AW hung


@dataclass
class Event:
    """One item of a request's stream: a token (with finish reason when it is the last) or an error."""

    token: int | None = None
    finish_reason: str | None = None
    logprob: float | None = None
    top: list[list[float]] | None = None
    error: str | None = None
    status: int = 0
    retryable: bool = False  # the AW was lost: the request can resume on another AW


@dataclass
class Pending:
    submit: Submit
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    work: int = 0


class AwClient:
    def __init__(self, worker_id: str, conn: Connection) -> None:
        self.worker_id = worker_id
        self.conn = conn
        self.requests: dict[str, Pending] = {}
        self.reader: asyncio.Task[None] | None = None
        self.prober: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()
        self.gap = 0.0  # smoothed time between messages while requests are in flight (EWMA)
        self.dead_reason: str | None = None

    def _heard(self) -> None:
        now = time.monotonic()
        if self.requests:
            g = now - self.last_heard
            self.gap = g if not self.gap else 0.875 * self.gap + 0.125 * g
        self.last_heard = now

    async def probe_loop(self, interval: float, misses: int, on_dead: Callable[[AwClient, str], None]) -> None:
        """A hung AW (SIGSTOP) keeps its connection open: while requests are in flight and the link
        has been silent for `interval`, ping; after `misses` unanswered probes and a silence over 5x
        the usual gap between its messages and over `MIN_SILENCE` (a busy AW answers between
        layers, but its first step warms torch up, and on a loaded host it may not be scheduled for
        a while), the AW is declared dead and its requests resume elsewhere. A false verdict
        costs a re-prefill of its requests, not tokens."""
        sent = 0
        nonce = itertools.count(1)
        while not self.conn.closed:
            await asyncio.sleep(interval)
            silent = time.monotonic() - self.last_heard
            if not self.requests or silent < interval:
                sent = 0
                continue
            if sent >= misses and silent > max(interval * (misses + 1), 5 * self.gap, MIN_SILENCE):
                self.dead_reason = f"no answer to {sent} probes in {silent * 1e3:.0f} ms"
                log.warning("%s is hung: %s", self.worker_id, self.dead_reason)
                on_dead(self, self.dead_reason)
                await self.conn.close()
                return
            try:
                await self.conn.send(Ping(next(nonce)))
            except PeerDeadError:
                return
            sent += 1

    @property
    def outstanding_work(self) -> int:
        return sum(p.work for p in self.requests.values())

    async def read_loop(self) -> None:
        reason = "attention worker connection lost"
        try:
            while True:
                msg = await self.conn.recv()
                self._heard()
                if isinstance(msg, Pong):
                    continue
                if isinstance(msg, StepOutput):
                    for rid, token, finish, logprob, top in msg.outputs:
                        p = self.requests.get(rid)
                        if p is None:
                            continue
                        p.work = max(0, p.work - 1)
                        if finish is not None:
                            del self.requests[rid]
                        p.queue.put_nowait(Event(token=token, finish_reason=finish, logprob=logprob, top=top))
                elif isinstance(msg, RequestFailed):
                    p = self.requests.pop(msg.request_id, None)
                    if p is not None:
                        p.queue.put_nowait(Event(error=msg.message, status=msg.status))
        except (PeerDeadError, ProtocolError) as exc:
            reason = f"attention worker {self.worker_id} lost: {self.dead_reason or exc}"
        finally:
            for p in self.requests.values():
                p.queue.put_nowait(Event(error=reason, status=503, retryable=True))
            self.requests.clear()


class AwPool:
    def __init__(self, transport: Transport, routing: str = "least-work", probe_interval: float = 0.01,
                 probe_misses: int = 3, on_dead: Callable[[str, str], None] | None = None) -> None:
        if routing not in ("least-work", "round-robin"):
            raise ValueError(f"unknown routing policy {routing!r}")
        self.transport = transport
        self.routing = routing
        self.probe_interval = probe_interval  # 0: no probes
        self.probe_misses = probe_misses
        self.on_dead = on_dead  # (AW id, reason): tells the orchestrator
        self.clients: dict[str, AwClient] = {}
        self.dead: set[str] = set()  # AWs this gateway found hung: never used again
        # How a dead AW's requests resume elsewhere: "restore" (from the checkpoint store, replay
        # if it has nothing), "parallel" (replay: re-prefill prompt + emitted tokens) or
        # "sequential" (replay, one emitted token per step; a baseline).
        self.resume = "restore"
        self._turn = 0

    def _hung(self, client: AwClient, reason: str) -> None:
        self.dead.add(client.worker_id)
        if self.on_dead is not None:
            self.on_dead(client.worker_id, reason)

    @property
    def ready(self) -> bool:
        return bool(self.clients)

    async def update(self, workers: list[dict[str, Any]]) -> None:
        alive = {w["id"]: w for w in workers
                 if w.get("role") == "attention" and w.get("state") == "alive" and w["id"] not in self.dead}
        for wid, w in alive.items():
            old = self.clients.get(wid)
            if old is not None and not old.conn.closed:
                continue
            if old is not None:  # closed by our probes, then vouched for by the orchestrator
                if old.prober is not None:
                    old.prober.cancel()
                del self.clients[wid]
            try:
                conn = await self.transport.connect(w["host"], int(w["port"]))
            except PeerDeadError as exc:
                log.error("cannot reach %s: %s", wid, exc)
                continue
            client = AwClient(wid, conn)
            client.reader = asyncio.create_task(client.read_loop())
            if self.probe_interval > 0:
                client.prober = asyncio.create_task(client.probe_loop(self.probe_interval, self.probe_misses, self._hung))
            self.clients[wid] = client
            log.info("connected to %s at %s:%s", wid, w["host"], w["port"])
        for wid in [w for w in self.clients if w not in alive]:
            client = self.clients.pop(wid)
            if client.prober is not None:
                client.prober.cancel()
            await client.conn.close()

    def pick(self) -> AwClient:
        live = [c for c in self.clients.values() if not c.conn.closed]
        if not live:
            raise PeerDeadError("attention workers", "none available")
        if self.routing == "round-robin":
            self._turn += 1
            return live[self._turn % len(live)]
        return min(live, key=lambda c: (c.outstanding_work, len(c.requests)))

    async def submit(self, submit: Submit) -> tuple[AwClient, Pending]:
        client = self.pick()
        pending = Pending(submit, work=len(submit.prompt_ids) + submit.max_tokens)
        if not client.requests:
            client.last_heard = time.monotonic()  # an idle link is not a silent one: count from now
        client.requests[submit.request_id] = pending
        try:
            await client.conn.send(submit)
        except PeerDeadError:
            client.requests.pop(submit.request_id, None)
            raise
        return client, pending

    async def abort(self, client: AwClient, request_id: str) -> None:
        if client.requests.pop(request_id, None) is not None:
            try:
                await client.conn.send(Abort(request_id))
            except PeerDeadError:
                pass

    async def close(self) -> None:
        for c in self.clients.values():
            for task in (c.reader, c.prober):
                if task is not None:
                    task.cancel()
            await c.conn.close()
