"""A gateway dies (SIGKILL) with two gateways on one port and 8 streams in flight: streams on the
other gateway go on untouched, the dead one's clients resume with Last-Event-ID and get exactly
the rest of their streams, new requests succeed throughout, and the supervisor starts the dead
gateway again."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from pathlib import Path

from tests.conftest import running_fabric
from tests.helpers import poll_until, post_json, resumable_stream, wait_for
from tests.load import BODY, PROMPTS, wait_gone

LONG = {**BODY, "max_tokens": 400}  # still decoding well after the kill, however fast the machine
SETTLE_S = 0.2  # after the victim is gone, new requests must all succeed from this on (see below)


def test_gateway_death_costs_only_its_connections(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2, gateways=2) as fabric:
        url = f"http://127.0.0.1:{fabric.port}/v1/completions"

        def streams(results: list, served: list[list[str]]) -> list[threading.Thread]:
            def one(i: int) -> None:
                events, resumes = resumable_stream(url, {**LONG, "prompt": PROMPTS[i]}, served_by=served[i])
                results[i] = ([t for e in events for t in e["choices"][0]["token_ids"]], resumes, served[i])
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            return threads

        reference: list = [None] * len(PROMPTS)
        for t in streams(reference, [[] for _ in PROMPTS]):
            t.join(120)

        # New requests, one after another, all along.
        new: list[tuple[float, int, int]] = []  # (start, status, tokens)
        stop = threading.Event()

        def newcomer() -> None:
            while not stop.is_set():
                t0 = time.time()
                try:
                    status, body = post_json(url, {"prompt": [9, 9, 9], "max_tokens": 4, "temperature": 0})
                except (OSError, http.client.HTTPException):  # in flight on the gateway that died
                    status, body = -1, {}
                new.append((t0, status, body.get("usage", {}).get("completion_tokens", 0)))

        results: list = [None] * len(PROMPTS)
        served: list[list[str]] = [[] for _ in PROMPTS]
        threads = streams(results, served)
        feeder = threading.Thread(target=newcomer)
        feeder.start()
        gateways = {w["id"]: w["pid"] for w in fabric.cluster()["workers"] if w["role"] == "gateway"}
        assert poll_until(lambda: all(served))  # every stream admitted, and decoding: 400 tokens to go
        first = [s[0] for s in served if s]
        victim = max(gateways, key=first.count)  # the gateway that serves the most streams
        old_pid = gateways[victim]
        os.kill(old_pid, signal.SIGKILL)
        wait_gone(old_pid, 10)
        gone_wall = time.time()  # its sockets are closed: every connection from now on reaches a live gateway
        for t in threads:
            t.join(120)
        wait_for(fabric, "the dead gateway started again", lambda c: sum(
            w["role"] == "gateway" and w["state"] == "alive" for w in c["workers"]) == 2)
        back = time.time()
        assert poll_until(lambda: sum(t0 > back for t0, _, _ in new) >= 5)  # new requests after the restart
        stop.set()
        feeder.join(60)

        assert [r[0] for r in results] == [r[0] for r in reference]  # every stream token-identical
        on_victim = [r for r in results if r[2][0] == victim]
        on_other = [r for r in results if r[2][0] != victim]
        assert on_victim, "no stream was on the victim"
        assert all(r[1] >= 1 and victim not in r[2][1:] for r in on_victim)  # resumed on another gateway
        assert all(r[1] == 0 for r in on_other)  # untouched
        # From a moment after its death on, every new connection reaches a live gateway. (In the
        # first instants a connection can still be reset: seen up to ~20 ms after the dead
        # process's files were closed, on 1 run in ~5, on the shared port's kernel side.)
        after = [(s, n) for t0, s, n in new if t0 > gone_wall + SETTLE_S]
        assert len(after) >= 5 and all(s == 200 and n == 4 for s, n in after), after
        assert all(p.pid != old_pid for n, p in fabric.procs if n.startswith("gateway"))
        assert all(p.poll() is None for n, p in fabric.procs if n.startswith("gateway"))
