"""The gateway's connections to AWs and the choice of AW for each request.

Each new request goes to the AW with the least outstanding work (prompt tokens still to prefill
plus tokens still to decode, FailSafe §3.1), counted here from what this gateway sent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import PeerDeadError, ProtocolError
from fabric.messages.client import Abort, RequestFailed, StepOutput, Submit
from fabric.transport.base import Connection, Transport

log = logging.getLogger(__name__)


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

    @property
    def outstanding_work(self) -> int:
        return sum(p.work for p in self.requests.values())

    async def read_loop(self) -> None:
        reason = "attention worker connection lost"
        try:
            while True:
                msg = await self.conn.recv()
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
            reason = f"attention worker {self.worker_id} lost: {exc}"
        finally:
            for p in self.requests.values():
                p.queue.put_nowait(Event(error=reason, status=503, retryable=True))
            self.requests.clear()


class AwPool:
    def __init__(self, transport: Transport, routing: str = "least-work") -> None:
        if routing not in ("least-work", "round-robin"):
            raise ValueError(f"unknown routing policy {routing!r}")
        self.transport = transport
        self.routing = routing
        self.clients: dict[str, AwClient] = {}
        self._turn = 0

    @property
    def ready(self) -> bool:
        return bool(self.clients)

    async def update(self, workers: list[dict[str, Any]]) -> None:
        alive = {w["id"]: w for w in workers if w.get("role") == "attention" and w.get("state") == "alive"}
        for wid, w in alive.items():
            if wid in self.clients:
                continue
            try:
                conn = await self.transport.connect(w["host"], int(w["port"]))
            except PeerDeadError as exc:
                log.error("cannot reach %s: %s", wid, exc)
                continue
            client = AwClient(wid, conn)
            client.reader = asyncio.create_task(client.read_loop())
            self.clients[wid] = client
            log.info("connected to %s at %s:%s", wid, w["host"], w["port"])
        for wid in [w for w in self.clients if w not in alive]:
            client = self.clients.pop(wid)
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
            if c.reader is not None:
                c.reader.cancel()
            await c.conn.close()
