"""Load for failure tests: concurrent seeded streams, run once for reference and once while a
worker gets a signal mid-decode."""

from __future__ import annotations

import os
import signal
import threading
import time

from fabric.config import AttentionWorkerConfig
from launch.local import Fabric
from tests.helpers import iter_stream

PROMPTS = [[3 + i, 40 + i, 7, 99 - i] for i in range(8)]
TOKENS = 120
# `decoding` waits until every stream has this many tokens. An AW's checkpointed frontier trails its live one by up
# to the steps a checkpoint message holds (attention_worker/held_steps.py), more while that message waits for an idle
# gap; twice that, each request has KV at the store, whichever AW it runs on and however far the other's streams are.
DECODING_TOKENS = 2 * AttentionWorkerConfig.checkpoint_steps_per_message


BODY = {"max_tokens": TOKENS, "temperature": 0.8, "seed": 11, "ignore_eos": True, "return_token_ids": True}


def run_streams(fabric: Fabric, received: list[int] | None = None, decoding: threading.Event | None = None,
                times: list[list[float]] | None = None, body: dict[str, object] | None = None) -> list[list[int]]:
    """One concurrent stream per prompt, seeded sampling; returns each stream's token ids.
    `received[0]` counts tokens as they arrive; `decoding` is set once every stream is DECODING_TOKENS in (or over);
    `times[i]` gets the wall-clock arrival time of each of stream i's tokens; `body` replaces BODY."""
    base = f"http://127.0.0.1:{fabric.port}/v1/completions"
    count = received if received is not None else [0]
    out: list[list[int]] = [[] for _ in PROMPTS]
    ended = [False for _ in PROMPTS]

    def tell_decoding() -> None:
        if decoding is not None and all(e or len(o) >= DECODING_TOKENS for o, e in zip(out, ended, strict=True)):
            decoding.set()

    def one(i: int) -> None:
        try:
            for ev in iter_stream(base, {**(body or BODY), "prompt": PROMPTS[i]}):
                assert "error" not in ev, ev
                out[i].extend(ev["choices"][0]["token_ids"])
                if times is not None:
                    times[i].append(time.time())
                count[0] += 1
                tell_decoding()
        finally:
            ended[i] = True
            tell_decoding()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def kill_mid_decode(fabric: Fabric, victim: str | int, sig: signal.Signals = signal.SIGINT,
                    reference: list[list[int]] | None = None, times: list[list[float]] | None = None,
                    body: dict[str, object] | None = None) -> tuple[list[list[int]], list[list[int]], int]:
    """Runs the streams once without failure (unless `reference` is given), then again while
    sending `sig` (SIGINT by default) to `victim` (a supervised process's name, or any pid) once
    tokens flow. Returns (reference, outputs under failure, victim pid). `body` replaces BODY."""
    if reference is None:
        reference = run_streams(fabric, body=body)
    assert all(len(r) == TOKENS for r in reference) if body is None else all(reference)
    pid = next(p.pid for name, p in fabric.procs if name == victim) if isinstance(victim, str) else victim
    received = [0]
    started = threading.Event()
    result: list[list[list[int]]] = []
    runner = threading.Thread(target=lambda: result.append(run_streams(fabric, received, started, times, body)))
    runner.start()
    assert started.wait(60)
    os.kill(pid, sig)
    at_kill = received[0]
    runner.join(180)
    assert at_kill < len(PROMPTS) * TOKENS, "the streams ended before the kill"
    assert result
    if sig in (signal.SIGINT, signal.SIGKILL):
        wait_gone(pid, 10)
    return reference, result[0], pid


def wait_gone(pid: int, timeout: float) -> None:
    """Waits until `pid` has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} is still running"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, or dying with its files still open: a multi-threaded process's main thread is a
    zombie while its other threads exit, and its sockets (a listener on a shared port) stay open
    until the last one has; a connection made then is reset."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        return bool(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return False



