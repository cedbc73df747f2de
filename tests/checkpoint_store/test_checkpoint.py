"""Stateful attention recovery with the checkpoint store, real processes and signals: an AW dies
under concurrent streaming load and its requests resume on a healthy AW from their checkpointed
KV (not by replay); the store dies and serving goes on, then protection resumes on its
replacement."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from fabric.faults import DROP_ENV
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import get_json, poll_until
from tests.load import kill_mid_decode, run_streams, wait_gone


def role(cluster: dict[str, Any], name: str, state: str = "alive") -> list[dict[str, Any]]:
    return [w for w in cluster["workers"] if w["role"] == name and w["state"] == state]


def wait_stats(fabric: Fabric, what: str, pred: Any, timeout: float = 60) -> dict[str, Any]:
    """Worker stats reach the orchestrator once a second."""
    deadline = time.monotonic() + timeout
    while True:
        cluster = fabric.cluster()
        if pred(cluster):
            return cluster
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {cluster['workers']}"
        time.sleep(0.25)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_attention_worker_death_restores_from_the_store(sig: signal.Signals, hf_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2) as fabric:
        store = role(fabric.cluster(), "checkpoint_store")
        assert len(store) == 1
        reference, outputs, pid = kill_mid_decode(fabric, "attention-worker-0", sig)
        assert outputs == reference  # nothing lost, nothing repeated, same tokens
        cluster = wait_stats(fabric, "store restores", lambda c: role(c, "checkpoint_store")[0]["stats"].get("restores", 0) > 0)
        st = role(cluster, "checkpoint_store")[0]["stats"]
        assert st["restored_tokens"] > 0 and st["restored_bytes"] > 0
        cluster = wait_stats(fabric, "the replacement AW", lambda c: len(role(c, "attention")) == 2)
        survivors = role(cluster, "attention")
        assert pid not in [w["pid"] for w in survivors]
        aws = wait_stats(fabric, "AW restore stats", lambda c: sum(
            w["stats"].get("restores", 0) for w in role(c, "attention")) > 0)
        # A replacement AW that has not reported yet has empty stats.
        assert sum(w["stats"].get("restored_tokens", 0) for w in role(aws, "attention")) == st["restored_tokens"]
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("attention-worker-*.log"))
    assert "from aw-" in logs and "checkpoint in" in logs


def test_store_death_serving_goes_on_and_protection_resumes(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=2) as fabric:
        first = role(fabric.cluster(), "checkpoint_store")[0]
        reference, outputs, _ = kill_mid_decode(fabric, "checkpoint-store-0", signal.SIGKILL)
        assert outputs == reference  # serving went on without checkpoints
        cluster = wait_stats(fabric, "a replacement store", lambda c: any(
            w["info"].get("replaces") == first["id"] or w["id"] != first["id"] for w in role(c, "checkpoint_store")))
        new = role(cluster, "checkpoint_store")[0]
        assert new["id"] != first["id"]
        wait_stats(fabric, "AWs checkpointing to the new store", lambda c: all(
            w["stats"].get("checkpoint_store") == new["id"] for w in role(c, "attention")))
        # Protection is back: an AW death now restores from the new store.
        _, outputs, pid = kill_mid_decode(fabric, "attention-worker-1", signal.SIGKILL, reference=reference)
        assert outputs == reference
        wait_stats(fabric, "restores from the new store", lambda c: any(
            w["id"] == new["id"] and w["stats"].get("restores", 0) > 0 for w in role(c, "checkpoint_store")))
        health = get_json(f"http://127.0.0.1:{fabric.port}/health", secret_file=fabric.secret_file)
        assert health["status"] == "ok" and health["checkpointing"] == "on"
        assert run_streams(fabric) == reference
        # Checkpoint segments travel while the AW waits for expert results (the link's idle gaps).
        wait_stats(fabric, "checkpoint bytes sent in link idle gaps", lambda c: any(
            w["stats"].get("ckpt_bytes_in_gaps", 0) > 0 for w in role(c, "attention")))
        pids = {w["pid"] for w in fabric.cluster()["workers"]}
    for p in pids:
        wait_gone(p, 15)


def test_a_store_the_orchestrator_vouches_for_is_used_again(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """The store drops its AW connections but serves on (a test fault hook): each AW reports it
    lost, the orchestrator finds it answers, and the AW checkpoints to it again (re-sending its
    running requests' KV), so an AW death after that restores from it, not by replay."""
    env = {"checkpoint-store-0": {DROP_ENV: "1"}}
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=2, env=env) as fabric:
        reference = run_streams(fabric)
        store = next(p for name, p in fabric.procs if name == "checkpoint-store-0")
        aw_logs = [tmp_path / "logs" / f"attention-worker-{i}.log" for i in range(2)]
        store.send_signal(signal.SIGUSR1)
        assert poll_until(lambda: all(log.read_text().count("checkpointing to cs-0") == 2 for log in aw_logs), 30)
        assert all("checkpoint store cs-0 lost" in log.read_text() for log in aw_logs)
        _, outputs, _ = kill_mid_decode(fabric, "attention-worker-1", signal.SIGKILL, reference=reference)
        assert outputs == reference
        wait_stats(fabric, "restores from the store", lambda c: any(
            w["stats"].get("restores", 0) > 0 for w in role(c, "checkpoint_store")))
