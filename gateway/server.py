"""The gateway's HTTP side, the OpenAI-compatible API.

Per request: authenticate -> validate -> render (chat template) and tokenize -> one submit per
choice to the least-loaded AW -> relay tokens as text (incremental detokenisation, stop strings).
A stream resumed with Last-Event-ID attaches to the AWs that run it instead. When a stream's client
leaves, its AW keeps it for a resume. Other requests are aborted at once.

SIGTERM drains. New requests get 503, and running ones finish, bounded by the drain timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fabric.auth import bearer_ok
from fabric.config import GatewayConfig
from fabric.messages.client import Submit
from fabric.messages.control import ClusterView, Role
from fabric.model.config import ModelConfig
from gateway import structured
from gateway.aw_pool import AwPool
from gateway.chat_template import ChatTemplate, validate_messages
from gateway.generation import Choice, GenerationError, attach_choice, run_choice, start_choice
from gateway.metrics import Metrics
from gateway.protocol import (
    MAX_N,
    ApiError,
    GenParams,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)
from gateway.responses import Formatter
from gateway.streaming import Position, stream
from gateway.tokens import MAX_CHARS_PER_TOKEN, load_tokenizer, off_loop

log = logging.getLogger("gateway")

GATEWAY_HEADER = "X-Moe-Fabric-Gateway"  # which gateway process answered (several share the port)


class Gateway:
    def __init__(self, cfg: GatewayConfig, pool: AwPool) -> None:
        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model)
        self.model_name = cfg.served_model_name or Path(cfg.model).name
        self.tokenizer = load_tokenizer(cfg.model)
        self.chat_template = ChatTemplate.from_model_dir(cfg.model)
        self.pool = pool
        self.metrics = Metrics()
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # HTTP requests in flight (running or waiting)
        self.idle = asyncio.Event()
        self.idle.set()
        self.view: ClusterView | None = None
        self.worker_id = ""
        self.secret = cfg.secret
        self.tls = cfg.tls

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.guard])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """API key, draining, body cap, and OpenAI-shaped errors for the API paths.

        These are everything under /v1, and vLLM's /tokenize and /detokenize.
        """
        if not request.path.startswith("/v1/") and request.path not in ("/tokenize", "/detokenize"):
            return await handler(request)
        try:
            if self.cfg.api_key is not None:
                auth = request.headers.get("Authorization", "")
                given = auth[7:] if auth.startswith("Bearer ") else ""
                if not hmac.compare_digest(given.encode(), self.cfg.api_key.encode()):
                    raise ApiError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
            if self.draining:
                raise ApiError(503, "the server is shutting down", type_="service_unavailable", headers={"Retry-After": "1"})
            if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
                raise ApiError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", code="request_too_large")
            # Counted from here to the last byte, parsing and tokenising included. Drain waits for it.
            self.active += 1
            self.idle.clear()
            try:
                return await handler(request)
            finally:
                self.active -= 1
                if self.active == 0:
                    self.idle.set()
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
        table = self.view.table if self.view is not None else None
        if table is None:
            return "no routing table yet"
        lost = [u for u, ews in table.replicas.items() if not ews]
        if lost:
            return f"{len(lost)} logical experts have no live replica (e.g. layer {lost[0][0]} expert {lost[0][1]})"
        return None

    def _insider(self, request: web.Request) -> bool:
        """Whether the caller may see the cluster's details.

        It may with --public-metrics, with no secret, or with the cluster secret as Bearer.
        """
        return self.cfg.public_metrics or self.secret is None or \
            bearer_ok(request.headers.get("Authorization"), self.secret)

    async def health(self, request: web.Request) -> web.Response:
        """The status and code for anyone, e.g. a load balancer, and the details for insiders."""
        reason = "draining" if self.draining else self.unhealthy_reason()
        insider = self._insider(request)
        if reason:
            return web.json_response({"status": "unhealthy", **({"reason": reason} if insider else {})}, status=503)
        if not insider:
            return web.json_response({"status": "ok"})
        stores = len(self.view.serving(Role.STORE)) if self.view is not None else 0
        checkpointing = "on" if stores else "off: no live checkpoint store (an AW failure falls back to replay)"
        return web.json_response({"status": "ok", "checkpointing": checkpointing, "gateway": self.worker_id})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if not self._insider(request):
            raise web.HTTPUnauthorized(text="/metrics needs 'Authorization: Bearer <cluster secret>' "
                                            "(or a gateway started with --public-metrics)\n",
                                       headers={"WWW-Authenticate": "Bearer"})
        host, port = self.cfg.orchestrator_addr
        admin = {"Authorization": f"Bearer {self.secret.decode()}"} if self.secret else {}
        scheme, tls = ("https", self.tls.client) if self.tls is not None else ("http", None)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s, \
                    s.get(f"{scheme}://{host}:{port}/cluster", headers=admin, ssl=tls if tls else True) as r:
                self.metrics.update_cluster(await r.json())
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("metrics: cluster view unavailable: %s", exc)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _body(self, request: web.Request) -> Any:
        """The JSON body.

        Only JSON is taken. A form or text/plain post from any web page is refused. A malformed body
        (nesting, huge numbers) is a 400, never a 500.
        """
        if request.content_type != "application/json":
            raise ApiError(415, f"the body must be application/json, not {request.content_type or 'untyped'}",
                           code="unsupported_media_type")
        raw = await request.read()
        return await off_loop(lambda: parse_json(raw), len(raw))

    def _check_model(self, body: Any) -> None:
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            raise ApiError(404, f"the model {body.get('model')!r} does not exist", "model", code="model_not_found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        params = parse_completion(body, self.model.vocab_size, self.model.max_position)
        params = dataclasses.replace(params, **await self._structured(body, chat=False))
        return await self._generate(request, params, chat=False)

    async def _structured(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        return await structured.fields(body, chat, self.cfg.model, self.model.vocab_size,
                                       list(self.model.eos_token_ids))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._check_model(body)
        raw_messages, fields = parse_chat(body, self.model.vocab_size, self.model.max_position)
        messages = validate_messages(raw_messages)
        if self.chat_template is None or self.tokenizer is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        template = self.chat_template
        text = await off_loop(lambda: template.render(messages), sum(len(str(m)) for m in messages))
        params = GenParams(prompts=((None, text),), **fields, **await self._structured(body, chat=True))
        return await self._generate(request, params, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize` (a prompt, or chat messages through the chat template)."""
        body = await self._body(request)
        self._check_model(body)
        text, messages, special = parse_tokenize(body)
        tok = self._tokenizer()
        if text is None:
            checked = validate_messages(messages)
            if self.chat_template is None:
                raise ApiError(400, "this model has no chat template", "messages")
            template = self.chat_template
            text = await off_loop(lambda: template.render(checked), sum(len(str(m)) for m in checked))
        prompt = text
        self._fits([prompt], "prompt")
        ids = await off_loop(lambda: list(tok.encode_batch([prompt], add_special_tokens=special)[0].ids), len(prompt))
        return web.json_response({"count": len(ids), "max_model_len": self.model.max_position, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /detokenize`."""
        body = await self._body(request)
        self._check_model(body)
        ids = parse_detokenize(body, self.model.vocab_size)
        tok = self._tokenizer()
        text = await off_loop(lambda: tok.decode(ids, skip_special_tokens=False), len(ids))
        return web.json_response({"prompt": text})

    def _fits(self, texts: list[str], param: str) -> None:
        """Refuses, before tokenizing, a text far too long to fit the context in any tokenization."""
        limit = self.model.max_position * MAX_CHARS_PER_TOKEN
        for text in texts:
            if len(text) > limit:
                raise ApiError(400, f"the {param} ({len(text)} characters) cannot fit the context of "
                                    f"{self.model.max_position} tokens", param)

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return self.tokenizer

    async def _prompt_ids(self, params: GenParams) -> list[list[int]]:
        """Every prompt's token ids.

        The texts are tokenized together, off the loop when large.
        """
        texts = [text for ids, text in params.prompts if ids is None and text is not None]
        if texts and self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send 'prompt' as a list of token ids", "prompt")
        self._fits(texts, "prompt")
        encoded: list[list[int]] = []
        if texts:
            tok = self.tokenizer
            # encode_batch, not encode. Only the batch call lets go of the GIL while it works. A 6 MiB
            # prompt held the event loop for 5 s through `encode`, even from another thread.
            encoded = await off_loop(lambda: [list(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)],
                                      sum(len(t) for t in texts))
        it = iter(encoded)
        out = [ids if ids is not None else next(it) for ids, _ in params.prompts]
        if any(not ids for ids in out):
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        return out

    def _position(self, request: web.Request, params: GenParams, chat: bool) -> Position | None:
        """The stream position a resuming client sent (`Last-Event-ID`), or None for a new request."""
        raw = request.headers.get("Last-Event-ID")
        if raw is None:
            return None
        if not params.stream:
            raise ApiError(400, "Last-Event-ID resumes a stream: send 'stream': true", "Last-Event-ID")
        pos = Position.parse(raw, chat, params.choices)
        if params.seed_given and params.seed % (1 << 64) != pos.seed:
            raise ApiError(400, "Last-Event-ID belongs to a request with another seed", "Last-Event-ID")
        return pos

    async def _generate(self, request: web.Request, params: GenParams, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        pos = self._position(request, params, chat)
        prompts = await self._prompt_ids(params)
        context = self.model.max_position
        longest = max(len(ids) for ids in prompts)
        max_tokens = params.max_tokens if params.max_tokens is not None else context - longest
        # Pure scoring (echo). The prefill runs and its one token is dropped.
        if params.max_tokens == 0:
            max_tokens = 1
        if max_tokens < 1 or longest + max_tokens > context:
            raise ApiError(400, f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds "
                           f"the context of {context} tokens", "max_tokens")
        total = params.choices
        if self.metrics.n_waiting + total > self.cfg.max_waiting:
            raise ApiError(429, f"more than {self.cfg.max_waiting} requests are waiting", type_="rate_limit_error",
                           headers={"Retry-After": "1"})
        origin = request.remote or "?"
        share = max(MAX_N, self.cfg.max_waiting // 2)  # one client never holds more than half the queue
        if self.metrics.waiting_by_origin.get(origin, 0) + total > share:
            raise ApiError(429, f"this client has {self.metrics.waiting_by_origin[origin]} choices waiting; one client "
                           f"may have at most {share}", type_="rate_limit_error", headers={"Retry-After": "1"})
        if pos is None:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            pos = Position(rid, params.seed % (1 << 64), [0] * total)
        grace = self.cfg.stream_resume_grace_s if params.stream else 0.0
        choices = [Choice(i, f"{pos.rid}-{i}", Submit(
            request_id=f"{pos.rid}-{i}", prompt_ids=prompts[i // params.n], max_tokens=max_tokens,
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=(pos.seed + i) % (1 << 64),
            stop_token_ids=list(self.model.eos_token_ids), ignore_eos=params.ignore_eos, output_ids=[],
            logprobs=params.logprobs, resume_grace_s=grace, prompt_logprobs=params.scores,
            constraint=params.constraint),
            resumable=grace > 0, origin=origin) for i in range(total)]
        skips = [max(0, c - (1 if chat else 0)) for c in pos.counts]
        resumed = any(pos.counts)
        fmt = Formatter(chat, pos.rid, int(time.time()), self.model_name, params, self.tokenizer, prompts)
        headers = {GATEWAY_HEADER: self.worker_id}
        if pos.usage_sent:  # the client has everything but [DONE]
            return await stream(request, fmt, prompts, [], [], pos, self.metrics, headers)
        self.metrics.prompt.inc(sum(len(ids) for ids in prompts) * params.n)
        gens: list[Any] = []
        try:
            for c in choices:
                if resumed:
                    await attach_choice(self.pool, c, self.cfg.resume_wait_s)
                else:
                    await start_choice(self.pool, c)
            gens = [run_choice(self.pool, c, params, self.tokenizer, self.metrics, arrived, skip,
                               self.cfg.resume_wait_s) for c, skip in zip(choices, skips)]
            if params.stream:
                return await stream(request, fmt, prompts, choices, gens, pos, self.metrics, headers)
            return await self._whole(fmt, prompts, choices, gens, headers)
        finally:
            for g in gens:
                # Detaches (a stream's client left) or aborts unfinished choices.
                await g.aclose()
            # Choices submitted but never iterated, as a later submit failed. A no-op for the others.
            for c in choices:
                if c.client is not None and not c.aw_done:
                    await self.pool.abort(c.client, c.request_id, c.pending)
            self.metrics.e2e.observe(time.monotonic() - arrived)

    async def _whole(self, fmt: Formatter, prompts: list[list[int]], choices: list[Choice], gens: list[Any],
                     headers: dict[str, str]) -> web.Response:
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
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        body = fmt.whole(choices, [t for t, _ in results], [lp for _, lp in results])
        return web.json_response(body, headers=headers)

    async def drain(self) -> None:
        self.draining = True
        log.info("draining: %d requests in flight", self.active)
        # Nothing to wait for. wait_for with timeout 0 would time out anyway.
        if self.idle.is_set():
            return
        try:
            await asyncio.wait_for(self.idle.wait(), self.cfg.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout: %d requests still in flight", self.active)
