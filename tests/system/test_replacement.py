"""Background replacement, double faults, exhausted replicas and hung AWs, with real processes and
real signals under concurrent streaming load. Every stream must come out token-identical to the
failure-free run, and no process may outlive the fabric."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import get_json, iter_stream, poll_until, replacement_of, wait_for, worker_by_pid
from tests.load import PROMPTS, TOKENS, alive, kill_mid_decode, run_streams, wait_gone


def all_pids(fabric: Fabric) -> set[int]:
    return {w["pid"] for w in fabric.cluster()["workers"]} | {p.pid for _, p in fabric.procs}


def test_expert_worker_sigkill_is_replaced_twice(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """SIGKILL an EW, then its replacement (a double fault): each time the shadows take over at
    once, a new EW loads the lost slot's experts and joins, and redundancy is back to 2 copies.
    Workers are pinned (--pin-workers): AW i and EW i on CPU i, a replacement on its dead one's."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3, pin_workers=True) as fabric:
        cpus = sorted(os.sched_getaffinity(0))
        for role, n in (("attention-worker", 2), ("expert-worker", 3)):
            for i in range(n):
                assert os.sched_getaffinity(fabric.pid(f"{role}-{i}")) == {cpus[i % len(cpus)]}, f"{role}-{i}"
        assert os.sched_getaffinity(fabric.pid("gateway-0")) == set(cpus)  # the rest float
        first = fabric.cluster()
        assert first["redundancy"]["copies_min"] == 2 and first["redundancy"]["copies_wanted"] == 2
        reference, outputs, pid = kill_mid_decode(fabric, "expert-worker-1", signal.SIGKILL)
        assert outputs == reference
        dead = worker_by_pid(fabric.cluster(), pid)
        cluster = wait_for(fabric, "a replacement EW", lambda c: replacement_of(c, dead["id"]) is not None)
        new = replacement_of(cluster, dead["id"])
        assert new is not None and sorted(new["experts"]) == sorted(dead["experts"])
        assert os.sched_getaffinity(new["pid"]) == {cpus[1 % len(cpus)]}  # expert-worker-1's CPU
        assert cluster["redundancy"]["copies_min"] == 2 and cluster["redundancy"]["slots_vacant"] == 0
        assert all(dead["id"] not in ews for _, _, ews in cluster["routing"]["replicas"])
        assert any(new["id"] in ews for _, _, ews in cluster["routing"]["replicas"])

        # Double fault: the replacement dies too, under load, and is replaced again.
        _, outputs, pid2 = kill_mid_decode(fabric, new["pid"], signal.SIGKILL, reference=reference)
        assert outputs == reference
        cluster = wait_for(fabric, "a second replacement", lambda c: replacement_of(c, new["id"]) is not None)
        assert cluster["redundancy"]["copies_min"] == 2 and cluster["replacements_started"] == 2
        # The replacement serves traffic: run once more, no failure, same tokens.
        assert run_streams(fabric) == reference
        pids = all_pids(fabric)
    for p in pids:
        wait_gone(p, 15)  # no orphans, replacements included


def test_attention_worker_sigkill_is_replaced(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2) as fabric:
        reference, outputs, pid = kill_mid_decode(fabric, "attention-worker-0", signal.SIGKILL)
        assert outputs == reference
        dead = worker_by_pid(fabric.cluster(), pid)
        assert dead["state"] == "dead"
        cluster = wait_for(fabric, "a replacement AW", lambda c: replacement_of(c, dead["id"]) is not None
                           or sum(w["role"] == "attention" and w["state"] == "alive" for w in c["workers"]) == 2)
        new = [w for w in cluster["workers"] if w["role"] == "attention" and w["state"] == "alive" and w["pid"] != pid]
        assert len(new) == 2
        # The replacement booted in the background (imports and weights in the idle scheduling
        # class) and serves like the workers it joins: its event loop thread is not niced, and
        # it is in the workers' class (`--sched batch`, passed on with the spawn arguments).
        repl = next(w for w in new if w["pid"] == fabric.pid("attention-worker-r1"))  # the supervisor started it
        if sys.platform.startswith("linux"):
            argv = Path(f"/proc/{repl['pid']}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--boot-nice") + 1] == b"20"
            assert os.getpriority(os.PRIO_PROCESS, repl["pid"]) == os.getpriority(os.PRIO_PROCESS, 0)
            assert os.sched_getscheduler(repl["pid"]) == os.SCHED_BATCH
        # The new AW takes new requests: once every gateway has linked to it (the view says alive
        # before a gateway has connected), with least-work routing and an idle fabric, 8 concurrent
        # streams land on both AWs.
        wait_for(fabric, "gateways linked to both AWs", lambda c: all(
            w["stats"].get("aws_connected") == 2 for w in c["workers"] if w["role"] == "gateway" and w["state"] == "alive"))
        assert run_streams(fabric) == reference
        stats = wait_for(fabric, "AW stats", lambda c: all(
            w["stats"].get("tokens_out", 0) > 0 for w in c["workers"] if w["role"] == "attention" and w["state"] == "alive"))
        assert stats
        pids = all_pids(fabric)
    for p in pids:
        wait_gone(p, 15)


