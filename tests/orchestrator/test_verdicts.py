"""The orchestrator's verdicts (orchestrator/verdicts.py): a worker is dead on evidence, an exit or a
lease missed on its link with its probe unanswered, never on one slow answer or a peer's word."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from fabric.config import OrchestratorConfig
from fabric.local_process import LocalProcess, Sample, Thread
from fabric.messages.control import Heartbeat, LinkProbe, PeerAlive, PeerFailed, Register, Role, WorkerState
from orchestrator.main import Orchestrator
from orchestrator.verdicts import MAX_EXCUSED_S, STARTING_LEASE_S, Verdicts

LEASE = 0.7


def ticks(v: Verdicts, start: float, until: float, heard: dict[str, float] | None = None) -> tuple[list[str], list[str]]:
    """Ticks every 50 ms from `start` to `until`; `heard` maps a worker to the period of its
    heartbeats. Returns (every worker probed, every worker whose lease ran out)."""
    probed: list[str] = []
    expired: list[str] = []
    now = start
    while now < until:
        now += v.tick_s
        for wid, every in (heard or {}).items():
            if int(now / every) != int((now - v.tick_s) / every):
                v.heard(wid, now)
        p, e = v.tick(now)
        probed += p
        expired += [w for w, _ in e]
    return probed, expired


def test_a_worker_that_beats_keeps_its_lease_and_a_silent_one_loses_it() -> None:
    v = Verdicts(LEASE)
    v.watch("ew-0", 0.0, serving=True)
    v.watch("ew-1", 0.0, serving=True)
    probed, expired = ticks(v, 0.0, 5.0, heard={"ew-0": 0.15})
    assert expired == ["ew-1"] and probed == ["ew-1"]  # probed at half the lease, dead at the lease
    assert "ew-0" in v.leases


def test_a_pause_shorter_than_the_lease_is_not_a_death() -> None:
    v = Verdicts(LEASE)
    v.watch("aw-0", 0.0, serving=True)
    _, expired = ticks(v, 0.0, 0.45)  # stopped for 450 ms, probed meanwhile...
    assert expired == []
    v.heard("aw-0", 0.45)  # ...then it wakes and answers
    _, expired = ticks(v, 0.45, 3.0, heard={"aw-0": 0.15})
    assert expired == []


def test_the_orchestrators_own_stall_is_not_its_workers_silence() -> None:
    v = Verdicts(LEASE)
    v.watch("ew-0", 0.0, serving=True)
    v.tick(0.05)
    p, e = v.tick(2.0)  # this process did not run for ~2 s: the heartbeats wait unread in its sockets
    assert e == [] and p == []
    v.heard("ew-0", 2.01)
    assert ticks(v, 2.0, 3.0, heard={"ew-0": 0.15})[1] == []


def test_a_worker_not_serving_yet_has_the_long_lease() -> None:
    v = Verdicts(LEASE)
    v.watch("ew-9", 0.0, serving=False)  # registered, loading its experts
    assert ticks(v, 0.0, STARTING_LEASE_S * 0.9)[1] == []
    v.serving("ew-9")
    assert ticks(v, STARTING_LEASE_S * 0.9, STARTING_LEASE_S * 0.9 + 2 * LEASE)[1] == ["ew-9"]


def test_reporters_hear_that_a_worker_answers() -> None:
    v = Verdicts(LEASE)
    v.watch("cs-0", 0.0, serving=True)
    assert v.reported("aw-0", "cs-0") is True  # probe it now
    assert v.reported("aw-1", "cs-0") is False  # one probe out for both
    assert v.heard("cs-0", 0.01) == {"aw-0", "aw-1"}
    assert v.heard("cs-0", 0.02) == set()


def test_a_connection_that_ended_before_the_link_is_an_exit_for_a_lease() -> None:
    """A peer's report that its connection ended can arrive before the worker's own link ends (the
    same death, seen first elsewhere): the link's end within a lease is then an exit, later it is not."""
    v = Verdicts(LEASE)
    v.connection_ended("aw-0", 10.0, "gw-1's connection to it ended")
    assert v.exited("aw-0", 10.2) == "gw-1's connection to it ended"
    assert v.exited("aw-0", 10.3) is None  # (used once)
    v.connection_ended("ew-2", 20.0, "aw-1's connection to it ended")
    assert v.exited("ew-2", 20.0 + LEASE + 0.01) is None  # too long after: the rejoin grace decides
    assert v.exited("cs-0", 20.0) is None  # nobody saw it end


