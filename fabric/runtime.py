"""The one lifecycle every worker role shares (AW, EW, checkpoint store, gateway): start, register,
follow the orchestrator, report, reconnect, shut down. A role plugs a `Service` into `Runtime`.

Two loops (fabric/control_plane.py): the data plane's, which runs the service (and its compute,
inline), and the control plane's, in a thread of its own, which runs the orchestrator link, the
control port (fabric/control_port.py) and the steps' watchdog. Nothing the control loop does waits
on compute, so a worker whose step takes seconds is not taken for a dead one.

    start        service.start() (data loop): listeners up, what needs no orchestrator done; the
                 port to advertise; then the control port (control loop)
    register     ControlLink (control loop): the websocket, (re)registration with this worker's id,
                 generation and view; a Heartbeat every `Registered.heartbeat_ms` (its lease)
    follow       one dispatcher (data loop) hands control messages to service.handle() in order;
                 RoutingUpdate also becomes `runtime.view`, which the next registration reports back
    report       WorkerStats every second; PeerFailed through `report_dead`, re-sent after every
                 registration for peers still suspected (a new orchestrator heard nothing)
    watch        the data plane's loop blocked past `--step-timeout-s` (a step that never ends: a wedged
                 device, a bug): the process exits, which its peers see at once (the control loop
                 answers for it otherwise)
    reconnect    the link drops -> the service keeps serving; the link reconnects on its own
    shut down    stop (SIGINT/SIGTERM, Drain, a failed main loop, or Fenced) -> Leaving to the orchestrator,
                 service.close(), the control port and the link closed; idempotent and in this order

A main loop runs under `runtime.spawn`, so an unexpected exception is logged with its traceback
and stops the process (exit code 1) instead of dying silently.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Coroutine
from typing import Any, ClassVar

from fabric import view_delta
from fabric.auth import check_bind
from fabric.config import RoleConfig
from fabric.control_link import ControlLink, Registration
from fabric.control_plane import ControlPlane
from fabric.control_port import ControlPort
from fabric.errors import ConfigError, PeerDeadError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.control import (
    ClusterView,
    Drain,
    Leaving,
    PeerFailed,
    Register,
    Role,
    RoutingUpdate,
    Traits,
    ViewDelta,
    ViewRequest,
    WorkerStats,
)
from fabric.notify import notifier
from fabric.process import fatal_on_error, mark_failed
from fabric.transport import make_transport, resolve_transport_name
from fabric.transport.base import Transport

log = logging.getLogger(__name__)

STATS_INTERVAL = 1.0
STATS_REFRESH = 30.0  # seconds: unchanged stats are sent again this often
TURN_INTERVAL = 0.25  # seconds: how often the data plane's loop marks that it turns (the watchdog's)
EPOCHS_KEPT = 16


NODE_ENV = "MOE_FABRIC_NODE"


def node_name() -> str:
    """The failure domain this process runs in: $MOE_FABRIC_NODE, else the host's name. Placement
    puts the copies of an expert on different nodes where it can."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


