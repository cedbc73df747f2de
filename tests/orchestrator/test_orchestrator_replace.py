"""The orchestrator starts a replacement `replacement_delay_ms` after a death, never during a shutdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from fabric.config import OrchestratorConfig
from fabric.messages.control import Life, Origin, Register, Role
from orchestrator.main import Orchestrator
from orchestrator.provisioner import NoProvisioner


class Recorder(NoProvisioner):
    """Records when the orchestrator starts a replacement (and says it did)."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str, float]] = []

    def start(self, role: Role, key: str, boot_nice: int, avoid: list[str], standby: bool = False,
              origin: Origin = Origin.REPLACEMENT) -> bool:
        self.started.append((role.value, key, time.monotonic()))
        return True


def _orchestrator(model: Path, delay_ms: float, **flags: int) -> tuple[Orchestrator, Recorder]:
    """An orchestrator with the default flags but `delay_ms` and `flags` (only the test of that flag sets one)."""
    orch = Orchestrator(OrchestratorConfig(model=str(model), expert_workers=1, replacement_delay_ms=delay_ms, **flags))
    rec = Recorder()
    orch.replacements.provisioner = rec
    return orch, rec


def test_replacement_waits_out_the_delay(hf_models: dict[str, Path]) -> None:
    async def scenario() -> tuple[list[tuple[str, str, float]], float, int]:
        orch, rec = _orchestrator(hf_models["mixtral"], 200)
        t0 = time.monotonic()
        orch.replacements.replace(Role.ATTENTION, "aw-0")
        await asyncio.sleep(0.05)
        early = list(rec.started)
        await asyncio.sleep(0.4)
        assert early == []  # not yet at 50 ms
        return rec.started, t0, orch.replacements.started

    started, t0, count = asyncio.run(scenario())
    assert [(r, w) for r, w, _ in started] == [("attention", "aw-0")] and count == 1
    assert started[0][2] - t0 >= 0.2


def test_no_delay_starts_at_once_and_the_cap_holds(hf_models: dict[str, Path]) -> None:
    async def scenario() -> tuple[int, int]:
        orch, rec = _orchestrator(hf_models["mixtral"], 0, max_replacements=1)
        orch.replacements.replace(Role.EXPERT, "ew-0")
        orch.replacements.replace(Role.EXPERT, "ew-1")  # over --max-replacements: refused
        return len(rec.started), orch.replacements.started

    assert asyncio.run(scenario()) == (1, 1)


def test_shutdown_during_the_delay_starts_nothing(hf_models: dict[str, Path]) -> None:
    async def scenario() -> int:
        orch, rec = _orchestrator(hf_models["mixtral"], 100)
        orch.replacements.replace(Role.ATTENTION, "aw-1")
        orch.shutting_down = True  # `POST /shutdown` arrived while the replacement was waiting
        await asyncio.sleep(0.3)
        return len(rec.started)

    assert asyncio.run(scenario()) == 0


def test_replacements_that_keep_dying_young_are_not_started_again(hf_models: dict[str, Path],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """ew-0 dies after a long life; each of its replacements dies within seconds of starting.
    After the third such death its line is no longer replaced, said once; another line is."""
    async def scenario() -> tuple[list[str], Orchestrator]:
        orch, rec = _orchestrator(hf_models["mixtral"], 0)
        reps = orch.replacements
        reps.died("ew-0", replacement=False, age_s=3600.0, reason="SIGKILL")
        reps.replace(Role.EXPERT, "ew-0")
        dead = "ew-0"
        for i in range(1, 5):  # replacement i replaces the one before it, and dies young
            new = f"ew-{10 + i}"
            orch.cluster.add(Register(Role.EXPERT, 100 + i, "127.0.0.1", 1, worker_id=new, life=Life(Origin.REPLACEMENT, dead)))
            reps.died(new, replacement=True, age_s=2.0, reason="CUDA error: no kernel image")
            reps.replace(Role.EXPERT, new)
            dead = new
        reps.died("aw-3", replacement=True, age_s=2.0, reason="a first young death")  # another line: replaced
        reps.replace(Role.ATTENTION, "aw-3")
        return [w for _, w, _ in rec.started], orch

    with caplog.at_level("ERROR", logger="orchestrator"):
        started, orch = asyncio.run(scenario())
    assert started == ["ew-0", "ew-11", "ew-12", "aw-3"]  # the third young death stops the line of ew-0
    assert list(orch.replacements.churn.stopped) == ["ew-0"]
    assert sum("not replacing" in r.message for r in caplog.records) == 1
