"""Server-sent event streams that a client can resume, on any gateway.

Every event carries an `id:` that says where the stream stands:

    <request id>:<seed>:<c0>,<c1>,...[:u]

`ci` is how many events of choice i were sent. For chat, its role announcement is the first. `:u`
marks the usage event. The seed is in the id because a request without one got a random seed from
the gateway that first served it.

Ids go only to clients that speak SSE. Their request says `Accept: text/event-stream`, as SSE
clients do, or resumes with `Last-Event-ID`. Other clients read each line as `data: <JSON>` and
fail on any other line (vLLM's benchmark client does). They get the same events without ids.

A client whose stream broke re-sends the same request to the same endpoint with
`Last-Event-ID: <the last id it received>`. It gets exactly the events after it. The gateway
attaches to the AWs that still run the choices. If one no longer does, the gateway generates it
again with the same seed, which gives the same tokens. It replays the tokens the client has through
the detokeniser without sending them, and streams the rest.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.generation import Choice, Delta, GenerationError
from gateway.metrics import Metrics
from gateway.protocol import ApiError
from gateway.responses import Formatter

try:  # an event's JSON in compiled code: 0.7 µs a chunk where json.dumps takes 4.9 (compact, UTF-8 as vLLM's)
    from msgspec.json import Encoder

    _to_json: Callable[[Any], bytes] = Encoder().encode
except ImportError:  # pragma: no cover (msgspec is a dependency; an image with only the base packages)
    def _to_json(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

_RID = {True: re.compile(r"chatcmpl-[0-9a-f]{32}"), False: re.compile(r"cmpl-[0-9a-f]{32}")}
MAX_EVENTS = 1 << 20  # per choice: more than any context holds tokens


@dataclass
class Position:
    """Where a stream stands (see the module's docstring)."""

    rid: str
    seed: int
    counts: list[int]
    usage_sent: bool = False

    def event_id(self) -> str:
        return f"{self.rid}:{self.seed}:{','.join(map(str, self.counts))}" + (":u" if self.usage_sent else "")

    @classmethod
    def parse(cls, raw: str, chat: bool, n: int) -> Position:
        """Parses the position in a client's `Last-Event-ID`.

        Raises ApiError 400 if it is not one of this endpoint's.
        """
        parts = raw.strip().split(":")
        usage = len(parts) == 4 and parts[3] == "u"
        try:
            if len(parts) not in (3, 4) or (len(parts) == 4 and not usage) or not _RID[chat].fullmatch(parts[0]):
                raise ValueError
            seed = int(parts[1])
            counts = [int(c) for c in parts[2].split(",")]
            if not 0 <= seed < 1 << 64 or len(counts) != n or not all(0 <= c <= MAX_EVENTS for c in counts):
                raise ValueError
        except ValueError:
            raise ApiError(400, "Last-Event-ID is not an event id of this endpoint's streams for this request "
                                f"({n} choice{'s' if n > 1 else ''})", "Last-Event-ID") from None
        return cls(parts[0], seed, counts, usage)


async def stream(request: web.Request, fmt: Formatter, prompts: list[list[int]], choices: list[Choice],
                 gens: list[AsyncGenerator[Delta, None]], pos: Position, metrics: Metrics,
                 headers: dict[str, str]) -> web.StreamResponse:
    """Streams every choice's deltas, then usage and [DONE], each event with its id.

    The choices' deltas are merged as they come. On a resumed stream, events before `pos` are not
    sent again.
    """
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    chat = fmt.chat
    ids = "text/event-stream" in request.headers.get("Accept", "") or "Last-Event-ID" in request.headers

    async def send(obj: dict[str, Any] | str, with_id: bool = True) -> None:
        head = f"id: {pos.event_id()}\ndata: ".encode() if with_id and ids else b"data: "
        await resp.write(b"".join((head, obj.encode() if isinstance(obj, str) else _to_json(obj), b"\n\n")))

    if chat:
        for c in choices:
            if pos.counts[c.index] == 0:
                pos.counts[c.index] = 1
                await send(fmt.chunk(c.index, None, first=True))
    merged = _merged(gens)
    try:
        async for i, item in merged:
            if isinstance(item, GenerationError):
                metrics.errors.labels(str(item.status)).inc()
                await send({"error": {"message": str(item), "type": "server_error", "param": None,
                                      "code": item.status}})
                break
            pos.counts[i] = item.index + 1 + (1 if chat else 0)
            await send(fmt.chunk(i, item))
        else:
            if fmt.params.include_usage and not pos.usage_sent:
                pos.usage_sent = True
                await send(fmt.usage_chunk(sum(len(ids) for ids in prompts), choices))
        await send("[DONE]", with_id=False)
        await resp.write_eof()
    finally:
        await merged.aclose()
    return resp


async def _merged(gens: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[tuple[int, Delta | GenerationError], None]:
    """(choice, delta) as the choices make them, up to each one's end or its GenerationError.

    One choice (the usual request) is read in place: a token costs no hop through a task and a queue (two
    wake-ups of the loop). Closed early, it closes that choice's generator, as cancelling its pump would."""
    if len(gens) == 1:
        gen = gens[0]
        try:
            async for d in gen:
                yield 0, d
        except GenerationError as exc:
            yield 0, exc
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[tuple[int, Delta | GenerationError | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncGenerator[Delta, None]) -> None:
        try:
            async for d in gen:
                await queue.put((i, d))
            await queue.put((i, None))
        except GenerationError as exc:
            await queue.put((i, exc))

    pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        open_choices = len(gens)
        while open_choices:
            i, item = await queue.get()
            if item is None:
                open_choices -= 1
                continue
            yield i, item
    finally:
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
