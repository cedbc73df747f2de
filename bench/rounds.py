"""One benchmark round against an OpenAI completions endpoint (the fabric's, vLLM's): seeded
token-id prompts, every stream at once, greedy, `ignore_eos`; tok/s, TTFT and time between tokens.
The benchmarks share it (`python bench/<script>.py`: bench/ is on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

import aiohttp
import torch
from common import percentile

from fabric.tls import Tls

Stats = dict[str, float]
T = TypeVar("T")


def in_turn(items: list[T], rep: int) -> list[T]:
    """`items` rotated by `rep`, so that across repeats each system of a side-by-side run takes each place in a
    round. The place biases a round on this VM: whichever of two trees ran second was ~5 % faster, either way round
    (docs/performance.md, 2026-11-28 afternoon)."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = torch.randint(3, vocab, (n, length), generator=gen).tolist()  # 0-2 are special
    return prompts


def summarize(n_tokens: int, wall: float, gaps: list[float], ttfts: list[float] | None = None,
              decode_gaps: list[float] | None = None) -> Stats:
    """`decode_gaps`: the gaps that start once every stream has its first token (no prompt left to
    prefill beside the decodes); all of them where streams start together (generate)."""
    decode_gaps = gaps if decode_gaps is None else decode_gaps
    return {"ttft_ms": statistics.median(ttfts) * 1e3 if ttfts else float("nan"), "tok_s": n_tokens / wall,
            "tbt_p50_ms": percentile(gaps, 50) * 1e3, "tbt_p99_ms": percentile(gaps, 99) * 1e3,
            "tbt_p99_decode_ms": percentile(decode_gaps, 99) * 1e3 if decode_gaps else float("nan"),
            "tokens": n_tokens, "wall_s": wall}


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int,
                     extra: dict | None = None) -> tuple[list[float], list[int]]:
    """One streaming completion (`extra`: more body fields); returns the arrival time of every
    token chunk and the token ids."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **(extra or {})}
    times: list[float] = []
    out: list[int] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids:
                times.append(now)
                out.extend(ids)
    return times, out


async def fabric_round(url: str, prompts: list[list[int]], tokens: int, tls: Tls | None = None,
                       extra: dict | None = None) -> Stats:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0, ssl=tls.client if tls is not None else True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(session, url, p, tokens, extra) for p in prompts))
    n = sum(len(ids) for _, ids in results)
    if n != len(prompts) * tokens:
        raise RuntimeError(f"expected {len(prompts) * tokens} tokens, got {n}")
    end = max(times[-1] for times, _ in results)
    pairs = [(a, b) for times, _ in results for a, b in zip(times, times[1:], strict=False)]
    all_first = max(times[0] for times, _ in results)  # every prompt prefilled
    return {**summarize(n, end - t0, [b - a for a, b in pairs], [times[0] - t0 for times, _ in results],
                        [b - a for a, b in pairs if a >= all_first]), "ids": [ids for _, ids in results]}


@contextlib.contextmanager
def closed_loop(url: str, prompts: list[list[int]], tokens: int) -> Iterator[None]:
    """Rounds of `prompts` (a stream each, `tokens` a stream) one after another, in a thread, while the block runs:
    the load a profiler or a counter measures. The fabric is warmed with a short round first."""
    asyncio.run(fabric_round(url, prompts, 16))
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            asyncio.run(fabric_round(url, prompts, tokens))

    runner = threading.Thread(target=load, name="closed-loop")
    runner.start()
    try:
        yield
    finally:
        stop.set()
        runner.join()
