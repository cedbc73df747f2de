"""The client side of the failover experiment: one pass of the seeded workload against the fabric,
recording the arrival time of every token, and (for the failure run) the SIGINT and restart-all."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabric.errors import FabricError

if TYPE_CHECKING:
    import subprocess

    import aiohttp

    from fabric.experiments.failover import Experiment

VICTIMS = {"expert": "expert-worker-1", "attention": "attention-worker-0"}


@dataclass
class Stream:
    index: int
    prompt: list[int]
    arrival: float | None = None  # scheduled (open loop)
    submitted: float | None = None
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    attempts: int = 0
    error: str | None = None


def say(msg: str) -> None:
    print(f"[failover] {msg}", flush=True)


class Run:
    """One pass of the workload; with `kill_at`, the failure injection (and restart-all, if asked)."""

    def __init__(self, exp: Experiment, name: str, limit: int | None = None, kill_at: float | None = None) -> None:
        self.exp, self.name, self.limit, self.kill_at = exp, name, limit, kill_at
        self.streams: list[Stream] = []
        self.attempts: set[asyncio.Task[None]] = set()
        self.up = asyncio.Event()
        self.up.set()
        self.t0 = 0.0
        self.kill: float | None = None
        self.ready: float | None = None
        self.victim_pid: int | None = None
        self.kill_wall: float | None = None  # time.time() of the kill, to compare with the orchestrator's clock
        self.gone: float | None = None  # when the victim's process had exited (SIGSTOP: it stays)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def attempt(self, session: aiohttp.ClientSession, s: Stream) -> None:
        left = self.exp.args.tokens - len(s.tokens)
        body = {"prompt": s.prompt + s.tokens, "max_tokens": left, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        async with session.post(self.exp.url, json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                now = self.now()
                line = raw.strip()
                if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = f"error event: {chunk['error'].get('message')}"
                    return
                for tok in chunk["choices"][0].get("token_ids") or []:
                    s.tokens.append(tok)
                    s.times.append(now)

    async def request(self, session: aiohttp.ClientSession, s: Stream) -> None:
        while True:
            await self.up.wait()
            if len(s.tokens) >= self.exp.args.tokens:
                return  # every token arrived just before a restart-all tore the stream down
            s.attempts += 1
            s.submitted = self.now() if s.submitted is None else s.submitted
            task = asyncio.create_task(self.attempt(session, s))
            self.attempts.add(task)
            try:
                await asyncio.wait({task})
            finally:
                self.attempts.discard(task)
                task.cancel()
            if task.cancelled():
                continue  # torn down by restart-all: resubmit the rest on the fresh fabric
            if task.exception() is not None:
                s.error = f"{type(task.exception()).__name__}: {task.exception()}"
            return

    async def open_loop(self, session: aiohttp.ClientSession, i: int, arrival: float) -> None:
        await asyncio.sleep(max(0.0, arrival - self.now()))
        s = Stream(i, self.exp.prompt(i), arrival)
        self.streams.append(s)
        await self.request(session, s)

    async def closed_loop(self, session: aiohttp.ClientSession) -> None:
        while self.now() < self.exp.args.duration and (self.limit is None or len(self.streams) < self.limit):
            s = Stream(len(self.streams), self.exp.prompt(len(self.streams)))
            self.streams.append(s)
            await self.request(session, s)

    async def inject(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - self.now()))
        name = VICTIMS[self.exp.args.role]
        victim = next(p for n, p in self.exp.fabric.procs if n == name)
        sig = signal.Signals[f"SIG{self.exp.args.signal}"]
        victim.send_signal(sig)
        self.kill, self.victim_pid, self.kill_wall = self.now(), victim.pid, time.time()
        say(f"{self.name}: t={self.kill:.2f} s {sig.name} {name} (pid {victim.pid}), "
            f"{sum(len(s.tokens) for s in self.streams)} tokens so far")
        watch = asyncio.create_task(self.watch_exit(victim)) if sig != signal.SIGSTOP else None
        if self.exp.args.mode == "restart-all":
            self.up.clear()
            for task in list(self.attempts):
                task.cancel()
            await asyncio.get_running_loop().run_in_executor(self.exp.spawner, self.exp.restart)
            self.ready = self.now()
            say(f"{self.name}: t={self.ready:.2f} s fresh fabric ready; resubmitting unfinished requests")
            self.up.set()
        if watch is not None:
            await watch

    async def watch_exit(self, victim: subprocess.Popen[bytes]) -> None:
        """Records when the victim's process is gone (polled every 2 ms, for at most 10 s)."""
        deadline = self.now() + 10.0
        while victim.poll() is None and self.now() < deadline:
            await asyncio.sleep(0.002)
        if victim.poll() is not None:
            self.gone = self.now()

    async def progress(self) -> None:
        last = 0
        while True:
            await asyncio.sleep(1.0)
            n = sum(len(s.tokens) for s in self.streams)
            done = sum(1 for s in self.streams if len(s.tokens) == self.exp.args.tokens or s.error)
            say(f"{self.name}: t={self.now():5.1f} s  requests {done}/{len(self.streams)} done  "
                f"tokens {n}  ({n - last} tok/s)")
            last = n

    async def run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no keep-alive across a restart
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.t0 = time.perf_counter()
            args = self.exp.args
            if args.concurrency:
                tasks = [asyncio.create_task(self.closed_loop(session)) for _ in range(args.concurrency)]
            else:
                tasks = [asyncio.create_task(self.open_loop(session, i, a))
                         for i, a in enumerate(self.exp.arrivals())]
            if self.kill_at is not None:
                tasks.append(asyncio.create_task(self.inject(self.kill_at)))
            ticker = asyncio.create_task(self.progress())
            try:
                done, pending = await asyncio.wait(tasks, timeout=args.duration + 300,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    exc = task.exception()
                    if exc is not None:
                        raise exc
                if pending:
                    say(f"{self.name}: timed out; {len(pending)} tasks still waiting")
            finally:
                for task in [*tasks, ticker]:
                    task.cancel()
                await asyncio.gather(*tasks, ticker, return_exceptions=True)
        if self.kill_at is not None and self.kill is None:
            raise FabricError(f"the {self.name} ended before the kill at {self.kill_at} s; raise --duration")
