"""Silent peers, for real on loopback: fault-injecting TCP proxies (tests/fault_proxy.py) between a
worker and its peers drop every packet, with no FIN and no RST, as a machine gone looks from
outside. Each link kind: an EW silent to its AWs (AW-EW), an AW to the gateways (gateway-AW), the
checkpoint store to its AWs (AW-store), and an EW silent to the orchestrator only (worker-
orchestrator). Each is declared dead by its lease and replaced; nothing is lost, every stream is
token-identical. And a gray failure: an EW whose data port drops every packet for 20 s while its
control port and orchestrator link answer is routed around, never declared dead, and used again
once its port answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from launch.local import Fabric, free_port
from tests.conftest import running_fabric
from tests.fault_proxy import FaultProxy
from tests.helpers import poll_until, replacement_of, wait_for, worker_by_pid
from tests.load import alive, run_streams


def proxied(name: str, orchestrator_port: int, links: tuple[str, ...]) -> tuple[dict[str, FaultProxy], list[str]]:
    """Proxies in front of child `name`'s `links` ("data", "control", "orchestrator") and the flags
    that make it listen behind them and dial the orchestrator through one."""
    proxies, args = {}, []
    for link in links:
        if link == "orchestrator":
            proxies[link] = FaultProxy(orchestrator_port)
            args += ["--orchestrator", f"127.0.0.1:{proxies[link].port}"]
        else:
            port = free_port()
            proxies[link] = FaultProxy(port)
            flag = "--port" if link == "data" else "--control-port"
            args += [flag, str(port), flag.replace("--", "--advertise-"), str(proxies[link].port)]
    return proxies, args


@contextlib.contextmanager
def proxied_fabric(model: Path, tmp: Path, victims: dict[str, tuple[str, ...]],
                   **overrides: object) -> Iterator[tuple[Fabric, dict[str, dict[str, FaultProxy]]]]:
    orchestrator_port = free_port()
    proxies: dict[str, dict[str, FaultProxy]] = {}
    extra: dict[str, list[str]] = {}
    try:
        for name, links in victims.items():
            proxies[name], extra[name] = proxied(name, orchestrator_port, links)
        with running_fabric(model, tmp, orchestrator_port=orchestrator_port, extra=extra, **overrides) as fabric:
            yield fabric, proxies
    finally:
        for ps in proxies.values():
            for p in ps.values():
                p.close()


def silenced_mid_decode(fabric: Fabric, proxies: dict[str, FaultProxy], reference: list[list[int]]) -> list[list[int]]:
    """Runs the streams and drops every packet of the victim's links once tokens flow."""
    received = [0]
    started = threading.Event()
    result: list[list[list[int]]] = []
    runner = threading.Thread(target=lambda: result.append(run_streams(fabric, received, started)))
    runner.start()
    assert started.wait(60)
    for p in proxies.values():
        p.blackhole()
    runner.join(180)
    assert result and received[0] == sum(map(len, reference))  # every token of every stream: nothing lost
    return result[0]


def test_a_silent_peer_of_each_link_kind_is_declared_dead_and_nothing_is_lost(hf_models: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    everything = ("data", "control", "orchestrator")
    victims = {"expert-worker-1": everything, "attention-worker-1": everything, "checkpoint-store-0": everything,
               "expert-worker-2": ("orchestrator",)}
    with proxied_fabric(hf_models["mixtral"], tmp_path, victims, aws=2, ews=3) as (fabric, proxies):
        reference = run_streams(fabric)
        for name in victims:
            pid = fabric.pid(name)
            outputs = silenced_mid_decode(fabric, proxies[name], reference)
            assert outputs == reference, name
            victim = worker_by_pid(fabric.cluster(), pid)["id"]
            wait_for(fabric, f"{name} declared dead", lambda c, pid=pid: worker_by_pid(c, pid)["state"] == "dead")
            # (by its id: a count of the role's live workers raced the replacement, which may be up already)
            wait_for(fabric, f"{name}'s replacement", lambda c, v=victim: replacement_of(c, v) is not None, 120)
            assert alive(pid)  # (it lives on behind its proxies: silent, not dead, until it is killed)
            os.kill(pid, signal.SIGKILL)
            assert run_streams(fabric) == reference  # serving goes on, the replacement included
    orch = (tmp_path / "logs" / "orchestrator.log").read_text()
    silences = [int(ms) for ms in re.findall(r"died \(silent on its link for (\d+) ms", orch)]
    assert len(silences) == len(victims), orch[-3000:]  # each by its lease, not by a closed connection
    print("silent for (ms) when declared dead:", silences)


def test_an_ew_whose_data_port_drops_every_packet_is_routed_around_and_used_again(hf_models: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    """A gray failure: only EW 1's data port drops packets, for 20 s, while 8 streams decode round
    after round; its control port and its orchestrator link answer."""
    victims = {"expert-worker-1": ("data",)}
    with proxied_fabric(hf_models["mixtral"], tmp_path, victims, aws=2, ews=3) as (fabric, proxies):
        reference = run_streams(fabric)
        pid = fabric.pid("expert-worker-1")
        ew = worker_by_pid(fabric.cluster(), pid)["id"]
        proxies["expert-worker-1"]["data"].blackhole()
        deadline = time.monotonic() + 20
        rounds = 0
        while time.monotonic() < deadline:
            assert run_streams(fabric) == reference, f"round {rounds}"
            rounds += 1
        cluster = fabric.cluster()
        aws = [w for w in cluster["workers"] if w["role"] == "attention"]
        assert all(ew in w["stats"].get("unreachable_expert_workers", []) for w in aws)  # routed around...
        assert worker_by_pid(cluster, pid)["state"] == "alive" and cluster["replacements_started"] == 0  # ...not dead
        batches = worker_by_pid(cluster, pid)["stats"]["batches"]
        proxies["expert-worker-1"]["data"].restore()
        wait_for(fabric, f"the AWs using {ew} again", lambda c: all(
            ew not in w["stats"].get("unreachable_expert_workers", [ew]) for w in c["workers"] if w["role"] == "attention"))
        assert run_streams(fabric) == reference
        assert poll_until(lambda: worker_by_pid(fabric.cluster(), pid)["stats"]["batches"] > batches, 30)
        assert fabric.cluster()["replacements_started"] == 0
    aw_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("attention-worker-*.log"))
    assert "no expert result for" in aw_logs and f"{ew} answers again" in aw_logs
