"""The orchestrator's verdict on a reported death: a worker that answers its probe is not declared
dead, and every peer that reported it meanwhile hears so (PeerAlive); one that does not answer is;
and a report from a peer that sends data to the worker and saw it take none is evidence enough,
even when it arrives while the probe of an earlier, weaker report is out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fabric.config import OrchestratorConfig
from fabric.messages.control import LinkProbe, PeerAlive, PeerFailed, Register, Role, WorkerState
from orchestrator.main import Orchestrator


class Link:
    """A worker's link as the verdicts use it: it records what is sent, and (unless hung) answers
    a probe `delay` later, as the worker's link reader would."""

    closed = False

    def __init__(self, orch: Orchestrator, hung: bool = False, delay: float = 0.02) -> None:
        self.orch, self.hung, self.delay, self.sent = orch, hung, delay, []  # type: list[Any]

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, LinkProbe) and not self.hung:
            asyncio.get_running_loop().call_later(self.delay, self.orch.verdicts.answered, msg.nonce)


def cluster(model: Path, hung: bool) -> tuple[Orchestrator, dict[str, Link]]:
    orch = Orchestrator(OrchestratorConfig(model=str(model), expert_workers=1, confirm_timeout_ms=100))
    orch.recovered.set()
    links = {}
    for role in (Role.ATTENTION, Role.ATTENTION, Role.GATEWAY, Role.STORE):
        rec = orch.cluster.add(Register(role, 1, "127.0.0.1", 1, ready=True))
        assert rec is not None
        links[rec.id] = orch.links[rec.id] = Link(orch, hung=hung and role is Role.STORE)  # type: ignore[assignment]
    return orch, links


def ids(links: dict[str, Link], prefix: str) -> list[str]:
    return sorted(w for w in links if w.startswith(prefix))


async def verdicts_done(orch: Orchestrator) -> None:
    """Until every verdict under way has been reached (each drops its reports when done)."""
    async with asyncio.timeout(10):
        while orch.verdicts._reports:
            await asyncio.sleep(0.005)


def dead_and_nobody_told_otherwise(orch: Orchestrator, links: dict[str, Link]) -> bool:
    (store,) = ids(links, "cs")
    return orch.cluster.workers[store].state is WorkerState.DEAD and not any(
        isinstance(m, PeerAlive) for link in links.values() for m in link.sent)


def test_a_store_that_answers_is_vouched_for_to_every_reporter(hf_models: dict[str, Path]) -> None:
    async def main() -> tuple[Orchestrator, dict[str, Link]]:
        orch, links = cluster(hf_models["mixtral"], hung=False)
        (store,), (aw0, aw1) = ids(links, "cs"), ids(links, "aw")
        await orch._handle(aw0, PeerFailed(store, "connection closed"))
        await orch._handle(aw1, PeerFailed(store, "connection closed"))  # while the first verdict is under way
        await verdicts_done(orch)
        return orch, links

    orch, links = asyncio.run(main())
    (store,), (aw0, aw1) = ids(links, "cs"), ids(links, "aw")
    assert orch.cluster.workers[store].state is WorkerState.ALIVE
    for aw in (aw0, aw1):
        assert [m.worker_id for m in links[aw].sent if isinstance(m, PeerAlive)] == [store]
    assert sum(isinstance(m, LinkProbe) for m in links[store].sent) == 1  # one verdict for both reports


def test_a_store_that_does_not_answer_is_declared_dead(hf_models: dict[str, Path]) -> None:
    async def main() -> tuple[Orchestrator, dict[str, Link]]:
        orch, links = cluster(hf_models["mixtral"], hung=True)
        (store,), (aw0, _) = ids(links, "cs"), ids(links, "aw")
        await orch._handle(aw0, PeerFailed(store, "connection closed"))
        await verdicts_done(orch)
        return orch, links

    assert dead_and_nobody_told_otherwise(*asyncio.run(main()))


def test_evidence_that_arrives_while_the_probe_is_out_decides(hf_models: dict[str, Path]) -> None:
    """A gateway's weak report starts a probe; an AW's definitive one (the store took no data)
    arrives meanwhile. The store answers the probe, but it is declared dead all the same, and no
    reporter is told it is alive."""

    async def main() -> tuple[Orchestrator, dict[str, Link]]:
        orch, links = cluster(hf_models["mixtral"], hung=False)
        (store,), (aw0, _), (gw,) = ids(links, "cs"), ids(links, "aw"), ids(links, "gw")
        await orch._handle(gw, PeerFailed(store, "it seems slow"))
        while not links[store].sent:  # the probe is out (the store answers it 20 ms later)
            await asyncio.sleep(0.001)
        await orch._handle(aw0, PeerFailed(store, "the peer took no data for 1000 ms", definitive=True))
        await verdicts_done(orch)
        return orch, links

    assert dead_and_nobody_told_otherwise(*asyncio.run(main()))
