"""The gateway process: the OpenAI-compatible HTTP front door (gateway/server.py) in the role runtime.

Several gateways may share one HTTP port (`--reuse-port`, SO_REUSEPORT). `moe-fabric serve` runs
two. The kernel spreads new connections over them. So a dead gateway costs only the connections it
held, and its clients resume their streams on another (gateway/streaming.py).

A gateway joins the port only once it can serve, that is, once it is connected to an attention
worker. So a restarted one never answers 503 to connections that a live one could have served. On
SIGTERM it leaves the port at once and then drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from fabric.config import GatewayConfig
from fabric.messages.base import Message
from fabric.messages.control import PeerAlive, Role, RoutingUpdate, Traits, WorkerStats
from fabric.runtime import Runtime, Service
from fabric.transport import make_transport
from fabric.transport.base import LISTEN_BACKLOG
from gateway.aw_pool import AwPool
from gateway.server import Gateway

log = logging.getLogger("gateway")


class GatewayService(Service):
    role = Role.GATEWAY

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.runtime: Runtime | None = None
        self.pool = AwPool(make_transport(cfg.transport, send_timeout=cfg.send_timeout_ms / 1000,
                                        secret=cfg.secret, tls=cfg.tls), cfg.routing,
                           cfg.probe_interval_ms / 1000, cfg.probe_misses, self._report_dead,
                           make_transport("tcp", send_timeout=cfg.send_timeout_ms / 1000, secret=cfg.secret, tls=cfg.tls),
                           lambda: self.runtime.worker_id if self.runtime is not None else "gateway")
        self.pool.resume = cfg.resume
        self.gateway = Gateway(cfg, self.pool)
        self.http = web.AppRunner(self.gateway.app(), access_log=None, handler_cancellation=True)
        self.site: web.TCPSite | None = None

    def _report_dead(self, worker_id: str, reason: str, closed: bool) -> None:
        if self.runtime is not None:
            self.runtime.report_dead(worker_id, reason, closed)

    async def start(self, runtime: Runtime) -> int:
        self.runtime = runtime
        await self.http.setup()
        return self.cfg.port  # listened on once an AW is reachable (see _listen)

    def registration(self) -> dict[str, Any]:
        return {"ready": self.site is not None, "traits": Traits(model=self.gateway.model_name)}

    async def registered(self) -> None:
        assert self.runtime is not None
        self.gateway.worker_id = self.runtime.worker_id

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, PeerAlive):
            # An AW this gateway lost answers the orchestrator. Try it now.
            self.pool.vouched(msg.worker_id)
            assert self.runtime is not None
            self.runtime.cleared(msg.worker_id)
        elif isinstance(msg, RoutingUpdate):
            self.gateway.view = msg.view
            self.gateway.metrics.stores.set(len(msg.view.serving(Role.STORE)))
            await self.pool.update(msg.view.serving(Role.ATTENTION), msg.view.dead)
            if self.site is None and self.pool.ready:
                await self._listen()

    async def _listen(self) -> None:
        assert self.runtime is not None
        tls = self.cfg.tls
        self.site = web.TCPSite(self.http, self.cfg.host, self.cfg.port, reuse_port=self.cfg.reuse_port or None,
                                ssl_context=tls.server if tls is not None else None, backlog=LISTEN_BACKLOG)
        await self.site.start()
        log.info("%s serving http%s://%s:%d/v1 (model %s%s)", self.runtime.worker_id, "s" if tls else "", self.cfg.host, self.cfg.port,
                 self.gateway.model_name, ", port shared" if self.cfg.reuse_port else "")
        self.runtime.ready()

    def stats(self) -> WorkerStats:
        m = self.gateway.metrics
        return WorkerStats({"requests_active": self.gateway.active, "requests_waiting": m.n_waiting,
                            "aws_connected": len(self.pool.live())})

    async def close(self) -> None:
        if self.site is not None:
            # Leave the shared port at once. New connections go to the other gateways.
            await self.site.stop()
        await self.gateway.drain()
        await self.http.cleanup()
        await self.pool.close()


async def serve(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    await Runtime(cfg, GatewayService(cfg)).serve(stop)
