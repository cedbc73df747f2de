"""The HTTP edge alone: C streams of server-sent events with no fabric behind them, paced as a fabric's steps would be.

A server process (aiohttp, as the gateway) streams to each of C streams one completion chunk a step, shaped as the
gateway's (`return_token_ids`); the benchmark's own client (bench/rounds.py) reads them. Each side's CPU a token says
what streaming tokens over HTTP costs on this machine before any attention worker, expert worker or checkpoint has
run: at a given pace, the cores the edge keeps busy are not the fabric's to use (bench/bench_fabric_cost.py).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import time

from machine import cpu_seconds
from rounds import fabric_round, make_prompts


def _edge_server(port_q: mp.Queue, step_s: float) -> None:
    from aiohttp import web

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tick: list[asyncio.Future[None]] = [loop.create_future()]

        async def ticker() -> None:
            """Every stream's next token at once, every `step_s` (on average: the loop's timers are whole ms)."""
            start, k = time.monotonic(), 0
            while True:
                k += 1
                await asyncio.sleep(max(0.0, start + k * step_s - time.monotonic()))
                fut, tick[0] = tick[0], loop.create_future()
                fut.set_result(None)

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            n, created = int(body["max_tokens"]), int(time.time())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for i in range(n):
                await tick[0]
                chunk = {"id": "cmpl-edge", "object": "text_completion", "created": created, "model": "edge",
                         "choices": [{"index": 0, "text": " x", "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None, "token_ids": [3 + i % 1000]}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(runner.addresses[0][1])
        await ticker()  # (until the benchmark kills this process)

    import uvloop

    uvloop.run(main())


def edge_round(streams: int, tokens: int, step_s: float, vocab: int, repeats: int = 3) -> dict[str, float]:
    """Median over `repeats` rounds: tok/s, and the server's and the client's CPU µs a token, streams paced at one
    token each every `step_s`."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_edge_server, args=(q, step_s), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{q.get(timeout=60)}/v1/completions"
        asyncio.run(fabric_round(url, make_prompts(streams, 16, vocab, 99), 16))  # warm
        runs = []
        for r in range(repeats):
            server, client = cpu_seconds([proc.pid]), time.process_time()
            st = asyncio.run(fabric_round(url, make_prompts(streams, 16, vocab, r), tokens))
            n = st["tokens"]
            runs.append({"tok_s": st["tok_s"], "server_us": (cpu_seconds([proc.pid]) - server) / n * 1e6,
                         "client_us": (time.process_time() - client) / n * 1e6})
    finally:
        proc.kill()
        proc.join(5)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
