"""No single point of failure in the control plane, with real processes and signals under 8
concurrent streams: the orchestrator dies (SIGKILL or SIGINT) mid-decode and the data path never
notices; its supervisor starts it again and it rebuilds the cluster from the workers, who register
again under their own ids; an EW that dies while no orchestrator is up is handled by its shadows,
and replaced once one is back."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import running_fabric
from tests.helpers import replacement_of, wait_for, worker_by_pid
from tests.load import PROMPTS, kill_mid_decode, run_streams, wait_gone


def _orchestrator(cluster: dict) -> dict:
    return next(w for w in cluster["workers"] if w["role"] == "orchestrator")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_orchestrator_death_mid_decode(hf_models: dict[str, Path], tmp_path: Path, sig: signal.Signals) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        before = fabric.cluster()
        old = _orchestrator(before)
        workers = {w["id"]: w["pid"] for w in before["workers"] if w["role"] != "orchestrator"}
        times: list[list[float]] = [[] for _ in PROMPTS]
        kill_wall = time.time()
        reference, outputs, pid = kill_mid_decode(fabric, "orchestrator", sig, times=times)
        assert pid == old["pid"]
        assert outputs == reference  # nothing lost, every token identical

        after = wait_for(fabric, "a new orchestrator with every worker back", lambda c: not c["recovering"] and all(
            any(w["id"] == wid and w["pid"] == wpid and w["state"] == "alive" for w in c["workers"])
            for wid, wpid in workers.items()))
        new = _orchestrator(after)
        assert new["pid"] != old["pid"] and after["generation"] > before["generation"]
        assert after["epoch"] > before["epoch"]  # epochs continue above the highest seen
        # The data path did not wait for it: every stream got tokens while there was no orchestrator.
        assert all(any(kill_wall < t < new["registered_at"] for t in ts) for ts in times), "a stream paused"
        logs = (tmp_path / "logs" / "gateway-0.log").read_text() + (tmp_path / "logs" / "gateway-1.log").read_text()
        assert "resuming after" not in logs  # and no stream needed resuming

        if sig != signal.SIGKILL:
            return  # (the EW death below is the same after either signal)
        # The new orchestrator handles an EW death as usual: shadows, the next epoch, a replacement.
        _, outputs, ew_pid = kill_mid_decode(fabric, "expert-worker-1", signal.SIGKILL, reference=reference)
        assert outputs == reference
        dead = worker_by_pid(fabric.cluster(), ew_pid)
        cluster = wait_for(fabric, "a replacement EW", lambda c: replacement_of(c, dead["id"]) is not None)
        assert cluster["redundancy"]["copies_min"] == 2
        orch_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("orchestrator.*.log"))
        assert f"for {dead['id']}" in orch_logs  # the restarted orchestrator asked for it


def test_expert_worker_dies_while_no_orchestrator_is_up(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """The orchestrator is down (its supervisor waits 8 s before starting it again) when an EW is
    SIGKILLed mid-decode: the AWs replay its calls on the shadows by themselves. When the
    orchestrator is back, the EW does not register again: it is declared dead and replaced."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3, restart_delay_s=8.0) as fabric:
        reference = run_streams(fabric)
        victim_id = worker_by_pid(fabric.cluster(), fabric.pid("expert-worker-1"))["id"]
        orch = next(p for n, p in fabric.procs if n == "orchestrator")
        os.kill(orch.pid, signal.SIGKILL)
        wait_gone(orch.pid, 10)
        _, outputs, _ = kill_mid_decode(fabric, "expert-worker-1", signal.SIGKILL, reference=reference)
        assert orch.poll() is not None and fabric.pid("orchestrator") == orch.pid  # still down all along
        assert outputs == reference
        cluster = wait_for(fabric, "the EW declared dead and replaced", lambda c: replacement_of(c, victim_id) is not None)
        assert [w["state"] for w in cluster["workers"] if w["id"] == victim_id] == ["dead"]
        assert cluster["redundancy"]["copies_min"] == 2
