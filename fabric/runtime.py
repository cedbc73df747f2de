"""The one lifecycle every worker role shares (AW, EW, checkpoint store, gateway).

It starts, registers, follows the orchestrator, reports, reconnects and shuts down. A role plugs a `Service`
into `Runtime`.

There are two loops (fabric/control_plane.py). The data plane's runs the service, and its compute, inline. The
control plane's runs in a thread of its own. It runs the orchestrator link, the control port
(fabric/control_port.py) and the steps' watchdog. Nothing the control loop does waits on compute. So a worker
whose step takes seconds is not taken for a dead one.

    start        service.start() (data loop) brings listeners up, does what needs no orchestrator, and
                 returns the port to advertise. Then the control port starts (control loop).
    register     ControlLink (control loop) opens the websocket and (re)registers with this worker's id,
                 generation and view. It sends a Heartbeat every `Registered.heartbeat_ms`, its lease.
    follow       One dispatcher (data loop) hands control messages to service.handle() in order.
                 RoutingUpdate also becomes `runtime.view`, which the next registration reports back.
    report       WorkerStats go every second. PeerFailed goes through `report_dead`, and is re-sent after
                 every registration for peers still suspected, as a new orchestrator heard nothing.
    watch        The data plane's loop is blocked past `--step-timeout-s` by a step that never ends (a
                 wedged device, a bug). The process exits, which its peers see at once. Otherwise the
                 control loop would answer for it.
    reconnect    The link drops -> the service keeps serving; the link reconnects on its own.
    shut down    stop (SIGINT/SIGTERM, Drain, a failed main loop, or Fenced) -> Leaving to the orchestrator,
                 service.close(), then the control port and the link closed. Idempotent, and in this order.

A main loop runs under `runtime.spawn`. So an unexpected exception is logged with its traceback and stops the
process (exit code 1) instead of dying silently.
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
from fabric.local_process import identity
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
from fabric.process import fatal_on_error, freeze_heap, heap_report, mark_failed
from fabric.stalls import stall_report
from fabric.transport import make_transport, resolve_transport_name
from fabric.transport.base import Transport

log = logging.getLogger(__name__)

STATS_INTERVAL = 1.0
STATS_REFRESH = 30.0  # seconds: unchanged stats are sent again this often
# How often, in seconds, the data plane's loop marks that it turns, for the watchdog.
TURN_INTERVAL = 0.25
EPOCHS_KEPT = 16


NODE_ENV = "MOE_FABRIC_NODE"


def node_name() -> str:
    """The failure domain this process runs in: $MOE_FABRIC_NODE, else the host's name.

    Placement puts the copies of an expert on different nodes where it can."""
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
        """Called after every (re)registration. The worker id is known from the first one on."""

    @abc.abstractmethod
    async def handle(self, msg: Message) -> None:
        """One control message from the orchestrator (RoutingUpdate, AssignExperts, PeerAlive)."""

    def stats(self) -> WorkerStats | None:
        """This worker's load (the figures decisions read, and a report for /cluster), or None."""
        return None

    def control_message(self, peer: str, msg: Message | None) -> None:
        """Takes what a peer sent on this worker's control port besides probes (control loop).

        Its `Hello` comes first; raise ProtocolError to refuse it. None comes once its connection ended."""
        if msg is not None and msg.kind != "hello":
            raise ProtocolError(f"unexpected {msg.kind} on the control port")

    def busy_for(self) -> float:
        """How long the compute call under way has run, 0 if none, for the watchdog's log. Any thread."""
        return 0.0

    def load(self, peer: str) -> tuple[float, int]:
        """What a `Pong` to `peer` says (control loop).

        That is how long the compute call under way has run, and how many of `peer`'s calls this worker holds
        (an EW's). It is read from the data plane's state, as a snapshot."""
        return self.busy_for(), 0

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops serving: listeners and links closed, in the role's order. Called once."""

    def leaving(self) -> None:  # noqa: B027 - optional hook
        """The worker starts to leave, before it says so: peers that drop it from now on are no news."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Killed by a simulation's SIGKILL: cuts every listener and connection at once."""