class Starved(LocalProcess):
    """A worker's process on this machine whose one thread, from `since` on, is runnable and given no CPU (or, with
    `stopped`, is stopped), as `/proc` would show it; the clock is the test's."""

    def __init__(self, since: float, stopped: bool = False) -> None:
        super().__init__(0)
        self.since, self.stopped, self.now = since, stopped, 0.0

    def sample(self) -> Sample | None:
        ran = int(min(self.now, self.since) * 1e9)  # its CPU time: it runs until `since`, then waits
        return Sample(self.now, self.stopped, {1: Thread(self.now >= self.since, ran, 0)})


def lease_ticks(v: Verdicts, proc: Starved, start: float, until: float) -> tuple[list[str], float]:
    """Ticks every 50 ms, the process's clock the test's; returns whoever's lease ran out and when it first did."""
    now, expired, when = start, [], -1.0
    while now < until:
        now += v.tick_s
        proc.now = now
        gone = [w for w, _ in v.tick(now)[1]]
        if gone and when < 0:
            when = now
        expired += gone
    return expired, when


def test_a_worker_waiting_for_a_cpu_here_keeps_its_lease(caplog: pytest.LogCaptureFixture) -> None:
    """Silent from t=0, its process runnable and given no CPU: the waits from its probe on are credited, and its
    lease runs on, said once; heard again, it is as any other. Stopped instead, it is dead at its lease."""
    v = Verdicts(LEASE)
    proc = Starved(since=0.0)
    v.watch("gw-1", 0.0, serving=True, process=proc)
    expired, _ = lease_ticks(v, proc, 0.0, 3.0)
    assert expired == [] and v.leases["gw-1"].excused_s > 1.5
    assert caplog.text.count("gw-1 was silent for") == 1 and "waited for a CPU" in caplog.text
    v.heard("gw-1", 3.0)
    assert v.leases["gw-1"].excused_s == 0.0

    v = Verdicts(LEASE)
    stopped = Starved(since=0.0, stopped=True)
    v.watch("aw-1", 0.0, serving=True, process=stopped)
    assert lease_ticks(v, stopped, 0.0, 3.0) == (["aw-1"], pytest.approx(LEASE, abs=0.06))


def test_a_wait_that_began_after_the_probe_is_not_credited_until_seen_whole() -> None:
    """Silent from t=0 (a hang), its process runnable only from t=0.6 on: at its lease (0.7) the wait since the probe
    (0.35) is not yet seen whole, so it is dead at its lease."""
    v = Verdicts(LEASE)
    proc = Starved(since=0.6)
    v.watch("ew-0", 0.0, serving=True, process=proc)
    assert lease_ticks(v, proc, 0.0, 2.0)[0] == ["ew-0"]


def test_waiting_for_a_cpu_for_ever_is_excused_only_so_long() -> None:
    v = Verdicts(LEASE)
    proc = Starved(since=0.0)
    v.watch("ew-1", 0.0, serving=True, process=proc)
    expired, when = lease_ticks(v, proc, 0.0, MAX_EXCUSED_S + 5.0)
    assert expired == ["ew-1"] and MAX_EXCUSED_S < when < MAX_EXCUSED_S + 2 * LEASE


class Link:
    """A worker's link as the orchestrator uses it: it records what is sent; unless hung, it
    answers a probe `delay` later with any message, as the worker's control loop would."""

    closed = False

    def __init__(self, orch: Orchestrator, wid: str, hung: bool = False, delay: float = 0.02) -> None:
        self.orch, self.wid, self.hung, self.delay, self.sent = orch, wid, hung, delay, []  # type: list[Any]

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, LinkProbe) and not self.hung:
            asyncio.get_running_loop().call_later(self.delay, self.orch.heard, self.wid)


def cluster(model: Path, hung: bool) -> tuple[Orchestrator, dict[str, Link]]:
    orch = Orchestrator(OrchestratorConfig(model=str(model), expert_workers=1))
    orch.recovered.set()
    links = {}
    for role in (Role.ATTENTION, Role.ATTENTION, Role.GATEWAY, Role.STORE):
        rec = orch.cluster.add(Register(role, 1, "127.0.0.1", 1, ready=True))
        assert rec is not None
        links[rec.id] = orch.links[rec.id] = Link(orch, rec.id, hung=hung and role is Role.STORE)  # type: ignore[assignment]
        orch.verdicts.watch(rec.id, time.monotonic(), True)
    return orch, links