def test_hung_attention_worker_is_detected_and_fenced(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """SIGSTOP keeps the AW's connections open: the gateway's probes find it, its streams resume
    elsewhere, the orchestrator fences it (it exits once woken) and a replacement joins."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=2) as fabric:
        victim = next(p for name, p in fabric.procs if name == "attention-worker-1")
        try:
            reference, outputs, pid = kill_mid_decode(fabric, "attention-worker-1", signal.SIGSTOP)
            assert outputs == reference
            cluster = wait_for(fabric, "the hung AW declared dead", lambda c: worker_by_pid(c, pid)["state"] == "dead")
            dead_id = worker_by_pid(cluster, pid)["id"]
            wait_for(fabric, "a replacement AW", lambda c: replacement_of(c, dead_id) is not None
                     or sum(w["role"] == "attention" and w["state"] == "alive" for w in c["workers"]) == 2)
        finally:
            victim.send_signal(signal.SIGCONT)
        assert victim.wait(15) != 0  # fenced: woken up, it finds its orchestrator link closed and exits
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("gateway-*.log"))
        assert "no answer to" in logs


def test_an_aw_found_hung_that_was_only_slow_loses_nothing(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """The gateway gives up on the one AW (stopped past the gateway's silence floor, woken well
    within its lease): the orchestrator does not declare it dead, the gateway reaches it again
    (waiting longer before the next verdict), and the streams resume there from the checkpoints
    it handed over. No request fails; every stream is token-identical."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=1, ews=2, gateways=1) as fabric:
        reference = run_streams(fabric)
        victim = next(p for name, p in fabric.procs if name == "attention-worker-0")
        gateway_log, aw_log = tmp_path / "logs" / "gateway-0.log", tmp_path / "logs" / "attention-worker-0.log"
        result: list[list[list[int]]] = []
        decoding = threading.Event()
        runner = threading.Thread(target=lambda: result.append(run_streams(fabric, None, decoding)))
        runner.start()
        assert decoding.wait(60)
        victim.send_signal(signal.SIGSTOP)
        try:
            assert poll_until(lambda: "is hung" in gateway_log.read_text(), timeout=20, interval=0.005)
        finally:
            victim.send_signal(signal.SIGCONT)  # (well within the orchestrator's confirmation)
        runner.join(180)
        assert result and result[0] == reference
        assert victim.poll() is None  # not fenced: it serves on
        assert "was only slow" in gateway_log.read_text() and "answers again" in gateway_log.read_text()
        assert "restored" in aw_log.read_text()  # (its own hand-over: the KV was not recomputed)
        cluster = fabric.cluster()
        assert all(w["state"] == "alive" for w in cluster["workers"]) and cluster["replacements_started"] == 0


def _health_watch(fabric: Fabric, seen: list[str], stop: threading.Event) -> None:
    url = f"http://127.0.0.1:{fabric.port}/health"
    import urllib.error
    import urllib.request

    while not stop.is_set():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=fabric.admin_headers()), timeout=2) as r:
                seen.append(str(r.status))
        except urllib.error.HTTPError as e:
            seen.append(f"{e.code} {e.read().decode()}")
        except OSError:
            pass
        time.sleep(0.05)


def test_lost_experts_wait_for_the_replacement(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """No shadows: killing an EW leaves experts with no copy. Requests that need them wait while
    /health says 503, and continue, token-identical, once the replacement has loaded them."""
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2, shadows_per_expert=0) as fabric:
        assert fabric.cluster()["redundancy"]["copies_wanted"] == 1
        seen: list[str] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_health_watch, args=(fabric, seen, stop))
        watcher.start()
        try:
            reference, outputs, pid = kill_mid_decode(fabric, "expert-worker-0", signal.SIGKILL)
        finally:
            stop.set()
            watcher.join()
        assert outputs == reference
        assert any(s.startswith("503") and "no live replica" in s for s in seen), seen[-5:]
        cluster = fabric.cluster()
        assert cluster["redundancy"]["experts_lost"] == 0
        aws = [w for w in cluster["workers"] if w["role"] == "attention" and w["state"] == "alive"]
        assert get_json(f"http://127.0.0.1:{fabric.port}/health")["status"] == "ok"
        deadline = time.monotonic() + 10
        while sum(w["stats"].get("expert_waits", 0) for w in aws) == 0 and time.monotonic() < deadline:
            time.sleep(0.3)
            aws = [w for w in fabric.cluster()["workers"] if w["role"] == "attention" and w["state"] == "alive"]
        assert sum(w["stats"].get("expert_waits", 0) for w in aws) >= 1


def test_lost_experts_past_the_bound_end_with_an_error(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """No shadows and no provisioner: past --expert-wait-s the requests end with an in-band error
    event and [DONE], never a hang; /health reports the lost experts."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=1, ews=2, shadows_per_expert=0, provisioner="none",
                        extra={"attention-worker": ["--expert-wait-s", "1.5"]}) as fabric:
        url = f"http://127.0.0.1:{fabric.port}/v1/completions"
        body = {"prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        events: list[dict[str, Any]] = []
        victim = next(p for name, p in fabric.procs if name == "expert-worker-1")
        t0 = time.monotonic()
        for ev in iter_stream(url, body):
            events.append(ev)
            if len(events) == 3:
                victim.kill()
        elapsed = time.monotonic() - t0
        assert "error" in events[-1] and "no live copy" in events[-1]["error"]["message"]
        assert elapsed < 60
        health = get_json_status(f"http://127.0.0.1:{fabric.port}/health", fabric.admin_headers())
        assert health[0] == 503 and "no live replica" in health[1]["reason"]
        assert alive(fabric.procs[0][1].pid)


def get_json_status(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

