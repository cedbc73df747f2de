"""Expert worker process.

Main loop (expert_worker/batching.py): wait for pending calls -> ask the gather policy what runs now -> run each
expert once over the rows of all calls in the batch -> send each AW its results. The read callback of a call
takes that turn itself (`Batching.turn`): the batch the call completes runs there, sparing a hop through the
main loop.

Connection handlers validate and enqueue, and take that turn. The AWs' control channels carry their probes and
whether they have a batch running. They and the orchestrator link are served on the control
plane's loop (fabric/runtime.py). That loop never waits for a batch, however long it takes. The
data path does not need the orchestrator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

import torch

from expert_worker import loading
from expert_worker.batching import Batching
from expert_worker.executor import ExpertExecutor
from expert_worker.gather import make_policy
from expert_worker.sim_executor import SimExecutor
from fabric import device, faults
from fabric.config import ExpertWorkerConfig
from fabric.errors import AuthError, FabricError, PeerDeadError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.control import (
    AssignExperts,
    ClusterView,
    Life,
    Role,
    RoutingUpdate,
    Traits,
    WorkerReady,
    WorkerStats,
)
from fabric.messages.expert import ExpertCall, ExpertError
from fabric.messages.liveness import AwActivity, Hello, Ping, Pong
from fabric.model.config import ModelConfig
from fabric.process import run_niced_async
from fabric.runtime import Runtime, Service
from fabric.sim_host import serve_workers
from fabric.steps import StepClock
from fabric.transport import make_transport
from fabric.transport.base import Connection, Listener, bound_elsewhere

log = logging.getLogger("expert_worker")


class ExpertWorker(Service):
    role = Role.EXPERT

    def __init__(self, cfg: ExpertWorkerConfig) -> None:
        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model, cfg.dtype)
        self.executor = (SimExecutor(self.model, cfg.sim_expert_ms, cfg.sim_expert_row_us) if cfg.compute == "sim"
                         else ExpertExecutor(self.model, cfg.kernel, str(device.resolve(cfg.device)), cfg.cuda_graphs))
        self.transport = make_transport(cfg.transport, send_timeout=cfg.send_timeout_ms / 1000,
                                        secret=cfg.secret, tls=cfg.tls)
        self.runtime: Runtime | None = None
        self.listener: Listener | None = None
        self.slot = ""  # the placement slot whose experts this EW holds
        self.loaded = False
        # Newest routing-table epoch seen, from the orchestrator or on a call.
        self.epoch = 0
        # Calls tagged with an older epoch. They are still served, as we host the expert.
        self.stale_calls = 0
        # AWs the orchestrator declared dead. They are never waited for and never served.
        self.fenced: set[str] = set()
        self.conns: dict[str, dict[str, Connection]] = {}  # AW -> channel ("control", "data") -> its connection
        self.clock = StepClock()
        # The calls held, the batches picked, run and answered (expert_worker/batching.py).
        self.batching = Batching(self.executor, make_policy(cfg.gather, cfg.min_batch_tokens, cfg.max_wait_ms,
                                                            self.model.num_layers), self.clock, faults.slow_steps())
        self.warmup_s: float | None = None  # the cold paths, run once before the first WorkerReady

    # -- connection handlers ------------------------------------------------------------------
    async def handle_conn(self, conn: Connection) -> None:
        """Serves an AW's data channel.

        Its control channel is on this worker's control port.
        """
        hello = await conn.recv()
        if not isinstance(hello, Hello) or hello.channel != "data":
            raise ProtocolError(f"expected a data hello, got {hello.kind}")
        if hello.aw_id in self.fenced:
            raise ProtocolError(f"{hello.aw_id} was declared dead")
        channels = self.conns.setdefault(hello.aw_id, {})
        if await bound_elsewhere(channels.get(hello.channel), Pong(-1)):
            # Identity is bound to the first connection. A second peer that claims this AW's channel
            # while the first is up is an impostor. A reconnecting AW closed the old one.
            raise AuthError(f"{conn.peer} claims {hello.aw_id}'s {hello.channel} channel, which is connected")
        channels[hello.channel] = conn
        if hello.channel == "data":
            self.batching.linked(hello.aw_id)
            # Calls and results land as the GPU's memory where UCX can.
            conn.land_frames_on(self.executor.device)
        try:
            await self._data_loop(hello.aw_id, conn)
        finally:
            channels = self.conns.get(hello.aw_id, {})
            if channels.get(hello.channel) is conn:
                del channels[hello.channel]
            self.batching.drop(conn)
            if not channels:  # its data link is gone: never wait for its calls
                self.conns.pop(hello.aw_id, None)
                self.batching.forget(hello.aw_id)

    def control_message(self, peer: str, msg: Message | None) -> None:
        """Handles an AW's control channel, on the control loop.

        It carries the AW's hello, whether it has a batch running, and its end.
        """
        if isinstance(msg, Hello):
            if peer in self.fenced:
                raise ProtocolError(f"{peer} was declared dead")
        elif isinstance(msg, AwActivity) or msg is None:
            assert self.runtime is not None
            self.runtime.control.to_main(self._activity, peer, msg is not None and msg.active)
        else:
            raise ProtocolError(f"unexpected {msg.kind} on the control channel")

    def _activity(self, aw_id: str, active: bool) -> None:
        """Gather policies wait only for the AWs that have a batch running (and a control channel), never for a
        fenced one."""
        self.batching.activity(aw_id, active and aw_id not in self.fenced)

    # -- the role runtime's side ---------------------------------------------------------------
    async def start(self, runtime: Runtime) -> int:
        self.runtime = runtime
        torch.set_num_threads(self.cfg.threads)
        # A standby is warm: the kernel is loaded now and every expert of the store mapped ahead.
        if self.cfg.standby:
            await run_niced_async(self._premap, self.cfg.boot_nice)
            await self._warm_up()
        self.listener = await self.transport.listen(self.cfg.host, self.cfg.port, self.handle_conn)
        runtime.spawn(self.batching.run_loop(runtime.stop), main_loop=True)
        log.info("expert worker listening on %s:%d (%s)", self.cfg.host, self.listener.port, self.transport.name)
        return self.listener.port

    def registration(self) -> dict[str, Any]:
        # Called on the control loop. list(...) snapshots at once, while a load may be adding entries.
        return {"slot": self.slot, "experts": [list(u) for u in sorted(list(self.executor.experts))], "ready": self.loaded,
                "life": Life(standby=self.cfg.standby and not self.slot),
                "traits": Traits(transport=self.transport.name, gather=self.cfg.gather,
                                 warmup_ms=round(self.warmup_s * 1e3, 1) if self.warmup_s is not None else 0.0)}

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, AssignExperts):
            await self.assign(msg)
        elif isinstance(msg, RoutingUpdate):
            await self.routing_update(msg.view)

    async def assign(self, msg: AssignExperts) -> None:
        assert self.runtime is not None
        units = [(int(u[0]), int(u[1])) for u in msg.experts]
        todo = [u for u in units if u not in self.executor.experts]
        if todo:
            t0 = time.perf_counter()
            read, mapped = self.executor.bytes_read, self.executor.bytes_mapped
            await run_niced_async(partial(self._load, todo), self.cfg.boot_nice)
            log.info("%s %s %d experts of slot %s (%.1f MiB) in %.3fs", self.runtime.worker_id,
                     "mapped" if self.executor.bytes_mapped > mapped else "read", len(todo), msg.slot,
                     (self.executor.bytes_read - read + self.executor.bytes_mapped - mapped) / 2**20,
                     time.perf_counter() - t0)
        await self._warm_up()
        self.slot, self.loaded = msg.slot, True
        try:
            await self.runtime.send(WorkerReady(self.epoch, msg.op))
        except PeerDeadError:
            # The next orchestrator learns it from the registration (ready, slot, experts).
            pass
        self.runtime.ready()

    async def _warm_up(self) -> None:
        """Runs the cold paths once, in the compute thread, before the worker first says it is ready.

        The cold paths are the kernels' build, JIT and first launches. The first real batch is then
        warm.
        """
        if self.warmup_s is not None:
            return
        t0 = time.perf_counter()
        batches = self.clock.run(self.executor.warm_up)
        self.warmup_s = time.perf_counter() - t0
        if batches:
            log.info("warm-up: %d batches of experts in %.0f ms", batches, self.warmup_s * 1e3)

    def busy_for(self) -> float:
        return self.clock.running_for()

    def load(self, peer: str) -> tuple[float, int]:
        """How long the batch under way has run, and how many of AW `peer`'s calls are queued or in it.

        Called on the control loop. That AW waits for those calls, however long the batch takes
        (attention_worker/ew_link.py). Calls still unread on its data connection count as one: a
        batch that began just before they could be read holds them too. On a loaded host this loop
        may start a batch before reading calls that arrived earlier. So do results not yet out of this
        process: a batch's calls are held until their results are sent (`Batching.turn`).
        """
        held = self.batching.held(peer)
        data = self.conns.get(peer, {}).get("data")
        if data is not None and (data.unread() > 0 or data.unsent() > 0):
            held += 1
        return self.busy_for(), held

    def _premap(self) -> None:
        loading.premap_all(self.cfg, self.model, self.executor)

    def _load(self, units: list[tuple[int, int]]) -> None:
        loading.load(self.cfg, self.model, self.executor, units)

    def stats(self) -> WorkerStats:
        rows = [[lyr, e, n] for (lyr, e), n in sorted(dict(self.executor.tokens_by_expert).items())]
        b = self.batching
        return WorkerStats({"batches": b.batches, "mixed_batches": b.mixed_batches, "hurried_batches": b.policy.hurried,
                            "compute_s": round(b.compute_s, 3), "epoch": self.epoch,
                            "stale_calls": self.stale_calls, "empty_calls": b.empty_calls,
                            "expert_mib_read": round(self.executor.bytes_read / 2**20, 1),
                            "expert_mib_mapped": round(self.executor.bytes_mapped / 2**20, 1),
                            "kernel": self.executor.kernel,
                            "warmup_ms": round(self.warmup_s * 1e3, 1) if self.warmup_s is not None else None},
                           tokens_by_expert=rows)

    def abort(self) -> None:
        self.transport.abort_all()

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()

    async def routing_update(self, view: ClusterView) -> None:
        """Applies the orchestrator's newest epoch and the workers it declared dead.

        An EW never waits for a dead AW (Tarragon §5.2). The AW leaves the gather set at once, its
        pending calls are dropped and its connections closed. So a hung AW that wakes up is not served.
        """
        self.epoch = max(self.epoch, view.table.epoch if view.table else 0)
        newly = [w for w in view.dead if w not in self.fenced]  # (only AWs ever connect here)
        for aw_id in newly:
            self.fenced.add(aw_id)
            if aw_id in self.batching.active_aws or aw_id in self.conns:
                log.info("%s declared dead: no longer waited for", aw_id)
            self.batching.forget(aw_id)
            for conn in self.conns.pop(aw_id, {}).values():
                await conn.close()
            assert self.runtime is not None
            await self.runtime.drop_peer(aw_id)

    async def _data_loop(self, aw_id: str, conn: Connection) -> None:
        """Takes the AW's calls as they arrive (in the transport's read callback) until its connection ends."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def end(_: FabricError) -> None:
            if not ended.done():
                ended.set_result(None)

        conn.deliver(partial(self._on_data, aw_id, conn), end)
        await ended

    def _on_data(self, aw_id: str, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Ping):
            # An AW checking that this data path works again (a relink).
            conn.send_nowait(Pong(msg.nonce))
            return
        if not isinstance(msg, ExpertCall):
            raise ProtocolError(f"unexpected {msg.kind} on the data channel")
        msg.check(self.model.hidden_size, self.model.torch_dtype)
        if msg.epoch < self.epoch:
            self.stale_calls += 1  # routed by an older table: served all the same if hosted here
        self.epoch = max(self.epoch, msg.epoch)
        missing = self.executor.missing(msg.layer, msg.experts)
        if missing:
            conn.send_nowait(ExpertError(msg.call_id, f"layer {msg.layer} experts {missing} not hosted here"))
            return
        self.batching.take(aw_id, conn, msg)


async def serve(cfg: ExpertWorkerConfig, stop: asyncio.Event) -> None:
    await serve_workers(cfg, lambda: ExpertWorker(cfg), stop)
