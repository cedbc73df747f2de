"""Orchestrator process: aiohttp serves `GET /cluster`, `POST /shutdown` and the workers'
websocket (`/ws`).

Main loop per worker link: receive register -> (EWs) place experts once enough have registered,
or fill a dead EW's slot -> collect worker_ready -> publish the routing table to every worker.
A worker is dead when its link closes or when a peer reports it (`PeerFailed`: the orchestrator's
verdict is authoritative, and it closes the dead worker's link so a hung process that wakes up
exits). Every death of an AW or EW publishes the next epoch and asks the provisioner for a
replacement, unless the cluster is shutting down.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from fabric.config import OrchestratorConfig
from fabric.control_link import pack, unpack
from fabric.errors import FabricError
from fabric.messages.control import (
    AssignExperts,
    LinkProbe,
    LinkProbeReply,
    PeerAlive,
    PeerFailed,
    Register,
    Registered,
    RoutingUpdate,
    WorkerReady,
    WorkerStats,
)
from fabric.model.config import ModelConfig
from orchestrator.cluster import Cluster
from orchestrator.placement import BalancedPlanner
from orchestrator.provisioner import NoProvisioner, Provisioner, make_provisioner

log = logging.getLogger("orchestrator")


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        planner = BalancedPlanner(cfg.shadows_per_expert)
        self.cluster = Cluster(ModelConfig.from_dir(cfg.model), cfg.expert_workers, planner, cfg.host, cfg.port)
        self.links: dict[str, web.WebSocketResponse] = {}
        self.provisioner: Provisioner = NoProvisioner()  # set by `serve` once the port is bound
        self.shutting_down = False
        self._closing: set[asyncio.Task[Any]] = set()
        self._probes: dict[int, asyncio.Future[None]] = {}
        self._confirming: dict[str, asyncio.Task[None]] = {}
        self._nonce = itertools.count(1)
        self.replacements_started = 0
        self._watch: asyncio.Task[None] | None = None
        self._delayed: set[asyncio.TimerHandle] = set()  # replacements waiting out replacement_delay_ms

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/cluster", self.get_cluster)
        app.router.add_post("/shutdown", self.post_shutdown)
        app.router.add_get("/ws", self.worker_link)
        return app

    async def get_cluster(self, request: web.Request) -> web.Response:
        body = self.cluster.to_json()
        body["replacements_started"] = self.replacements_started
        return web.json_response(body)

    async def post_shutdown(self, request: web.Request) -> web.Response:
        """The whole cluster is being stopped: workers that go away now are not replaced."""
        self.shutting_down = True
        log.info("cluster shutdown announced: no more replacements")
        return web.json_response({"shutting_down": True})

    async def worker_link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        worker_id = None
        try:
            first = await ws.receive()
            if first.type != WSMsgType.BINARY:
                return ws
            reg = unpack(first.data)
            if not isinstance(reg, Register) or reg.role not in ("attention", "expert", "gateway", "checkpoint_store"):
                log.error("closing link from %s: first message is not a valid register", request.remote)
                return ws
            rec = self.cluster.add(reg.role, reg.pid, reg.host, reg.port, reg.info)
            worker_id = rec.id
            self.links[worker_id] = ws
            self.provisioner.registered(reg.pid)
            log.info("registered %s (%s pid %d at %s:%d)", rec.id, rec.role, rec.pid, rec.host, rec.port)
            await ws.send_bytes(pack(Registered(worker_id)))
            if reg.role == "expert":
                await self._place()
            if reg.role == "checkpoint_store":
                await self._broadcast()  # AWs start (or resume) checkpointing to it
            elif self.cluster.table is not None:
                await ws.send_bytes(pack(self._routing_update()))
            async for msg in ws:
                if msg.type != WSMsgType.BINARY:
                    continue
                await self._handle(worker_id, unpack(msg.data))
        except FabricError as exc:
            log.error("closing link of %s: %s", worker_id or request.remote, exc)
        finally:
            if worker_id is not None:
                self.links.pop(worker_id, None)
                await self._declare_dead(worker_id, "link closed")
        return ws

    async def _declare_dead(self, worker_id: str, reason: str) -> None:
        """The one place a worker dies: next epoch, broadcast, fence, replace."""
        was_live, table_changed = self.cluster.mark_dead(worker_id)
        if not was_live:
            return
        rec = self.cluster.workers[worker_id]
        lost = self.cluster.lost_units()
        if table_changed and not self.shutting_down:
            assert self.cluster.table is not None
            log.warning("%s died (%s); routing table epoch %d promotes its shadows%s", worker_id, reason,
                        self.cluster.table.epoch, f"; {len(lost)} experts have no copy left" if lost else "")
        elif self.shutting_down:
            log.info("%s left (%s)", worker_id, reason)
        else:
            log.warning("%s died (%s)", worker_id, reason)
        await self._broadcast()
        ws = self.links.pop(worker_id, None)
        if ws is not None and not ws.closed:
            # Fencing: a hung worker that wakes up finds its link gone and exits. In a task: the
            # close handshake waits for a peer that may be stopped.
            task = asyncio.create_task(ws.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if rec.role in ("attention", "expert", "checkpoint_store"):
            self._replace(rec.role, worker_id)

    def _replace(self, role: str, replaces: str) -> None:
        """Starts a replacement after `replacement_delay_ms`: in the first few hundred ms after a
        death the survivors restore and reroute its work, and a process starting up (the
        interpreter and `fabric.cli` at normal priority, the rest in the idle class) would take
        CPU from them on a host they share. The replacement is not on that path: a dead AW's
        requests resume on healthy AWs, a dead EW's experts on their shadows."""
        delay = self.cfg.replacement_delay_ms / 1000
        if delay <= 0:
            self._start_replacement(role, replaces)
            return
        handle = asyncio.get_running_loop().call_later(delay, self._start_replacement, role, replaces)
        self._delayed.add(handle)
        asyncio.get_running_loop().call_later(delay, self._delayed.discard, handle)

    def _start_replacement(self, role: str, replaces: str) -> None:
        if self.shutting_down:
            return
        if self.replacements_started >= self.cfg.max_replacements:
            log.error("not replacing %s: %d replacements already started (--max-replacements)", replaces,
                      self.replacements_started)
            return
        if self.provisioner.start(role, replaces) is not None:
            self.replacements_started += 1

    async def watch_replacements(self) -> None:
        """A replacement that exits before registering is started again (a double fault during start-up)."""
        while True:
            await asyncio.sleep(0.5)
            for s in self.provisioner.exited_early():
                log.warning("replacement %s (pid %d) for %s exited with code %s before registering",
                            s.role, s.proc.pid, s.replaces, s.proc.returncode)
                await asyncio.sleep(1.0)  # back off: whatever killed it may still be there
                self._replace(s.role, s.replaces)

    async def _place(self) -> None:
        for ew, units in self.cluster.maybe_place().items():
            replaces = self.cluster.workers[ew].info.get("replaces")
            log.info("placing %d experts on %s%s", len(units), ew, f" (replacing {replaces})" if replaces else "")
            await self.links[ew].send_bytes(pack(AssignExperts([list(u) for u in units])))

    async def _handle(self, worker_id: str, msg: object) -> None:
        if isinstance(msg, WorkerReady):
            table_changed = self.cluster.mark_ready(worker_id)
            log.info("%s ready%s", worker_id, " -> routing table published" if table_changed else "")
            await self._broadcast()
        elif isinstance(msg, WorkerStats):
            self.cluster.workers[worker_id].stats = msg.stats
        elif isinstance(msg, LinkProbeReply):
            fut = self._probes.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif (isinstance(msg, PeerFailed) and msg.worker_id in self.cluster.workers and msg.worker_id != worker_id
              and msg.worker_id not in self._confirming):
            task = asyncio.create_task(self._confirm(worker_id, msg))
            self._confirming[msg.worker_id] = task
            task.add_done_callback(lambda _: self._confirming.pop(msg.worker_id, None))

    async def _confirm(self, reporter: str, msg: PeerFailed) -> None:
        """A peer says `msg.worker_id` is dead. The verdict is ours: probe it over its own link
        (answered by its link reader, so a busy but healthy worker replies in milliseconds); no
        reply within `confirm_timeout_ms` confirms the death. A false report is answered with
        `PeerAlive`, so the reporter can use the worker again."""
        target = msg.worker_id
        ws = self.links.get(target)
        if ws is not None and not ws.closed and self.cluster.workers[target].state != "dead":
            nonce = next(self._nonce)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._probes[nonce] = fut
            try:
                await ws.send_bytes(pack(LinkProbe(nonce)))
                await asyncio.wait_for(fut, self.cfg.confirm_timeout_ms / 1000)
            except (TimeoutError, ConnectionError):
                pass
            finally:
                self._probes.pop(nonce, None)
            if fut.done() and not fut.cancelled():  # wait_for cancels it on a timeout
                log.warning("%s reported %s dead (%s), but it answers: not declared dead", reporter, target, msg.reason)
                reporter_ws = self.links.get(reporter)
                if reporter_ws is not None and not reporter_ws.closed:
                    try:
                        await reporter_ws.send_bytes(pack(PeerAlive(target)))
                    except ConnectionError:
                        pass
                return
        await self._declare_dead(target, f"reported by {reporter}: {msg.reason}")

    def _routing_update(self) -> RoutingUpdate:
        table = self.cluster.table.to_dict() if self.cluster.table else {}
        return RoutingUpdate(table, self.cluster.live_workers(), self.cluster.dead_workers())

    async def _broadcast(self) -> None:
        if self.cluster.table is None:
            return
        data = pack(self._routing_update())
        for ws in list(self.links.values()):
            if not ws.closed:
                try:
                    await ws.send_bytes(data)
                except ConnectionError:
                    pass


async def serve(cfg: OrchestratorConfig, stop: asyncio.Event) -> None:
    orch = Orchestrator(cfg)
    runner = web.AppRunner(orch.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    orch.cluster.self_record.port = port
    orch.provisioner = make_provisioner(  # replacements dial the port actually bound
        cfg.provisioner, {"attention": cfg.spawn_attention_args, "expert": cfg.spawn_expert_args,
                          "checkpoint_store": cfg.spawn_store_args},
        f"{cfg.host}:{port}", cfg.spawn_log_dir, cfg.replacement_boot_nice)
    orch._watch = asyncio.create_task(orch.watch_replacements())
    if cfg.port_file:
        tmp = Path(cfg.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(cfg.port_file)
    log.info("orchestrator on http://%s:%d (expecting %d expert workers)", cfg.host, port, cfg.expert_workers)
    try:
        await stop.wait()
    finally:
        orch.shutting_down = True
        for handle in orch._delayed:
            handle.cancel()
        if orch._watch is not None:
            orch._watch.cancel()
        await orch.provisioner.close()  # replacements stop while their orchestrator is still there
        for ws in list(orch.links.values()):
            await ws.close()
        await runner.cleanup()
