"""The gateway's connections to AWs and the choice of AW for each request.

Each new request goes to the AW with the least outstanding work. That is prompt tokens still to
prefill plus tokens still to decode (FailSafe §3.1). Several gateways share the AWs, so no gateway's
own count is the AW's. Each AW reports its whole outstanding work with every step output. A gateway
adds what it submitted since that report.

Suspects (see gateway/generation.py): a request whose AW died before it produced a token may be
what killed it. At most one suspect per AW is in flight from this gateway, until it produces a
token. So if the AW dies again, the suspect that was on it is the one that gets the blame.

Reachability is this gateway's own. An AW it finds hung (silent past its floor), or whose
connection ends, is routed around, and its requests resume elsewhere. A hung one is told so with
`Abort(moved)`, for when it wakes. The AW is tried again in the background (`_relink`: connect,
then a ping answered), with a pause that doubles from 50 ms to 1 s. Only the orchestrator's
verdict (the view's dead) retires an AW for good.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fabric.errors import PeerDeadError, ProtocolError
from fabric.messages.client import Abort, Attach, Attached, Detach, Submit
from fabric.messages.control import WorkerInfo
from fabric.messages.liveness import Hello, Ping, Pong
from fabric.relink import CONNECT_TIMEOUT, reach_again
from fabric.ticks import Ticks
from fabric.transport.base import Connection, Transport
from gateway.aw_client import MAX_SILENCE, MIN_SILENCE, AwClient, Pending

log = logging.getLogger(__name__)


ATTACH_TIMEOUT = 2.0  # seconds an AW has to answer an Attach


class AwPool:
    def __init__(self, transport: Transport, routing: str = "least-work", probe_interval: float = 0.01,
                 probe_misses: int = 3, on_dead: Callable[[str, str, bool], None] | None = None,
                 control_transport: Transport | None = None, my_id: Callable[[], str] = lambda: "gateway") -> None:
        if routing not in ("least-work", "round-robin"):
            raise ValueError(f"unknown routing policy {routing!r}")
        self.transport = transport
        # To AWs' control ports. None means probes go on the data connection.
        self.control_transport = control_transport
        self.my_id = my_id  # this gateway's worker id (its control channels say it)
        self.routing = routing
        self.probe_interval = probe_interval  # 0: no probes
        self.probe_misses = probe_misses
        self.on_dead = on_dead  # (AW id, reason, connection ended): tells the orchestrator
        self.clients: dict[str, AwClient] = {}
        self.dead: set[str] = set()  # AWs the orchestrator declared dead: never used again
        self.known: dict[str, WorkerInfo] = {}  # the serving AWs of the newest view
        # AWs this gateway lost -> why. They are tried again in the background.
        self.unreachable: dict[str, str] = {}
        # Those of them it found hung (silent), until they answer again.
        self.hung: set[str] = set()
        self.relinks = 0
        self.min_silence: dict[str, float] = {}  # AW -> its silence floor, where false verdicts raised it
        # How a dead AW's requests resume elsewhere:
        # - "restore": from the checkpoint store, or by replay if it has nothing.
        # - "parallel": replay, re-prefilling prompt + emitted tokens.
        # - "sequential": replay, one emitted token per step. A baseline.
        self.resume = "restore"
        self.changed = asyncio.Event()  # set whenever an AW joins or a suspect slot frees up
        self._turn = 0
        self._requests_out = asyncio.Event()  # set when an idle AW gets a request: the watcher wakes
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._retry: dict[str, asyncio.Event] = {}  # an AW's relink, woken early (the orchestrator vouched)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lost(self, client: AwClient, reason: str, closed: bool) -> None:
        """Handles an AW whose connection closed or broke.

        The orchestrator, whose verdict is authoritative, hears of it. This gateway tries to reach
        the AW again, as a live AW whose connection dropped comes back.
        """
        self._spawn(client.close())  # (its control connection too)
        if client.worker_id in self.dead or self.clients.get(client.worker_id) is not client:
            return
        self._unreachable(client.worker_id, reason, closed)

    def _hung(self, client: AwClient, reason: str) -> None:
        """Handles an AW silent past its floor, which is a suspicion.

        Its requests resume elsewhere; the read loop's end tells them. The AW hears that they moved,
        for when it wakes. It then hands their checkpoints over instead of running them on.
        """
        client.dead_reason = reason
        log.warning("%s is hung: %s; its requests resume elsewhere", client.worker_id, reason)
        for rid in list(client.requests):
            try:
                client.conn.send_nowait(Abort(rid, moved=True))
            except PeerDeadError:
                break
        self.hung.add(client.worker_id)
        self._unreachable(client.worker_id, reason)  # (not `closed`: its silence)
        self._spawn(client.close())

    def _unreachable(self, worker_id: str, reason: str, closed: bool = False) -> None:
        if worker_id in self.unreachable:
            return
        self.unreachable[worker_id] = reason
        if self.on_dead is not None:
            self.on_dead(worker_id, reason, closed)
        self._spawn(self._relink(worker_id))

    async def _relink(self, worker_id: str) -> None:
        """Tries to reach a lost AW again until it answers a ping, the orchestrator declares it
        dead, or it leaves the view (fabric/relink.py)."""

        def wanted() -> bool:
            return worker_id in self.unreachable and worker_id in self.known and worker_id not in self.dead

        ev = self._retry[worker_id] = asyncio.Event()
        try:
            conns = await reach_again(lambda: self._open(self.known[worker_id], check=True), wanted, ev, worker_id)
        finally:
            if self._retry.get(worker_id) is ev:
                del self._retry[worker_id]
        if conns is not None and wanted():
            del self.unreachable[worker_id]  # (still `hung` until the orchestrator rules: `vouched`)
            self.relinks += 1
            log.warning("%s answers again: using it again", worker_id)
            self._install(self.known[worker_id], *conns)
            return
        for c in conns or ():
            if c is not None:
                await c.close()
        self.unreachable.pop(worker_id, None)
        if worker_id in self.dead or worker_id not in self.known:
            self.hung.discard(worker_id)

    def vouched(self, worker_id: str) -> None:
        """Handles the orchestrator saying that `worker_id` answers.

        If this gateway found it hung, it was only slow (a long pause, a loaded host). It is tried
        again now. From now on it is found hung only after twice the silence that was too little, up
        to MAX_SILENCE. So a slow AW is not given up on over and over, each time resuming its
        requests elsewhere.
        """
        if worker_id in self.hung:
            self.hung.discard(worker_id)
            floor = min(MAX_SILENCE, 2 * self.min_silence.get(worker_id, MIN_SILENCE))
            self.min_silence[worker_id] = floor
            if (client := self.clients.get(worker_id)) is not None:
                client.min_silence = floor
            log.warning("%s was only slow, not hung: it is found hung after %.0f ms of silence from now on",
                        worker_id, floor * 1e3)
        if (ev := self._retry.get(worker_id)) is not None:
            ev.set()

    def _track(self, client: AwClient, request_id: str, pending: Pending) -> None:
        """Records a request in flight on `client`.

        If the client was idle, its silence counts from now.
        """
        if not client.requests:
            client.last_heard = time.monotonic()  # an idle link is not a silent one: count from now
            client.probes = 0
            self._requests_out.set()
        client.requests[request_id] = pending

    async def _watch(self) -> None:
        """The one liveness watcher of every AW this gateway talks to.

        It ticks only while some AW has requests in flight, and looks only at those
        (`AwClient.check`). So an idle gateway of hundreds of AWs costs nothing.
        """
        nonce = itertools.count(1)
        ticks = Ticks(self.probe_interval)

        # Credits this gateway's own stall, which is not the AW's silence.
        def credit(client: AwClient, late: float) -> None:
            client.last_heard += late

        while True:
            busy = await ticks.busy(lambda: [c for c in self.clients.values()
                                             if c.requests and not c.conn.closed and c.dead_reason is None],
                                    self._requests_out, credit)
            now = time.monotonic()
            for client in busy:
                if not client.requests or client.conn.closed or client.dead_reason is not None:
                    continue
                try:
                    reason = client.check(now, self.probe_interval, self.probe_misses, next(nonce))
                    if reason is not None:
                        self._hung(client, reason)
                except Exception:
                    # One AW's trouble must not stop the watching of the others.
                    log.exception("checking %s failed", client.worker_id)

    @property
    def ready(self) -> bool:
        return any(not c.conn.closed for c in self.clients.values())

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def update(self, aws: list[WorkerInfo], dead: list[str]) -> None:
        """Connects to AWs new in the view, side by side, and drops those declared dead.

        An AW the view lists as unreachable (its orchestrator link is down) stays in use. One this
        gateway lost is left to its relink.
        """
        self.dead.update(dead)
        alive = {w.id: w for w in aws if w.serving and w.id not in self.dead}
        self.known = alive
        todo = [w for wid, w in alive.items() if wid not in self.unreachable
                and (wid not in self.clients or self.clients[wid].conn.closed)]
        await asyncio.gather(*(self._connect(w) for w in todo))
        self.hung -= self.dead
        self.min_silence = {w: f for w, f in self.min_silence.items() if w in alive or w in self.unreachable}
        for wid in [w for w in self.clients if w in self.dead]:
            await self.clients.pop(wid).close()
        for wid in [w for w in self.unreachable if w in self.dead or w not in alive]:
            if (ev := self._retry.get(wid)) is not None:
                ev.set()  # (its relink sees it gone, and stops)

    async def _open(self, w: WorkerInfo, check: bool = False,
                    timeout: float = 5.0) -> tuple[Connection, Connection | None]:
        """Opens a data connection to `w` and one to its control port, for probes.

        With `check`, a ping must first be answered on the data connection. That shows the AW
        serves, not only accepts.
        """
        conns: list[Connection] = []
        try:
            conns.append(await self.transport.connect(w.host, w.port, timeout=timeout))
            if check:
                await conns[0].send(Ping(0))
                if not isinstance(await conns[0].recv(), Pong):
                    raise ProtocolError(f"{w.id}: expected a pong")
            if self.control_transport is not None and w.control_port:
                conns.append(await self.control_transport.connect(w.host, w.control_port, timeout=timeout))
                await conns[1].send(Hello(self.my_id(), "control"))
        except BaseException:
            for conn in conns:
                await conn.close()
            raise
        return conns[0], conns[1] if len(conns) > 1 else None

    async def _connect(self, w: WorkerInfo) -> None:
        self.clients.pop(w.id, None)  # (closed: gone)
        # Bounded: a hung AW's kernel still accepts, but its handshake never ends.
        try:
            conn, probe = await asyncio.wait_for(self._open(w, timeout=CONNECT_TIMEOUT), CONNECT_TIMEOUT)
        except (PeerDeadError, ProtocolError, TimeoutError) as exc:
            log.warning("cannot reach %s: %s", w.id, exc or "connect timed out")
            self._unreachable(w.id, f"connect failed: {exc or 'timed out'}")
            return
        self._install(w, conn, probe)

    def _install(self, w: WorkerInfo, conn: Connection, probe: Connection | None) -> None:
        old = self.clients.get(w.id)
        if old is not None:
            self._spawn(old.close())
        client = AwClient(w.id, conn, probe)
        client.min_silence = self.min_silence.get(w.id, MIN_SILENCE)
        client.reader = asyncio.create_task(client.read_loop(self._lost))
        if probe is not None:
            client.prober = asyncio.create_task(client.probe_loop())
        if self.probe_interval > 0 and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch())
        self.clients[w.id] = client
        log.info("connected to %s at %s:%s", w.id, w.host, w.port)
        self._changed()

    def live(self) -> list[AwClient]:
        return [c for c in self.clients.values() if not c.conn.closed and c.worker_id not in self.unreachable]

    def pick(self, suspect: bool = False) -> AwClient | None:
        """The AW for a new request, or None if none fits now.

        A suspect only goes where no other suspect from this gateway is in flight.
        """
        live = [c for c in self.live() if not suspect or c.suspect is None]
        if not live:
            return None
        if self.routing == "round-robin":
            self._turn += 1
            return live[self._turn % len(live)]
        return min(live, key=lambda c: (c.outstanding_work, len(c.requests)))

    async def submit(self, submit: Submit, wait: float = 0.0) -> tuple[AwClient, Pending]:
        """Sends `submit` to an AW, waiting up to `wait` seconds for one that fits.

        The wait serves a resumed request whose AW died, while its replacement boots. Raises
        PeerDeadError if there is none.
        """
        suspect = submit.deaths > 0
        deadline = time.monotonic() + wait
        while True:
            changed = self.changed
            client = self.pick(suspect)
            if client is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerDeadError("attention workers", "none available")
            try:
                await asyncio.wait_for(changed.wait(), min(left, 0.25))
            except TimeoutError:
                pass
        pending = Pending(submit, work=len(submit.prompt_ids) + submit.max_tokens - len(submit.output_ids))
        self._track(client, submit.request_id, pending)
        client.submitted_since += pending.work
        if suspect:
            client.suspect = submit.request_id
        try:
            await client.conn.send(submit)
        except PeerDeadError:
            client.requests.pop(submit.request_id, None)
            self.cleared(client, submit.request_id)
            raise
        return client, pending

    def cleared(self, client: AwClient, request_id: str) -> None:
        """Frees the suspect slot once `request_id` produced a token on `client` or left it."""
        if client.suspect == request_id:
            client.suspect = None
            self._changed()

    async def attach(self, submit: Submit) -> tuple[AwClient, Pending, Attached] | None:
        """Asks every AW whether it runs `submit`, a stream whose client or gateway went away.

        The first that does is bound to this gateway. Returns None if no AW has it.
        """
        asks: list[tuple[AwClient, Pending]] = []
        for client in self.live():
            p = Pending(submit, work=submit.max_tokens)
            p.attach = asyncio.get_running_loop().create_future()
            self._track(client, submit.request_id, p)
            try:
                client.conn.send_nowait(Attach(submit))
            except PeerDeadError:
                client.requests.pop(submit.request_id, None)
                continue
            asks.append((client, p))
        found: tuple[AwClient, Pending, Attached] | None = None
        for client, p in asks:
            assert p.attach is not None
            try:
                reply = await asyncio.wait_for(asyncio.shield(p.attach), ATTACH_TIMEOUT)
            except TimeoutError:
                client.requests.pop(submit.request_id, None)
                continue
            if not reply.found:
                continue
            if found is None:
                found = (client, p, reply)
            else:
                # A second copy. It is deterministic, so it has the same tokens. Keep one.
                await self.abort(client, submit.request_id, p)
        return found

    async def abort(self, client: AwClient, request_id: str, pending: Pending | None = None) -> None:
        self._let_go(client, request_id, Abort(request_id), pending)

    async def detach(self, client: AwClient, request_id: str, pending: Pending | None = None) -> None:
        """The HTTP client left a resumable stream: the AW keeps it for a resume."""
        self._let_go(client, request_id, Detach(request_id), pending)

    def _let_go(self, client: AwClient, request_id: str, msg: Abort | Detach, pending: Pending | None) -> None:
        """Lets go of `request_id` on `client`: of `pending`, the caller's, where it is given.

        A resumed stream may have attached to the same request on the same AW through this gateway before the stream
        it resumes lets go (an HTTP handler learns that its client left only when it next writes). Then the request
        is the new stream's, and the old one's Detach would cut it off (nothing would read its tokens)."""
        if pending is not None and client.requests.get(request_id) is not pending:
            return
        self.cleared(client, request_id)
        if client.requests.pop(request_id, None) is not None:
            try:
                client.conn.send_nowait(msg)
            except PeerDeadError:
                pass

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        for c in self.clients.values():
            if c.reader is not None:
                c.reader.cancel()
            await c.close()
