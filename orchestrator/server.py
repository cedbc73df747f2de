"""The orchestrator process around `Orchestrator` (orchestrator/main.py).

It holds the HTTP server, the provisioner, and the order of start-up and shutdown. The server has
the workers' websocket `/ws` and the admin endpoints `GET /cluster` and `POST /shutdown`. The admin
endpoints need the cluster secret as Bearer.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from fabric import auth
from fabric.config import OrchestratorConfig
from fabric.messages.control import Role
from fabric.notify import notifier
from fabric.process import freeze_heap
from fabric.transport.base import LISTEN_BACKLOG
from orchestrator.balancer import balance_loop
from orchestrator.main import Orchestrator
from orchestrator.provisioner import make_provisioner
from orchestrator.scaling import ScaleError

log = logging.getLogger("orchestrator")


def make_app(orch: Orchestrator) -> web.Application:
    def admin(request: web.Request) -> None:
        """Endpoints that reveal or change the cluster need `Authorization: Bearer <cluster secret>`."""
        if orch.secret is not None and not auth.bearer_ok(request.headers.get("Authorization"), orch.secret):
            raise web.HTTPUnauthorized(text="this endpoint needs 'Authorization: Bearer <cluster secret>'\n",
                                       headers={"WWW-Authenticate": "Bearer"})

    async def get_cluster(request: web.Request) -> web.Response:
        admin(request)
        # ?routing=0 leaves out the routing table and redundancy, for pollers that want the workers
        # only. Those need a scan of every expert: ~50 ms and a large body at Qwen3-235B's 94 x 128 experts.
        body = orch.cluster.to_json(routing=request.query.get("routing", "1") != "0")
        body["recovering"] = not orch.recovered.is_set()
        body["replacements_started"] = orch.replacements.started
        # Lineage -> why its replacements stopped.
        body["not_replaced"] = orch.replacements.churn.stopped
        body["scaled"] = orch.scaler.history
        body["control"] = {**orch.traffic, "links": len(orch.links), "broadcasts": orch.broadcaster.log_json()}
        body["recovery"] = orch.recovery.summary
        return web.json_response(body)

    async def post_shutdown(request: web.Request) -> web.Response:
        """Announces that the whole cluster is being stopped. Workers that go away now are not replaced."""
        admin(request)
        orch.shutting_down = True
        log.info("cluster shutdown announced: no more replacements")
        return web.json_response({"shutting_down": True})

    async def post_scale(request: web.Request) -> web.Response:
        """Adds or drains workers while serving.

        The body is {"attention_workers": N, "expert_workers": M}; either may be left out. It answers
        once done, with what moved."""
        admin(request)
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="expected a JSON object\n") from None
        if not isinstance(body, dict) or not body or set(body) - {"attention_workers", "expert_workers"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096 for v in body.values()):
            raise web.HTTPBadRequest(text='expected {"attention_workers": N, "expert_workers": M} (either or both, '
                                          'integers in 1..4096)\n')
        try:
            result = await orch.scaler.scale(body.get("attention_workers"), body.get("expert_workers"))
        except ScaleError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response(result)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/cluster/scale", post_scale)
    app.router.add_get("/cluster", get_cluster)
    app.router.add_post("/shutdown", post_shutdown)
    app.router.add_get("/ws", orch.worker_link)
    return app


async def serve(cfg: OrchestratorConfig, stop: asyncio.Event) -> None:
    orch = Orchestrator(cfg, stop)
    auth.check_bind(cfg.host, orch.secret, "the orchestrator")
    runner = web.AppRunner(make_app(orch), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    tls = cfg.tls
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=tls.server if tls is not None else None,
                       backlog=LISTEN_BACKLOG)  # every worker registers again at once after a restart
    await site.start()
    port = runner.addresses[0][1]
    orch.cluster.self_record.port = port
    orch.replacements.provisioner = make_provisioner(  # replacements dial the port actually bound
        cfg.provisioner, {Role.ATTENTION: cfg.spawn_attention_args, Role.EXPERT: cfg.spawn_expert_args,
                          Role.STORE: cfg.spawn_store_args},
        f"{cfg.host}:{port}", cfg.spawn_log_dir, cfg.supervisor_fd)
    tasks = [asyncio.create_task(orch.replacements.watch()), asyncio.create_task(orch.recover()),
             asyncio.create_task(orch.watch_leases())]
    if cfg.balance_interval_s > 0:
        tasks.append(asyncio.create_task(balance_loop(orch)))
    log.info("orchestrator generation %d on http://%s:%d (expecting %d expert workers; recovering for up to %.1f s)",
             orch.generation, cfg.host, port, cfg.expert_workers, cfg.recovery_grace_s)
    freeze_heap(collect=False)  # (a new orchestrator's recovery waits for no collection)
    notifier().send("READY=1")
    try:
        await stop.wait()
    finally:
        orch.shutting_down = True
        for t in tasks:
            t.cancel()
        await orch.replacements.provisioner.close()
        await asyncio.gather(*(link.close() for link in list(orch.links.values())), return_exceptions=True)
        await runner.cleanup()
