"""The client side of the failure experiments.

It sends seeded streaming requests against the fabric and records the arrival time of every token.
Its client does what a robust one should when its stream breaks because its gateway died or hung.
It sends the same request again with `Last-Event-ID` and gets exactly the rest (gateway/streaming.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

RETRYABLE_STATUS = (429, 502, 503, 504)


@dataclass
class Stream:
    index: int
    prompt: list[int]
    arrival: float | None = None  # scheduled (open loop)
    submitted: float | None = None
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    attempts: int = 0
    resumes: int = 0  # times the client resumed the stream with Last-Event-ID
    last_event_id: str | None = None
    done: bool = False
    error: str | None = None
    finished_at: float | None = None


class Broken(Exception):
    """The stream broke off, at the connection or the gateway. Resume it."""


def say(tag: str, msg: str) -> None:
    print(f"[{tag}] {msg}", flush=True)


class Client:
    """Streams one request to completion, resuming it on any break.

    A stream with no event for `read_timeout` is given up on and resumed, as from a hung gateway.
    Past `deadline`, a request that is still not complete counts as hung."""

    def __init__(self, url: str, tokens: int, now: Callable[[], float], read_timeout: float = 10.0,
                 deadline: float = 120.0, resume: bool = True) -> None:
        self.url = url
        self.tokens = tokens
        self.now = now
        self.read_timeout = read_timeout
        self.deadline = deadline
        self.resume = resume

    def body(self, s: Stream) -> dict[str, object]:
        """The request as first sent; a resume sends it again, with Last-Event-ID.

        Without resumption, it is the prompt plus the tokens received, for the tokens still missing.
        (Restart-all's fresh fabric knows nothing of the request.)"""
        prompt, left = (s.prompt, self.tokens) if self.resume else (s.prompt + s.tokens, self.tokens - len(s.tokens))
        return {"prompt": prompt, "max_tokens": left, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}

    async def attempt(self, session: aiohttp.ClientSession, s: Stream, body: dict[str, object]) -> None:
        """One HTTP request. Returns when the stream is complete, raises Broken to resume it."""
        headers = {"Accept": "text/event-stream"}  # an SSE client gets event ids, to resume with
        if self.resume and s.last_event_id:
            headers["Last-Event-ID"] = s.last_event_id
        try:
            async with session.post(self.url, json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(sock_connect=5, sock_read=self.read_timeout)) as resp:
                if resp.status in RETRYABLE_STATUS:
                    raise Broken(f"HTTP {resp.status}")
                if resp.status != 200:
                    s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                pending_id = None
                async for raw in resp.content:
                    now = self.now()
                    line = raw.strip()
                    if line.startswith(b"id: "):
                        pending_id = line[4:].decode()
                        continue
                    if not line.startswith(b"data: "):
                        continue
                    if line[6:] == b"[DONE]":
                        s.done = True
                        s.finished_at = now
                        return
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        s.error = f"error event: {chunk['error'].get('message')}"
                        return
                    for choice in chunk.get("choices") or []:
                        for tok in choice.get("token_ids") or []:
                            s.tokens.append(tok)
                            s.times.append(now)
                    if pending_id is not None:
                        s.last_event_id = pending_id
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from exc
        raise Broken("the stream ended without [DONE]")

    async def run(self, session: aiohttp.ClientSession, s: Stream) -> None:
        s.submitted = self.now() if s.submitted is None else s.submitted
        started = time.monotonic()
        delay = 0.02
        while not s.done and s.error is None:
            if time.monotonic() - started > self.deadline:
                s.error = f"hung: not complete after {self.deadline:.0f} s"
                return
            s.attempts += 1
            try:
                await self.attempt(session, s, self.body(s))
                return
            except Broken:
                if len(s.tokens) >= self.tokens and not self.resume:
                    s.done = True  # every token arrived just before the stream broke
                    return
                s.resumes += 1 if s.last_event_id else 0
                await asyncio.sleep(delay)
                delay = min(0.5, delay * 2)


class Run:
    """One pass of a seeded workload.

    It is Poisson arrivals (`arrivals`), or a closed loop of `concurrency` streams for `duration`
    seconds, with at most `limit` requests."""

    def __init__(self, name: str, url: str, tokens: int, prompt: Callable[[int], list[int]], duration: float,
                 concurrency: int | None = None, arrivals: list[float] | None = None, limit: int | None = None,
                 resume: bool = True, read_timeout: float = 10.0, deadline: float = 120.0, tag: str = "run") -> None:
        self.name, self.prompt, self.duration, self.limit, self.tag = name, prompt, duration, limit, tag
        self.concurrency, self.arrivals = concurrency, arrivals or []
        self.client = Client(url, tokens, self.now, read_timeout, deadline, resume)
        self.streams: list[Stream] = []
        self.attempts: set[asyncio.Task[None]] = set()
        self.up = asyncio.Event()  # cleared while a restart-all tears the fabric down
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def request(self, session: aiohttp.ClientSession, s: Stream) -> None:
        while True:
            await self.up.wait()
            task = asyncio.create_task(self.client.run(session, s))
            self.attempts.add(task)
            try:
                await asyncio.wait({task})
            finally:
                self.attempts.discard(task)
                task.cancel()
            if task.cancelled():
                continue  # torn down by restart-all: sent again to the fresh fabric
            if task.exception() is not None:
                s.error = f"{type(task.exception()).__name__}: {task.exception()}"
            return

    async def open_loop(self, session: aiohttp.ClientSession, i: int, arrival: float) -> None:
        await asyncio.sleep(max(0.0, arrival - self.now()))
        s = Stream(i, self.prompt(i), arrival)
        self.streams.append(s)
        await self.request(session, s)

    async def closed_loop(self, session: aiohttp.ClientSession) -> None:
        while self.now() < self.duration and (self.limit is None or len(self.streams) < self.limit):
            s = Stream(len(self.streams), self.prompt(len(self.streams)))
            self.streams.append(s)
            await self.request(session, s)

    async def progress(self) -> None:
        last = 0
        while True:
            await asyncio.sleep(1.0)
            n = sum(len(s.tokens) for s in self.streams)
            done = sum(1 for s in self.streams if s.done or s.error)
            say(self.tag, f"{self.name}: t={self.now():5.1f} s  requests {done}/{len(self.streams)} done  "
                          f"tokens {n}  ({n - last} tok/s)")
            last = n

    async def run(self, *side: Coroutine[Any, Any, None]) -> None:
        """Runs the workload to its end, and `side` tasks (failure injection) beside it."""
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no keep-alive across a dead gateway
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self.t0 = time.perf_counter()
            self.up.set()
            if self.concurrency:
                tasks = [asyncio.create_task(self.closed_loop(session)) for _ in range(self.concurrency)]
            else:
                tasks = [asyncio.create_task(self.open_loop(session, i, a)) for i, a in enumerate(self.arrivals)]
            tasks += [asyncio.create_task(c) for c in side]
            ticker = asyncio.create_task(self.progress())
            try:
                done, pending = await asyncio.wait(tasks, timeout=self.duration + self.client.deadline + 60,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    exc = task.exception()
                    if exc is not None:
                        raise exc
                if pending:
                    say(self.tag, f"{self.name}: timed out; {len(pending)} tasks still waiting")
            finally:
                for task in [*tasks, ticker]:
                    task.cancel()
                await asyncio.gather(*tasks, ticker, return_exceptions=True)

    def lost(self, tokens: int) -> list[int]:
        return [s.index for s in self.streams if s.error or len(s.tokens) != tokens]
