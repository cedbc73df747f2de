"""Load-aware routing (FailSafe §3.1): the gateway's `least-work` AW choice vs plain `round-robin`.

The fabric runs the `tiny` mixtral demo model with 2 attention workers + 2 expert workers over tcp, once per
policy, alternating the two (order swapped every repeat) `--repeats` times in one process run; the table reports
medians over repeats. Both policies get the same seeded workload: `--requests` streaming `/v1/completions` with
token-id prompts, Poisson arrivals at `--rate` requests/s, `--tokens` greedy output tokens each (ignore_eos).

Skew pattern: request i has a long prompt (`--long` tokens) when i % 4 == 0, else a short one (`--short` tokens).
The gateway's round-robin sends request i to AW (i + 1) % 2, so every even index, and with it every long prompt
(0, 4, 8, ...), lands on the same AW while the other one serves only short prompts; least-work counts the
outstanding prefill + decode tokens per AW and spreads the long prompts. The warm-up sends an even number of
requests (2) so the round-robin parity is unchanged. Example (the full run):

    python bench/bench_routing.py --requests 64 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import percentile, scan_logs  # bench/ is on sys.path when run as a script

from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from launch.config import ServeConfig
from launch.local import Fabric, free_port

POLICIES = ("least-work", "round-robin")
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "tok_s")
Sample = dict[str, float]


def make_workload(n: int, short: int, long: int, vocab: int, rate: float, seed: int
                  ) -> tuple[list[list[int]], list[float]]:
    """Prompts (long when i % 4 == 0) and Poisson arrival offsets in seconds, both from `seed`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(long if i % 4 == 0 else short)] for i in range(n)]  # 0-2 special
    t, offsets = 0.0, []
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return prompts, offsets


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int,
                     delay: float, t0: float) -> Sample:
    """Waits until `t0 + delay`, then streams one completion; times are relative to its own send."""
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    sent = time.perf_counter()
    first, n = 0.0, 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and not n:
                first = time.perf_counter()
            n += len(ids)
    end = time.perf_counter()
    if n != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {n}")
    return {"sent": sent - t0, "ttft": first - sent, "e2e": end - sent, "end": end - t0, "prompt": len(prompt),
            "tokens": n}


async def run_workload(url: str, prompts: list[list[int]], offsets: list[float], tokens: int) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(stream_one(session, url, p, tokens, d, t0)
                                           for p, d in zip(prompts, offsets, strict=True))))


def summarize(samples: list[Sample]) -> Sample:
    ttft = [s["ttft"] * 1e3 for s in samples]
    e2e = [s["e2e"] * 1e3 for s in samples]
    wall = max(s["end"] for s in samples) - min(s["sent"] for s in samples)
    return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99), "e2e_p50_ms": percentile(e2e, 50),
            "e2e_p99_ms": percentile(e2e, 99), "tok_s": sum(s["tokens"] for s in samples) / wall, "wall_s": wall}


def run_policy(model: Path, policy: str, prompts: list[list[int]], offsets: list[float], tokens: int,
               log_root: str) -> list[Sample]:
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=2, gateways=1, transport="tcp",
                      port=free_port(), routing=policy, ready_timeout=300)  # one gateway: its round-robin order
    log_dir = tempfile.mkdtemp(prefix=f"fabric-{policy}-", dir=log_root)
    url = f"http://{cfg.host}:{cfg.port}/v1/completions"
    t = time.perf_counter()
    with Fabric(cfg, log_dir=log_dir):  # stops every child on exit, errors included
        print(f"  {policy}: ready in {time.perf_counter() - t:.1f}s (logs in {log_dir})", flush=True)
        asyncio.run(run_workload(url, [prompts[1], prompts[1]], [0.0, 0.0], tokens))  # warm-up: even count
        return asyncio.run(run_workload(url, prompts, offsets, tokens))


def table(rows: dict[str, Sample]) -> str:
    lines = ["| policy | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | output tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for policy, r in rows.items():
        lines.append(f"| {policy} | " + " | ".join(format(r[k], ".1f") for k in METRICS) + " |")
    return "\n".join(lines)


def plot(raw: dict[str, list[list[Sample]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, runs in raw.items():
        xs = sorted(s["ttft"] * 1e3 for run in runs for s in run)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, ms (log scale; all repeats pooled)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-tiny"))
    ap.add_argument("--out", type=Path, default=Path("bench/out/routing"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--short", type=int, default=16, help="tokens of a short prompt")
    ap.add_argument("--long", type=int, default=1200, help="tokens of a long prompt (every 4th request)")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    model = args.model_dir
    if not (model / "config.json").exists():
        print(f"writing the tiny demo model to {model} ...", flush=True)
        write_demo_model(model, arch="mixtral", seed=0, size="tiny")
    mcfg = ModelConfig.from_dir(model)
    prompts, offsets = make_workload(args.requests, args.short, args.long, mcfg.vocab_size, args.rate, args.seed)
    print(f"model {model}; {args.requests} requests, {sum(len(p) == args.long for p in prompts)} long; "
          f"load average {os.getloadavg()[0]:.2f} (other work on the machine skews every number)", flush=True)
    log_root = tempfile.mkdtemp(prefix="bench-routing-logs-")
    raw: dict[str, list[list[Sample]]] = {p: [] for p in POLICIES}
    per_run: dict[str, list[Sample]] = {p: [] for p in POLICIES}
    errors: list[str] = []
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", flush=True)
        for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            try:
                samples = run_policy(model, policy, prompts, offsets, args.tokens, log_root)
            except Exception as exc:  # keep the other policy's numbers; the table shows what ran
                errors.append(f"repeat {rep + 1} {policy}: {type(exc).__name__}: {exc}")
                print(f"  ERROR {errors[-1]}", flush=True)
                continue
            raw[policy].append(samples)
            per_run[policy].append(summarize(samples))
            s = per_run[policy][-1]
            print(f"  {policy}: TTFT p50 {s['ttft_p50_ms']:.1f} ms p99 {s['ttft_p99_ms']:.1f} ms, "
                  f"{s['tok_s']:.1f} tok/s", flush=True)
    rows = {p: {k: statistics.median(r[k] for r in runs) for k in METRICS} for p, runs in per_run.items() if runs}
    print(f"\n`{command}`\n")
    print(table(rows))
    notes = scan_logs(log_root)
    for line in errors + notes:
        print(f"note: {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": command, "args": {k: str(v) for k, v in vars(args).items()}, "model": str(model),
        "pattern": "long prompt when i % 4 == 0", "loadavg": os.getloadavg(), "rows": rows, "per_run": per_run,
        "raw": raw, "errors": errors, "log_notes": notes, "log_dir": log_root}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    png = args.out / "routing_ttft_cdf.png"
    plot(raw, png, f"TTFT by AW routing policy ({args.requests} requests, every 4th {args.long} tokens, "
                   f"{args.rate:g} req/s)")
    print(f"wrote {args.out / 'results.json'} and {png}")


if __name__ == "__main__":
    main()
