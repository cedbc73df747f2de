"""Timestamps of the data path's events, for bench/trace_datapath.py; off unless MOE_FABRIC_TRACE names a directory.

An AW stamps each expert call as it posts it (`post`, `posted`), each result as its read callback takes it
(`result`), and its step as it resumes after a layer's results (`resumed`); an EW stamps each call as its read
callback takes it (`arrive`), as its batch starts and ends (`run`, `ran`), and as its result goes (`sent`). An event
is (CLOCK_MONOTONIC ns, kind, AW id, call id): the clock is one for every process of a host, so one call's events
line up across the AW and the EW that served it. Off, a stamp is one test of a global.

A process appends its events to `<dir>/<role>-<pid>.trace` (msgpack arrays) every `FLUSH_EVERY` events and as it
exits (fabric/process.py).
"""

from __future__ import annotations

import os
import time

import msgpack

ENV = "MOE_FABRIC_TRACE"
FLUSH_EVERY = 20_000

_events: list[tuple[int, str, str, int]] | None = None
_path = ""


def start(name: str) -> None:
    """Turns stamping on in this process where the environment asks for it (a role process, once)."""
    global _events, _path
    where = os.environ.get(ENV)
    if where:
        _events, _path = [], os.path.join(where, f"{name}-{os.getpid()}.trace")


def stamp(kind: str, aw: str, call: int) -> None:
    if _events is not None:
        _events.append((time.monotonic_ns(), kind, aw, call))
        if len(_events) >= FLUSH_EVERY:
            flush()


def flush() -> None:
    if _events:
        with open(_path, "ab") as f:
            f.write(msgpack.packb(_events))
        _events.clear()


def read(path: str) -> list[tuple[int, str, str, int]]:
    """A trace file's events, in the order they were stamped."""
    out: list[tuple[int, str, str, int]] = []
    with open(path, "rb") as f:
        for chunk in msgpack.Unpacker(f, raw=False):
            out.extend((int(t), str(k), str(a), int(c)) for t, k, a, c in chunk)
    return out
