"""Gateway process: the OpenAI-compatible HTTP front door.

Per request: authenticate -> validate -> render (chat template) and tokenize -> one submit per
choice to the least-loaded AW -> relay tokens as text (incremental detokenisation, stop strings)
-> on client disconnect, abort the request on its AW. SIGTERM drains: new requests get 503, the
running ones finish (bounded by the drain timeout), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fabric.config import GatewayConfig
from fabric.control_link import OrchestratorLink
from fabric.errors import PeerDeadError
from fabric.messages.client import Submit
from fabric.messages.control import PeerAlive, PeerFailed, Register, RoutingUpdate
from fabric.model.config import ModelConfig
from fabric.process import mark_failed
from fabric.routing import RoutingTable
from fabric.transport import make_transport
from gateway.aw_pool import AwPool
from gateway.chat_template import ChatTemplate, validate_messages
from gateway.generation import Choice, Delta, GenerationError, run_choice, start_choice
from gateway.metrics import Metrics
from gateway.protocol import ApiError, GenParams, parse_chat, parse_completion
from gateway.responses import Formatter

log = logging.getLogger("gateway")


def load_tokenizer(model_dir: str) -> Any:
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model)
        self.model_name = cfg.served_model_name or Path(cfg.model).name
        self.tokenizer = load_tokenizer(cfg.model)
        self.chat_template = ChatTemplate.from_model_dir(cfg.model)
        self.pool = AwPool(make_transport(cfg.transport), cfg.routing, cfg.probe_interval_ms / 1000, cfg.probe_misses,
                           self._report_dead)
        self.pool.resume = cfg.resume
        self.link: OrchestratorLink | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self.metrics = Metrics()
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # HTTP requests in flight (running or waiting)
        self.idle = asyncio.Event()
        self.idle.set()
        self.table: RoutingTable | None = None
        self.workers: list[dict[str, Any]] = []

    def _report_dead(self, worker_id: str, reason: str) -> None:
        """Tells the orchestrator (whose verdict is authoritative) that an AW is hung."""
        if self.link is None:
            return
        link = self.link

        async def send() -> None:
            try:
                await link.send(PeerFailed(worker_id, reason))
            except PeerDeadError:
                pass

        task = asyncio.create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.guard])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """API key, draining, body cap, and OpenAI-shaped errors for everything under /v1."""
        if not request.path.startswith("/v1/"):
            return await handler(request)
        try:
            if self.cfg.api_key is not None:
                auth = request.headers.get("Authorization", "")
                given = auth[7:] if auth.startswith("Bearer ") else ""
                if not hmac.compare_digest(given.encode(), self.cfg.api_key.encode()):
                    raise ApiError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
            if self.draining:
                raise ApiError(503, "the server is shutting down", type_="service_unavailable", headers={"Retry-After": "5"})
            if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
                raise ApiError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", code="request_too_large")
            return await handler(request)
        except ApiError as err:
            self.metrics.errors.labels(str(err.status)).inc()
            return err.response()
        except web.HTTPException as exc:
            if exc.status == 413:
                mapped = ApiError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", code="request_too_large")
            else:
                mapped = ApiError(exc.status, exc.reason, type_="invalid_request_error")
            self.metrics.errors.labels(str(mapped.status)).inc()
            return mapped.response()

    async def models(self, request: web.Request) -> web.Response:
        if not self.pool.ready:
            raise ApiError(503, "no attention worker is ready yet", type_="service_unavailable", headers={"Retry-After": "1"})
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moe-fabric",
                "max_model_len": self.model.max_position}
        return web.json_response({"object": "list", "data": [card]})

    def unhealthy_reason(self) -> str | None:
        if not self.pool.ready:
            return "no attention worker is reachable"
        if self.table is None:
            return "no routing table yet"
        alive = {w["id"] for w in self.workers if w.get("role") == "expert" and w.get("state") == "alive"}
        lost = [u for u, ews in self.table.replicas.items() if not any(ew in alive for ew in ews)]
        if lost:
            return f"{len(lost)} logical experts have no live replica (e.g. layer {lost[0][0]} expert {lost[0][1]})"
        return None

    async def health(self, request: web.Request) -> web.Response:
        reason = "draining" if self.draining else self.unhealthy_reason()
        if reason:
            return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
        stores = sum(1 for w in self.workers if w.get("role") == "checkpoint_store")
        checkpointing = "on" if stores else "off: no live checkpoint store (an AW failure falls back to replay)"
        return web.json_response({"status": "ok", "checkpointing": checkpointing})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        host, port = self.cfg.orchestrator_addr
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s, \
                    s.get(f"http://{host}:{port}/cluster") as r:
                self.metrics.update_cluster(await r.json())
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("metrics: cluster view unavailable: %s", exc)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from exc

    def _check_model(self, body: Any) -> None:
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            raise ApiError(404, f"the model {body.get('model')!r} does not exist", "model", code="model_not_found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        params = parse_completion(body, self.model.vocab_size, self.model.max_position)
        return await self._generate(request, params, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        raw_messages, fields = parse_chat(body, self.model.vocab_size, self.model.max_position)
        messages = validate_messages(raw_messages)
        if self.chat_template is None or self.tokenizer is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        params = GenParams(prompt_ids=None, prompt_text=self.chat_template.render(messages), **fields)
        return await self._generate(request, params, chat=True)

    def _prompt_ids(self, params: GenParams) -> list[int]:
        if params.prompt_ids is not None:
            return params.prompt_ids
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send 'prompt' as a list of token ids", "prompt")
        ids = list(self.tokenizer.encode(params.prompt_text, add_special_tokens=False).ids)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        return ids

    async def _generate(self, request: web.Request, params: GenParams, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        prompt_ids = self._prompt_ids(params)
        context = self.model.max_position
        max_tokens = params.max_tokens if params.max_tokens is not None else context - len(prompt_ids)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                           f"the context of {context} tokens", "max_tokens")
        if self.metrics.n_waiting + params.n > self.cfg.max_waiting:
            raise ApiError(429, f"more than {self.cfg.max_waiting} requests are waiting", type_="rate_limit_error",
                           headers={"Retry-After": "1"})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = [Choice(i, f"{rid}-{i}", Submit(
            f"{rid}-{i}", prompt_ids, max_tokens, params.temperature, params.top_p, params.top_k,
            (params.seed + i) % (1 << 64), list(self.model.eos_token_ids), params.ignore_eos, [], params.logprobs,
        )) for i in range(params.n)]
        fmt = Formatter(chat, rid, int(time.time()), self.model_name, params, self.tokenizer)
        self.active += 1
        self.idle.clear()
        self.metrics.prompt.inc(len(prompt_ids) * params.n)
        gens: list[Any] = []
        try:
            for c in choices:
                await start_choice(self.pool, c)
            gens = [run_choice(self.pool, c, params, self.tokenizer, self.metrics, arrived) for c in choices]
            if params.stream:
                return await self._stream(request, fmt, prompt_ids, choices, gens)
            return await self._whole(fmt, prompt_ids, choices, gens)
        finally:
            for g in gens:
                await g.aclose()  # aborts unfinished choices on their AWs (disconnect, error)
            for c in choices:  # submitted but never iterated (an earlier submit failed)
                if c.client is not None and not c.done:
                    await self.pool.abort(c.client, c.request_id)
            self.metrics.e2e.observe(time.monotonic() - arrived)
            self.active -= 1
            if self.active == 0:
                self.idle.set()

    async def _whole(self, fmt: Formatter, prompt_ids: list[int], choices: list[Choice], gens: list[Any]) -> web.Response:
        async def collect(gen: Any) -> tuple[str, list[Any]]:
            text, lps = [], []
            async for d in gen:
                text.append(d.text)
                lps.extend(d.logprobs)
            return "".join(text), lps

        tasks = [asyncio.create_task(collect(g)) for g in gens]
        try:
            results = await asyncio.gather(*tasks)
        except GenerationError as exc:
            raise ApiError(exc.status, str(exc), type_="server_error") from exc
        finally:
            await _cancel(tasks)
        return web.json_response(fmt.whole(prompt_ids, choices, [t for t, _ in results], [lp for _, lp in results]))

    async def _stream(self, request: web.Request, fmt: Formatter, prompt_ids: list[int], choices: list[Choice],
                      gens: list[Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict[str, Any] | str) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        queue: asyncio.Queue[tuple[int, Delta | GenerationError | None]] = asyncio.Queue()

        async def pump(i: int, gen: Any) -> None:
            try:
                async for d in gen:
                    await queue.put((i, d))
                await queue.put((i, None))
            except GenerationError as exc:
                await queue.put((i, exc))

        if fmt.chat:
            for c in choices:
                await send(fmt.chunk(c.index, None, first=True))
        pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            open_choices = len(choices)
            while open_choices:
                i, item = await queue.get()
                if isinstance(item, GenerationError):
                    self.metrics.errors.labels(str(item.status)).inc()
                    await send({"error": {"message": str(item), "type": "server_error", "param": None, "code": item.status}})
                    break
                if item is None:
                    open_choices -= 1
                    continue
                await send(fmt.chunk(i, item))
            else:
                if fmt.params.include_usage:
                    await send(fmt.usage_chunk(len(prompt_ids), choices))
            await send("[DONE]")
            await resp.write_eof()
        finally:
            await _cancel(pumps)
        return resp

    async def drain(self) -> None:
        self.draining = True
        log.info("draining: %d requests in flight", self.active)
        if self.idle.is_set():  # nothing to wait for (and wait_for with timeout 0 would time out anyway)
            return
        try:
            await asyncio.wait_for(self.idle.wait(), self.cfg.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout: %d requests still in flight", self.active)


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancels tasks and waits until they have finished, so their generators are closed."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def serve(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    gw = Gateway(cfg)
    runner = web.AppRunner(gw.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    link = OrchestratorLink(*cfg.orchestrator_addr)
    wid = await link.connect(Register("gateway", os.getpid(), cfg.host, port, {"model": gw.model_name}))
    gw.link = link
    log.info("%s serving http://%s:%d/v1 (model %s)", wid, cfg.host, port, gw.model_name)
    try:
        while (msg := await link.next_message(stop)) is not None:
            if isinstance(msg, PeerAlive):  # an AW our probes gave up on answers the orchestrator
                gw.pool.dead.discard(msg.worker_id)
                await gw.pool.update(gw.workers)
            elif isinstance(msg, RoutingUpdate):
                gw.workers = msg.workers
                gw.metrics.stores.set(sum(1 for w in msg.workers if w.get("role") == "checkpoint_store"))
                gw.table = RoutingTable.from_dict(msg.table) if msg.table else None
                await gw.pool.update(msg.workers)
        if link.closed.is_set() and not stop.is_set():
            log.error("%s lost the orchestrator; exiting", wid)
            mark_failed()
        else:
            await gw.drain()
    finally:
        await runner.cleanup()
        await gw.pool.close()
        await link.close()
