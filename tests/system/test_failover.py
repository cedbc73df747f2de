"""An expert worker dies (SIGINT) mid-decode: AWs replay its in-flight calls on the shadows, the
orchestrator publishes the next epoch, and every stream finishes token-identical to the run
without the failure. The deaths of an AW and of an EW over both kinds of link: same-host sockets (the
default) and TCP alone (MOE_FABRIC_SAME_HOST=0)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fabric.transport import same_host
from tests.conftest import running_fabric
from tests.helpers import get_json, same_host_on
from tests.load import kill_mid_decode

LINKS = ["tcp", "unix"]


def assert_links_over(links: str, cluster: dict) -> None:  # type: ignore[type-arg]
    """With same-host sockets on, every AW, EW and store listens on one (dialers then use it)."""
    if links == "unix":
        ports = [w["port"] for w in cluster["workers"] if w["role"] in ("attention", "expert", "checkpoint_store")
                 and w["state"] == "alive"]
        assert ports and all(os.path.exists(same_host.path("127.0.0.1", p) or "") for p in ports)


@pytest.mark.parametrize("links", LINKS)
def test_attention_worker_death_resumes_every_stream(links: str, hf_models: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    same_host_on(links, monkeypatch)
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2) as fabric:
        assert_links_over(links, fabric.cluster())
        reference, outputs, pid = kill_mid_decode(fabric, "attention-worker-0")
        assert outputs == reference  # seeded sampling: the resumed streams continue identically
        cluster = fabric.cluster()
        assert [w["state"] for w in cluster["workers"] if w["pid"] == pid] == ["dead"]
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("gateway-*.log"))
    assert "resuming after" in logs


@pytest.mark.parametrize("links", LINKS)
def test_expert_worker_death_loses_nothing(links: str, hf_models: dict[str, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    same_host_on(links, monkeypatch)
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        assert fabric.cluster()["epoch"] == 1
        assert_links_over(links, fabric.cluster())
        reference, outputs, pid = kill_mid_decode(fabric, "expert-worker-1")
        assert outputs == reference  # nothing lost, nothing repeated, same tokens
        after = fabric.cluster()
        dead = [w for w in after["workers"] if w["pid"] == pid]
        assert dead[0]["state"] == "dead" and after["epoch"] >= 2  # 2: shadows promoted; 3: replacement joined
        assert all(dead[0]["id"] not in ews and ews for _, _, ews in after["routing"]["replicas"])
        # Every AW routed around the dead EW on its own, not waiting for the orchestrator's table (which
        # drops an EW without marking it dead here): it replayed the calls in flight on it, or its
        # links' end told it before a call had to fail.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # AW stats reach the orchestrator once a second
            stats = [w["stats"] for w in fabric.cluster()["workers"] if w["role"] == "attention"]
            if all(dead[0]["id"] in s.get("dead_expert_workers", []) for s in stats):
                break
            time.sleep(0.2)
        assert stats and all(dead[0]["id"] in s.get("dead_expert_workers", []) for s in stats)
        health = get_json(f"http://127.0.0.1:{fabric.port}/health")
        assert health["status"] == "ok"  # every expert still has a live copy


def test_hung_expert_worker_is_detected_by_probes(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """SIGSTOP keeps the EW's connections open: only the control-channel probes can tell."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        victim = next(p for name, p in fabric.procs if name == "expert-worker-2")
        try:
            reference, outputs, _ = kill_mid_decode(fabric, "expert-worker-2", signal.SIGSTOP)
            assert outputs == reference
            # The streams may end before its lease does: it stays stopped until the orchestrator's verdict.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not [
                    w for w in fabric.cluster()["workers"] if w["pid"] == victim.pid and w["state"] == "dead"]:
                time.sleep(0.1)
        finally:
            victim.send_signal(signal.SIGCONT)
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("attention-worker-*.log"))
        assert "no answer to" in logs  # found by probes, not by a closed connection
        orch = (tmp_path / "logs" / "orchestrator.log").read_text()
        # Declared dead on its lease (silent on its link, its probe unanswered), and fenced.
        assert "died (silent on its link for" in orch and "but it answers" not in orch
