"""Gateway process: aiohttp app for `GET /v1/models` and `POST /v1/completions` (SSE streaming).

Per request: validate -> tokenize -> pick the least-loaded AW -> relay its per-step tokens to the
client (detokenised incrementally) -> on client disconnect, abort the request on the AW.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from fabric.config import GatewayConfig
from fabric.control_link import OrchestratorLink
from fabric.errors import PeerDeadError
from fabric.messages.client import Submit
from fabric.messages.control import Register, RoutingUpdate
from fabric.model.config import ModelConfig
from fabric.process import mark_failed
from fabric.transport import make_transport
from gateway.aw_pool import AwClient, AwPool, Pending
from gateway.detokenizer import IncrementalDetokenizer
from gateway.protocol import ApiError, CompletionParams, parse_completion

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
        self.pool = AwPool(make_transport(cfg.transport))
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        if not self.pool.ready:
            return ApiError(503, "no attention worker is ready yet", type_="service_unavailable").response()
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moe-fabric",
                "max_model_len": self.model.max_position}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"malformed JSON body: {exc}") from exc
            if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
                raise ApiError(404, f"model {body.get('model')!r} does not exist", "model", code="model_not_found")
            params = parse_completion(body, self.model.vocab_size, self.model.max_position)
            prompt_ids = self._prompt_ids(params)
            if len(prompt_ids) + params.max_tokens > self.model.max_position:
                raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context of {self.model.max_position}", "max_tokens")
            rid = f"cmpl-{uuid.uuid4().hex}"
            submit = Submit(rid, prompt_ids, params.max_tokens, params.temperature, params.top_p, params.top_k,
                            params.seed, list(self.model.eos_token_ids), params.ignore_eos, [])
            try:
                client, pending = await self.pool.submit(submit)
            except PeerDeadError as exc:
                raise ApiError(503, f"no attention worker available: {exc}", type_="service_unavailable") from exc
        except ApiError as err:
            return err.response()
        try:
            if params.stream:
                return await self._stream(request, params, rid, client, pending)
            return await self._whole(params, rid, pending)
        finally:
            await self.pool.abort(client, rid)  # a no-op once finished; frees the AW's blocks otherwise

    def _prompt_ids(self, params: CompletionParams) -> list[int]:
        if params.prompt_ids is not None:
            return params.prompt_ids
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send 'prompt' as a list of token ids", "prompt")
        ids = list(self.tokenizer.encode(params.prompt_text, add_special_tokens=False).ids)
        if not ids:
            raise ApiError(400, "prompt encodes to no tokens", "prompt")
        return ids

    def _detok(self) -> IncrementalDetokenizer | None:
        return IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None

    def _choice(self, text: str, ids: list[int], finish: str | None, params: CompletionParams) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if params.return_token_ids:
            choice["token_ids"] = ids
        return choice

    async def _whole(self, params: CompletionParams, rid: str, pending: Pending) -> web.Response:
        detok = self._detok()
        ids: list[int] = []
        text = []
        while True:
            ev = await pending.queue.get()
            if ev.error is not None:
                return ApiError(ev.status or 500, ev.error, type_="server_error").response()
            assert ev.token is not None
            ids.append(ev.token)
            if detok is not None:
                text.append(detok.add(ev.token))
            if ev.finish_reason is not None:
                break
        if detok is not None:
            text.append(detok.flush())
        body = {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": [self._choice("".join(text), ids, ev.finish_reason, params)],
            "usage": {"prompt_tokens": len(pending.submit.prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(pending.submit.prompt_ids) + len(ids)},
        }
        if params.return_token_ids:
            body["prompt_token_ids"] = pending.submit.prompt_ids
        return web.json_response(body)

    async def _stream(self, request: web.Request, params: CompletionParams, rid: str, client: AwClient, pending: Pending) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        detok = self._detok()
        created = int(time.time())

        async def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        while True:
            ev = await pending.queue.get()
            if ev.error is not None:
                await send({"error": {"message": ev.error, "type": "server_error", "param": None, "code": ev.status}})
                break
            assert ev.token is not None
            text = detok.add(ev.token) if detok is not None else ""
            if ev.finish_reason is not None and detok is not None:
                text += detok.flush()
            await send({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [self._choice(text, [ev.token], ev.finish_reason, params)]})
            if ev.finish_reason is not None:
                break
        await send("[DONE]")
        await resp.write_eof()
        return resp


async def serve(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    gw = Gateway(cfg)
    runner = web.AppRunner(gw.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    link = OrchestratorLink(*cfg.orchestrator_addr)
    wid = await link.connect(Register("gateway", os.getpid(), cfg.host, port, {"model": gw.model_name}))
    log.info("%s serving http://%s:%d/v1 (model %s)", wid, cfg.host, port, gw.model_name)
    try:
        while (msg := await link.next_message(stop)) is not None:
            if isinstance(msg, RoutingUpdate):
                await gw.pool.update(msg.workers)
        if link.closed.is_set() and not stop.is_set():
            log.error("%s lost the orchestrator; exiting", wid)
            mark_failed()
    finally:
        await gw.pool.close()
        await link.close()
        await runner.cleanup()