class Service(abc.ABC):
    """A role as the runtime sees it."""

    role: ClassVar[Role]

    @abc.abstractmethod
    async def start(self, runtime: Runtime) -> int:
        """Binds listeners and does what needs no orchestrator; returns the port to advertise."""

    def registration(self) -> dict[str, Any]:
        """Role-specific fields of `Register` (slot, experts, ready, info)."""
        return {}

    async def registered(self) -> None:  # noqa: B027 - optional hook
        """After every (re)registration (the worker id is known from the first one on)."""

    @abc.abstractmethod
    async def handle(self, msg: Message) -> None:
        """One control message from the orchestrator (RoutingUpdate, AssignExperts, PeerAlive)."""

    def stats(self) -> WorkerStats | None:
        """This worker's load: the figures decisions read, and a report for /cluster (None: none)."""
        return None

    def control_message(self, peer: str, msg: Message | None) -> None:
        """(control loop) What a peer sent on this worker's control port besides probes: its
        `Hello` first (raise ProtocolError to refuse it), None once its connection ended."""
        if msg is not None and msg.kind != "hello":
            raise ProtocolError(f"unexpected {msg.kind} on the control port")

    def busy_for(self) -> float:
        """(any thread) How long the compute call under way has run (0: none): the watchdog's log."""
        return 0.0

    def load(self, peer: str) -> tuple[float, int]:
        """(control loop) What a `Pong` to `peer` says: how long the compute call under way has run,
        and how many of `peer`'s calls this worker holds (an EW's; read from the data plane's
        state: a snapshot)."""
        return self.busy_for(), 0

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops serving: listeners and links closed, in the role's order. Called once."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Killed (a simulation's SIGKILL): every listener and connection cut at once."""


class Runtime:
    def __init__(self, cfg: RoleConfig, service: Service, separate: bool = True) -> None:
        self.cfg = cfg
        self.service = service
        self.stop = asyncio.Event()
        self.view: ClusterView | None = None  # the newest view received (reported back when registering)
        self.port = 0
        self.control_port_number = 0
        self.secret = cfg.secret
        tls = cfg.tls
        # (`separate`: the control plane in a thread of its own; many simulated workers share a loop)
        self.control = ControlPlane(separate)
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()  # the orchestrator's messages, on the data loop
        self.link = ControlLink(lambda: cfg.orchestrator_addr, self._register, self._deliver, self.secret,
                                tls.client if tls is not None else None)
        # Peers dial it to probe this worker: TCP whatever the data transport (fabric/control_port.py)
        self.control_transport = self.tcp_transport()
        self.control_port = ControlPort(self.control_transport, service.control_message, service.load)
        self.suspects: dict[str, PeerFailed] = {}  # this worker's reports (re-sent to a new orchestrator)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = False
        self.crashed = False  # killed (fabric/sim_host.py): leaves without a word, as on SIGKILL
        self.epochs_seen: dict[int, float] = {}  # routing-table epoch -> when its view arrived (wall clock)
        self.turned = time.monotonic()  # when the data plane's loop last turned (the watchdog's)

    def tcp_transport(self) -> Transport:
        """A TCP transport with this worker's secret, TLS and send deadline: the control port's (on
        the control loop), or one for a service's control channels to its peers' control ports (on
        the data loop: a transport and its connections belong to one loop)."""
        return make_transport("tcp", send_timeout=self.cfg.send_timeout_ms / 1000, secret=self.cfg.secret,
                              tls=self.cfg.tls)

    @property
    def worker_id(self) -> str:
        return self.link.worker_id

    def _register(self) -> Register:
        """(control loop) `service.registration()` reads the data plane's state from this thread:
        a snapshot, taken under the GIL."""
        fields = self.service.registration()
        fields.setdefault("traits", Traits()).node = node_name()
        cfg = self.cfg
        return Register(self.service.role, os.getpid(), cfg.host, cfg.advertise_port or self.port, self.link.worker_id,
                        self.link.generation, self.view,
                        control_port=cfg.advertise_control_port or self.control_port_number, **fields)

    def _deliver(self, msg: Message) -> None:
        """(control loop) A message from the orchestrator, for the dispatcher on the data loop."""
        self.control.to_main(self.inbox.put_nowait, msg)

    def spawn(self, coro: Coroutine[Any, Any, None], main_loop: bool = False) -> asyncio.Task[None]:
        """A task referenced until done; a main loop's unexpected exception stops the process."""
        task = asyncio.create_task(fatal_on_error(coro, self.stop) if main_loop else coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def crash(self) -> None:
        """Dies as on SIGKILL: sockets closed, no `Leaving` (a simulation's fault injection)."""
        self.crashed = True
        self.stop.set()
        self.service.abort()
        self.control_port.abort()
        self.link.abort()

    async def drop_peer(self, peer: str) -> None:
        """Closes `peer`'s connection to this worker's control port (it was declared dead)."""
        await self.control.run(self.control_port.drop(peer))

    def ready(self) -> None:
        """The worker serves: tell the supervisor (once)."""
        if not self._ready:
            self._ready = True
            notifier().send("READY=1")

    def report_dead(self, peer: str, reason: str, closed: bool = False) -> None:
        """Tells the orchestrator (whose verdict is authoritative) that this worker cannot reach a
        peer (`closed`: its connection ended, not a silence); without an orchestrator now, the next
        one hears it after this worker registers with it."""
        self.suspects[peer] = msg = PeerFailed(peer, reason, closed)
        self.spawn(self._send_quietly(msg))

    def cleared(self, peer: str) -> None:
        """The orchestrator vouched for `peer` (PeerAlive)."""
        self.suspects.pop(peer, None)

    async def send(self, msg: Message) -> None:
        """To the orchestrator (over the control loop); PeerDeadError when none is connected."""
        await self.control.run(self.link.send(msg))

    async def _send_quietly(self, msg: Message) -> None:
        with contextlib.suppress(PeerDeadError):
            await self.send(msg)

    async def _dispatch(self) -> None:
        while True:
            msg = await self.inbox.get()
            if isinstance(msg, Registration):
                for report in list(self.suspects.values()):
                    await self._send_quietly(report)
                await self.service.registered()
                continue
            if isinstance(msg, Drain):
                log.info("%s: drained by the orchestrator (%s); leaving", self.worker_id, msg.reason)
                self.stop.set()
                continue
            if isinstance(msg, ViewDelta):
                try:
                    view = view_delta.apply(self.view, msg)
                except ProtocolError as exc:  # (an inconsistent result: as good as the wrong base)
                    log.warning("a view delta did not apply (%s); asking for the whole view", exc)
                    view = None
                if view is None:  # not the view it was made from (say, one sent before a reconnection)
                    await self._send_quietly(ViewRequest())
                    continue
                msg = RoutingUpdate(view)
            if isinstance(msg, RoutingUpdate):
                if self.view is not None and msg.view.version < self.view.version:
                    continue  # a stale orchestrator's (the link never follows one; kept for safety)
                self.view = msg.view
                for peer in msg.view.dead:  # (ruled on: a new orchestrator needs no report of it)
                    self.suspects.pop(peer, None)
                epoch = msg.view.table.epoch if msg.view.table else 0
                if epoch not in self.epochs_seen:
                    self.epochs_seen[epoch] = time.time()
                    while len(self.epochs_seen) > EPOCHS_KEPT:
                        del self.epochs_seen[next(iter(self.epochs_seen))]
            await self.service.handle(msg)

    async def _report(self) -> None:
        """Stats every second while they change, else every `STATS_REFRESH` (an idle cluster of
        hundreds of workers stays quiet); after every registration at once."""
        last: WorkerStats | None = None
        last_at = 0.0
        registrations = 0
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            try:
                stats = self.service.stats()
            except Exception:  # a report missed, not the reporting stopped
                log.exception("collecting this worker's stats failed")
                continue
            now = time.monotonic()
            if stats is None or not self.link.connected.is_set():
                continue
            if stats == last and now - last_at < STATS_REFRESH and registrations == self.link.registrations:
                continue
            last, last_at, registrations = stats, now, self.link.registrations
            await self._send_quietly(stats)

    async def _watch_link(self, link_task: asyncio.Future[None]) -> None:
        await asyncio.wait([link_task])
        if self.link.fenced is not None and not self.stop.is_set():
            # Expected after a hang (SIGSTOP, a stall): the fabric has replaced this worker meanwhile.
            log.warning("%s: the orchestrator declared this worker dead (%s); leaving", self.worker_id or "this worker",
                        self.link.fenced)
            mark_failed()
            self.stop.set()

    async def _turn(self) -> None:
        """(data loop) Marks that this loop turns: compute runs inline, so a step that never ends,
        or anything else that blocks the loop, stops the marks."""
        while True:
            self.turned = time.monotonic()
            await asyncio.sleep(TURN_INTERVAL)

    async def _watchdog(self, timeout: float) -> None:
        """(control loop) A data plane's loop that has not turned for `timeout` (a compute call,
        or anything else, blocking it) is a wedged device or a bug, not slowness: the process
        exits, as NCCL's watchdog ends one, and its peers see it at once (this loop would answer
        their probes for it for ever)."""
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            stuck = time.monotonic() - self.turned
            if stuck > timeout:
                busy = self.service.busy_for()
                log.error("%s: the data plane's loop has not turned for %.1f s (--step-timeout-s %g; %s): the device "
                          "or a kernel is wedged, or a bug blocks it; exiting, so that the fabric takes over this "
                          "worker's work", self.worker_id or "this worker", stuck, timeout,
                          f"a compute call under way for {busy:.1f} s" if busy else "no compute call under way")
                logging.shutdown()
                os._exit(1)

    async def serve(self, stop: asyncio.Event) -> None:
        self.stop = stop
        check_bind(self.cfg.host, self.secret, f"this {self.service.role.value}")
        if self.secret is None and self.service.role is not Role.GATEWAY \
                and resolve_transport_name(self.cfg.transport) == "ucx":
            # ucxx's listener binds every interface whatever the host (fabric/transport/ucx.py)
            raise ConfigError("the ucx transport listens on every interface: it needs a cluster secret "
                              "(--cluster-secret-file); or use --transport tcp")
        self.control.start()
        try:
            self.port = await self.service.start(self)
            self.control_port_number = await self.control.run(self.control_port.listen(self.cfg.host,
                                                                                       self.cfg.control_port))
        except BaseException:  # (a start that failed half-way: what it opened is closed, the thread joined)
            with contextlib.suppress(Exception):
                await self.service.close()
            self.control.stop()
            raise
        link_task = asyncio.wrap_future(self.control.submit(self.link.run()))
        step_timeout = float(getattr(self.cfg, "step_timeout_s", 0.0))
        self.turned = time.monotonic()
        self.spawn(self._turn())
        watch = self.control.submit(self._watchdog(step_timeout)) if step_timeout > 0 and self.control.separate \
            else None
        self.spawn(self._watch_link(link_task))
        self.spawn(self._dispatch(), main_loop=True)
        self.spawn(self._report())
        try:
            await stop.wait()
        finally:
            self.link.leaving = True
            if self.link.connected.is_set() and not self.crashed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._send_quietly(Leaving("shutting down")), 1.0)
            for task in list(self._tasks):
                task.cancel()
            if self.crashed:  # every socket of a killed process goes at once: the orchestrator's too
                link_task.cancel()
            await self.service.close()
            await self.control.run(self.control_port.close())
            link_task.cancel()
            if watch is not None:
                watch.cancel()
            await asyncio.gather(link_task, *self._tasks, return_exceptions=True)
            self.control.stop()