class Runtime:
    def __init__(self, cfg: RoleConfig, service: Service, separate: bool = True) -> None:
        self.cfg = cfg
        self.service = service
        self.stop = asyncio.Event()
        # The newest view received. It is reported back when registering.
        self.view: ClusterView | None = None
        self.port = 0
        self.control_port_number = 0
        self.secret = cfg.secret
        tls = cfg.tls
        # `separate` puts the control plane in a thread of its own. Many simulated workers share a loop.
        self.control = ControlPlane(separate)
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()  # the orchestrator's messages, on the data loop
        self.link = ControlLink(lambda: cfg.orchestrator_addr, self._register, self._deliver, self.secret,
                                tls.client if tls is not None else None)
        # Peers dial it to probe this worker. It is TCP whatever the data transport (fabric/control_port.py).
        self.control_transport = self.tcp_transport()
        self.control_port = ControlPort(self.control_transport, service.control_message, service.load)
        self.suspects: dict[str, PeerFailed] = {}  # this worker's reports, re-sent to a new orchestrator
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = False
        # Killed (fabric/sim_host.py). It leaves without a word, as on SIGKILL.
        self.crashed = False
        # Routing-table epoch -> when its view arrived (wall clock).
        self.epochs_seen: dict[int, float] = {}
        self.turned = time.monotonic()  # when the data plane's loop last turned, for the watchdog

    def tcp_transport(self) -> Transport:
        """A TCP transport with this worker's secret, TLS and send deadline.

        It is the control port's (on the control loop), or one for a service's control channels to its peers'
        control ports (on the data loop). A transport and its connections belong to one loop."""
        return make_transport("tcp", send_timeout=self.cfg.send_timeout_ms / 1000, secret=self.cfg.secret,
                              tls=self.cfg.tls)

    @property
    def worker_id(self) -> str:
        return self.link.worker_id

    def _register(self) -> Register:
        """Builds the `Register` message (control loop).

        `service.registration()` reads the data plane's state from this thread, as a snapshot taken under the
        GIL."""
        fields = self.service.registration()
        fields.setdefault("traits", Traits()).node = node_name()
        cfg = self.cfg
        return Register(self.service.role, os.getpid(), cfg.host, cfg.advertise_port or self.port, self.link.worker_id,
                        self.link.generation, self.view,
                        control_port=cfg.advertise_control_port or self.control_port_number, proc=identity(), **fields)

    def _deliver(self, msg: Message) -> None:
        """Hands a message from the orchestrator to the dispatcher on the data loop (control loop)."""
        self.control.to_main(self.inbox.put_nowait, msg)

    def spawn(self, coro: Coroutine[Any, Any, None], main_loop: bool = False) -> asyncio.Task[None]:
        """A task referenced until done; a main loop's unexpected exception stops the process."""
        task = asyncio.create_task(fatal_on_error(coro, self.stop) if main_loop else coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def crash(self) -> None:
        """Dies as on SIGKILL, with sockets closed and no `Leaving`. For a simulation's fault injection."""
        self.crashed = True
        self.stop.set()
        self.service.abort()
        self.control_port.abort()
        self.link.abort()

    async def drop_peer(self, peer: str) -> None:
        """Closes `peer`'s connection to this worker's control port (it was declared dead)."""
        await self.control.run(self.control_port.drop(peer))

    def ready(self) -> None:
        """Tells the supervisor, once, that the worker serves."""
        if not self._ready:
            self._ready = True
            if self.control.separate:
                freeze_heap(collect=False)  # (what came since; a woken standby's first step waits for nothing)
            notifier().send("READY=1")

    def report_dead(self, peer: str, reason: str, closed: bool = False) -> None:
        """Tells the orchestrator, whose verdict is authoritative, that this worker cannot reach a peer.

        `closed` means its connection ended, not a silence. Without an orchestrator now, the next one hears it
        after this worker registers with it."""
        self.suspects[peer] = msg = PeerFailed(peer, reason, closed)
        self.spawn(self._send_quietly(msg))

    def cleared(self, peer: str) -> None:
        """The orchestrator vouched for `peer` (PeerAlive)."""
        self.suspects.pop(peer, None)

    async def send(self, msg: Message) -> None:
        """Sends to the orchestrator over the control loop. Raises PeerDeadError when none is connected."""
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
                except ProtocolError as exc:
                    # An inconsistent result is as good as the wrong base.
                    log.warning("a view delta did not apply (%s); asking for the whole view", exc)
                    view = None
                # Not the view it was made from, say one sent before a reconnection.
                if view is None:
                    await self._send_quietly(ViewRequest())
                    continue
                msg = RoutingUpdate(view)
            if isinstance(msg, RoutingUpdate):
                if self.view is not None and msg.view.version < self.view.version:
                    # A stale orchestrator's. The link never follows one; this is kept for safety.
                    continue
                self.view = msg.view
                # These were ruled on. A new orchestrator needs no report of them.
                for peer in msg.view.dead:
                    self.suspects.pop(peer, None)
                epoch = msg.view.table.epoch if msg.view.table else 0
                if epoch not in self.epochs_seen:
                    self.epochs_seen[epoch] = time.time()
                    while len(self.epochs_seen) > EPOCHS_KEPT:
                        del self.epochs_seen[next(iter(self.epochs_seen))]
            await self.service.handle(msg)

    async def _report(self) -> None:
        """Sends stats every second while they change, else every `STATS_REFRESH`.

        So an idle cluster of hundreds of workers stays quiet. After every registration they go at once."""
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
            stats.report.update(heap_report())
            stats.report.update(stall_report())
            if stats == last and now - last_at < STATS_REFRESH and registrations == self.link.registrations:
                continue
            last, last_at, registrations = stats, now, self.link.registrations
            await self._send_quietly(stats)

    async def _watch_link(self, link_task: asyncio.Future[None]) -> None:
        await asyncio.wait([link_task])
        if self.link.fenced is not None and not self.stop.is_set():
            # Expected after a hang (SIGSTOP, a stall). The fabric has replaced this worker meanwhile.
            log.warning("%s: the orchestrator declared this worker dead (%s); leaving", self.worker_id or "this worker",
                        self.link.fenced)
            mark_failed()
            self.stop.set()

    async def _turn(self) -> None:
        """Marks that this loop turns (data loop).

        Compute runs inline, so a step that never ends, or anything else that blocks the loop, stops the marks."""
        while True:
            self.turned = time.monotonic()
            await asyncio.sleep(TURN_INTERVAL)

    async def _watchdog(self, timeout: float) -> None:
        """Exits when the data plane's loop has not turned for `timeout` (control loop).

        A compute call, or anything else, blocking the loop that long is a wedged device or a bug, not
        slowness. The process exits, as NCCL's watchdog ends one, and its peers see it at once. Otherwise this
        loop would answer their probes for it for ever."""
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
            if self.control.separate:  # (not for simulated workers sharing a process, which come and go)
                freeze_heap(collect=False)  # loaded (a collection here would hold a replacement up 0.1-0.2 s)
        except BaseException:
            # A start that failed half-way. What it opened is closed, and the thread joined.
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
            self.service.leaving()
            if self.link.connected.is_set() and not self.crashed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._send_quietly(Leaving("shutting down")), 1.0)
            for task in list(self._tasks):
                task.cancel()
            # Every socket of a killed process goes at once, the orchestrator's too.
            if self.crashed:
                link_task.cancel()
            await self.service.close()
            await self.control.run(self.control_port.close())
            link_task.cancel()
            if watch is not None:
                watch.cancel()
            await asyncio.gather(link_task, *self._tasks, return_exceptions=True)
            self.control.stop()
