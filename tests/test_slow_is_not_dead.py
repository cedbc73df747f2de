"""Slow is not dead, with the default flags: a worker whose steps take seconds (the test hook: a
2 s first step, 300 ms steps after it, as a GPU's cold first step and a slow device look from
outside), and a worker frozen for 300 ms every 1.5 s (SIGSTOP, SIGCONT: a GC pause, a page-fault
storm), are never declared dead, never replaced, and every stream comes out token-identical."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from fabric.faults import SLOW_ENV
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.load import run_streams
from tests.test_parity import assert_matches, reference, run_requests


def nobody_declared_dead(fabric: Fabric) -> None:
    cluster = fabric.cluster()
    assert [w["id"] for w in cluster["workers"] if w["state"] == "dead"] == []
    assert cluster["replacements_started"] == 0


@pytest.mark.parametrize("victim", ["attention-worker-0", "expert-worker-1"])
def test_a_slow_worker_serves_token_identical_and_nobody_is_declared_dead(victim: str, hf_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    rng = random.Random(34)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice([3, 9, 17]))] for _ in range(16)]
    lengths = [rng.randrange(4, 9) for _ in prompts]
    model = hf_models["mixtral"]
    expected = reference(model, prompts, lengths)
    with running_fabric(model, tmp_path, aws=2, ews=3, env={victim: {SLOW_ENV: "2000,300"}}) as fabric:
        got = run_requests(f"http://127.0.0.1:{fabric.port}", prompts, lengths)
        nobody_declared_dead(fabric)
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(tokens, want, logits, f"request {i}")
    log = (tmp_path / "logs" / f"{victim}.log").read_text()
    assert "fault injection on: the first step takes 2000 ms longer" in log


def pause_repeatedly(pid: int, stop: threading.Event, pause: float = 0.3, every: float = 1.5) -> int:
    """SIGSTOP for `pause` s every `every` s until `stop`; returns how many pauses."""
    n = 0
    while not stop.wait(every - pause):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)
        n += 1
    return n


def test_pauses_are_not_deaths(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """An AW, then an EW, frozen for 300 ms every 1.5 s for 20 s while 8 streams decode."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        reference_streams = run_streams(fabric)
        for victim in ("attention-worker-1", "expert-worker-1"):
            pid = fabric.pid(victim)
            stop = threading.Event()
            paused: list[int] = []
            pauser = threading.Thread(target=lambda p=pid, s=stop, out=paused: out.append(pause_repeatedly(p, s)))
            pauser.start()
            deadline = time.monotonic() + 20
            rounds = 0
            try:
                while time.monotonic() < deadline:
                    assert run_streams(fabric) == reference_streams, f"round {rounds} under {victim}'s pauses"
                    rounds += 1
            finally:
                stop.set()
                pauser.join()
                os.kill(pid, signal.SIGCONT)
            assert paused[0] >= 10 and rounds >= 2
            assert fabric.pid(victim) == pid  # never replaced
            nobody_declared_dead(fabric)
