"""A gateway's /health and /metrics: the status for anyone, the details and the metrics for holders
of the cluster secret, or for everyone with --public-metrics (no fabric needed: an HTTP app
with no attention worker behind it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from fabric.config import GatewayConfig
from gateway.server import Gateway

SECRET = "g" * 32


async def get(server: TestServer, path: str, auth: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path), headers=headers) as r:
        return r.status, await r.text()


@pytest.mark.parametrize("public", [False, True])
def test_health_details_and_metrics_are_for_insiders(public: bool, hf_models: dict[str, Path], tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    cfg = GatewayConfig(model=str(hf_models["mixtral"]), orchestrator="127.0.0.1:9", cluster_secret_file=str(secret),
                        public_metrics=public)
    pool = SimpleNamespace(ready=False)  # no attention worker: /health is 503 with a reason

    async def main() -> None:
        server = TestServer(Gateway(cfg, pool).app(), host="127.0.0.1")  # type: ignore[arg-type]
        await server.start_server()
        try:
            status, body = await get(server, "/health")
            assert status == 503 and ("reason" in body) == public
            status, body = await get(server, "/health", SECRET)
            assert status == 503 and "no attention worker" in body
            status, _ = await get(server, "/metrics")
            assert status == (200 if public else 401)
            status, _ = await get(server, "/metrics", "w" * 32)
            assert status == (200 if public else 401)
            status, body = await get(server, "/metrics", SECRET)
            assert status == 200 and "moe_fabric_requests_waiting" in body
        finally:
            await server.close()

    asyncio.run(main())
