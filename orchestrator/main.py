"""Orchestrator process: aiohttp serves `GET /cluster` and the workers' websocket (`/ws`).

Main loop per worker link: receive register -> (EWs) place experts once enough have registered ->
collect worker_ready -> publish the routing table (epoch 1) to every AW and gateway. A link that
closes marks its worker dead.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import WSMsgType, web

from fabric.config import OrchestratorConfig
from fabric.control_link import pack, unpack
from fabric.errors import FabricError
from fabric.messages.control import AssignExperts, Register, Registered, RoutingUpdate, WorkerReady, WorkerStats
from fabric.model.config import ModelConfig
from orchestrator.cluster import Cluster
from orchestrator.placement import BalancedPlanner

log = logging.getLogger("orchestrator")


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        planner = BalancedPlanner(cfg.shadows_per_expert)
        self.cluster = Cluster(ModelConfig.from_dir(cfg.model), cfg.expert_workers, planner, cfg.host, cfg.port)
        self.links: dict[str, web.WebSocketResponse] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/cluster", self.get_cluster)
        app.router.add_get("/ws", self.worker_link)
        return app

    async def get_cluster(self, request: web.Request) -> web.Response:
        return web.json_response(self.cluster.to_json())

    async def worker_link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=5.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        worker_id = None
        try:
            first = await ws.receive()
            if first.type != WSMsgType.BINARY:
                return ws
            reg = unpack(first.data)
            if not isinstance(reg, Register) or reg.role not in ("attention", "expert", "gateway"):
                log.error("closing link from %s: first message is not a valid register", request.remote)
                return ws
            rec = self.cluster.add(reg.role, reg.pid, reg.host, reg.port, reg.info)
            worker_id = rec.id
            self.links[worker_id] = ws
            log.info("registered %s (%s pid %d at %s:%d)", rec.id, rec.role, rec.pid, rec.host, rec.port)
            await ws.send_bytes(pack(Registered(worker_id)))
            if reg.role == "expert":
                await self._place()
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
                if self.cluster.mark_dead(worker_id):
                    table = self.cluster.table
                    assert table is not None
                    log.warning("%s died; routing table epoch %d promotes its shadows%s", worker_id, table.epoch,
                                f"; {len(self.cluster.lost_units())} experts have no copy left" if self.cluster.lost_units() else "")
                else:
                    log.warning("%s link closed; marked dead", worker_id)
                await self._broadcast()
        return ws

    async def _place(self) -> None:
        for ew, units in self.cluster.maybe_place().items():
            log.info("placing %d experts on %s", len(units), ew)
            await self.links[ew].send_bytes(pack(AssignExperts([list(u) for u in units])))

    async def _handle(self, worker_id: str, msg: object) -> None:
        if isinstance(msg, WorkerReady):
            table_changed = self.cluster.mark_ready(worker_id)
            log.info("%s ready%s", worker_id, " -> routing table published" if table_changed else "")
            await self._broadcast()
        elif isinstance(msg, WorkerStats):
            self.cluster.workers[worker_id].stats = msg.stats

    def _routing_update(self) -> RoutingUpdate:
        table = self.cluster.table.to_dict() if self.cluster.table else {}
        return RoutingUpdate(table, self.cluster.live_workers())

    async def _broadcast(self) -> None:
        if self.cluster.table is None:
            return
        data = pack(self._routing_update())
        for wid, ws in list(self.links.items()):
            if self.cluster.workers[wid].role in ("attention", "gateway") and not ws.closed:
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
    if cfg.port_file:
        tmp = Path(cfg.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(cfg.port_file)
    log.info("orchestrator on http://%s:%d (expecting %d expert workers)", cfg.host, port, cfg.expert_workers)
    try:
        await stop.wait()
    finally:
        for ws in list(orch.links.values()):
            await ws.close()
        await runner.cleanup()