def test_a_reported_store_that_answers_is_vouched_for_to_every_reporter(hf_models: dict[str, Path]) -> None:
    async def main() -> tuple[Orchestrator, dict[str, Link]]:
        orch, links = cluster(hf_models["mixtral"], hung=False)
        store, aw0, aw1 = "cs-0", "aw-0", "aw-1"
        await orch.handle(aw0, PeerFailed(store, "connection closed"))
        await orch.handle(aw1, PeerFailed(store, "connection closed"))  # while the first probe is out
        for _ in range(200):  # (until the store's answer has reached both reporters, at most 10 s)
            if all(any(isinstance(m, PeerAlive) for m in links[aw].sent) for aw in (aw0, aw1)):
                break
            await asyncio.sleep(0.05)
        return orch, links

    orch, links = asyncio.run(main())
    assert orch.cluster.workers["cs-0"].state is WorkerState.ALIVE
    for aw in ("aw-0", "aw-1"):
        assert [m.worker_id for m in links[aw].sent if isinstance(m, PeerAlive)] == ["cs-0"]
    assert sum(isinstance(m, LinkProbe) for m in links["cs-0"].sent) == 1  # one probe for both reports


def test_a_silent_store_is_declared_dead_when_its_lease_runs_out(hf_models: dict[str, Path]) -> None:
    async def main() -> tuple[Orchestrator, dict[str, Link], bool]:
        orch, links = cluster(hf_models["mixtral"], hung=True)
        watcher = asyncio.create_task(orch.watch_leases())
        await orch.handle("aw-0", PeerFailed("cs-0", "connection closed"))
        await asyncio.sleep(LEASE / 2)
        alive_at_half = orch.cluster.workers["cs-0"].state is WorkerState.ALIVE  # (a report alone decides nothing)
        for _ in range(int(3 * LEASE / 0.05)):  # the others keep beating
            await asyncio.sleep(0.05)
            for wid in ("aw-0", "aw-1", "gw-0"):
                await orch.handle(wid, Heartbeat())
                orch.heard(wid)
        watcher.cancel()
        return orch, links, alive_at_half

    orch, links, alive_at_half = asyncio.run(main())
    assert alive_at_half
    assert orch.cluster.workers["cs-0"].state is WorkerState.DEAD
    assert all(orch.cluster.workers[w].state is WorkerState.ALIVE for w in ("aw-0", "aw-1", "gw-0"))
    assert not any(isinstance(m, PeerAlive) for link in links.values() for m in link.sent)


@pytest.mark.parametrize("closed", [True, False])
def test_a_reported_worker_whose_link_is_gone_is_dead_at_once_if_a_connection_ended(
        closed: bool, hf_models: dict[str, Path]) -> None:
    """An exit closes every socket: the reporter's connection ended and the worker's link is gone.
    A silence reported while the link is down (a partition) is left to the lease."""

    async def main() -> Orchestrator:
        orch, links = cluster(hf_models["mixtral"], hung=False)
        links["cs-0"].closed = True  # its link is gone
        await orch.handle("aw-0", PeerFailed("cs-0", "connection closed by the peer" if closed else "no answer to "
                                              "3 probes in 40 ms", closed=closed))
        await asyncio.sleep(0.05)
        return orch

    state = asyncio.run(main()).cluster.workers["cs-0"].state
    assert state is (WorkerState.DEAD if closed else WorkerState.ALIVE)


def test_a_verdict_says_when_another_worker_was_last_heard() -> None:
    """A moment before where the orchestrator read its links through the silence (said with the verdict, after the
    worker's lease is gone); nothing where it watches nobody else."""
    v = Verdicts(LEASE)
    v.watch("gw-1", 0.0, serving=True)
    v.watch("ew-0", 0.0, serving=True)
    _, expired = ticks(v, 0.0, 2.0, heard={"ew-0": 0.15})
    assert expired == ["gw-1"]
    last = 2.0 - v.leases["ew-0"].heard
    assert last <= 0.15 and v.others_heard(2.0) == f"; the last word from any other worker came {last * 1e3:.0f} ms before"
    v.forget("ew-0")
    assert v.others_heard(2.0) == ""
