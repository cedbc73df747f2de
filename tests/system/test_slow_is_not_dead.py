"""Slow is not dead, with the default flags: a worker whose steps take seconds (the test hook: a
2 s first step, 300 ms steps after it, as a GPU's cold first step and a slow device look from
outside), and a worker frozen for 300 ms every 1.5 s (SIGSTOP, SIGCONT: a GC pause, a page-fault
storm), are never declared dead, never replaced, and every stream comes out token-identical. A
step that never ends (a wedged device) is not slowness: the worker's watchdog ends it."""

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
from tests.starve import pinned_to_cpu0, spinner_on_cpu0
from tests.system.test_parity import assert_matches, reference, run_requests


def nobody_declared_dead(fabric: Fabric) -> None:
    cluster = fabric.cluster()
    assert [w["id"] for w in cluster["workers"] if w["state"] == "dead"] == []
    assert cluster["replacements_started"] == 0


def suspicions_of(worker_id: str, logs: Path) -> list[str]:
    """Log lines in which a peer routed around `worker_id` (an AW's EW unreachable, a gateway's AW hung)."""
    return [line for f in sorted(logs.glob("*.log")) for line in f.read_text(errors="replace").splitlines()
            if f"{worker_id} is unreachable" in line or f"{worker_id} is hung" in line]


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
        worker_id = next(w["id"] for w in fabric.cluster()["workers"] if w["pid"] == fabric.pid(victim))
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(tokens, want, logits, f"request {i}")
    log = (tmp_path / "logs" / f"{victim}.log").read_text()
    assert "fault injection on: the first step takes 2000 ms longer" in log
    # Not even suspected: its control port answered throughout, and an EW whose batch outlasts the
    # send deadline said it held the AW's calls.
    assert suspicions_of(worker_id, tmp_path / "logs") == []


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


def test_a_wedged_step_ends_the_worker(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """An EW whose first batch never ends (the hook: 10 minutes) answers probes all the while, and
    says it holds the calls: its AWs wait. Its watchdog ends it after `--step-timeout-s` (3 s here,
    60 by default), its AWs replay the calls elsewhere, and every request completes token-identical."""
    rng = random.Random(35)
    prompts = [[rng.randrange(3, 256) for _ in range(5)] for _ in range(6)]
    lengths = [6] * len(prompts)
    model = hf_models["mixtral"]
    expected = reference(model, prompts, lengths)
    victim = "expert-worker-1"
    with running_fabric(model, tmp_path, aws=2, ews=3, env={victim: {SLOW_ENV: "600000,0"}},
                        extra={victim: ["--step-timeout-s", "3"]}) as fabric:
        pid = fabric.pid(victim)
        got = run_requests(f"http://127.0.0.1:{fabric.port}", prompts, lengths)
        dead = [w["pid"] for w in fabric.cluster()["workers"] if w["state"] == "dead"]
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(tokens, want, logits, f"request {i}")
    log = (tmp_path / "logs" / f"{victim}.log").read_text()
    assert "the data plane's loop has not turned for" in log and "a compute call under way" in log
    assert dead == [pid]  # that EW, and nobody else
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("victim", ["attention-worker-1"])
def test_a_starved_worker_is_not_declared_dead(victim: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    """A worker kept off the CPU for 3 s, four leases, while streams decode: its heartbeats stop (a second at a
    time), but its process waited on a run queue all the while. The orchestrator, on the same machine, sees that and
    does not declare it dead; its peers route around it meanwhile, and every stream comes out token-identical."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        reference_streams = run_streams(fabric)
        pid = fabric.pid(victim)
        got: list[list[list[int]]] = []
        streams = threading.Thread(target=lambda: got.append(run_streams(fabric)))
        with pinned_to_cpu0(pid), spinner_on_cpu0():
            streams.start()
            time.sleep(3.0)  # (how long the worker is kept off its CPU)
        streams.join()
        assert got == [reference_streams]
        assert run_streams(fabric) == reference_streams
        assert fabric.pid(victim) == pid  # never replaced
        nobody_declared_dead(fabric)
        worker_id = next(w["id"] for w in fabric.cluster()["workers"] if w["pid"] == pid)
    log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"{worker_id} was silent" in log and "waited for a CPU" in log
    own = (tmp_path / "logs" / f"{victim}.log").read_text()
    assert "held up" in own and "it waited for a CPU" in own  # its heartbeats did stop, and it says why
