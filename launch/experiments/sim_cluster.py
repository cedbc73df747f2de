"""A simulated fabric on this machine for the scale experiment.

The orchestrator, a checkpoint store and a gateway run as usual. The `--compute sim` AWs and EWs
are hosted many per process (`--sim-workers`, fabric/sim_host.py), so that 128 + 128 workers fit
on a few cores.

Faults:
- `kill_worker` tells a worker's host process to kill it. It dies as on SIGKILL, and the host
  answers with the time of death.
- `kill_orchestrator` SIGKILLs the orchestrator.
- `start_orchestrator` starts a new one on the same port, as `serve`'s supervisor would.

Dozens of workers share one event loop here, on 2 cores shared by all. A loop's lag is what a
dedicated core's would never be. So probes are patient (`probe_interval_ms`, 50 ms rather than
10), and so are the orchestrator's leases (`lease_ms`, 3 s rather than 700 ms). A loop shared by
dozens of workers sends their heartbeats late. A killed worker's connections close, so its death
is seen without probes or leases.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from fabric.auth import create_secret_file, load_secret
from fabric.config import (
    AttentionWorkerConfig,
    CheckpointStoreConfig,
    ExpertWorkerConfig,
    GatewayConfig,
    OrchestratorConfig,
)
from fabric.errors import FabricError
from fabric.process import die_with_parent
from launch.flags import to_argv
from launch.launcher import free_port


class Host:
    """One process of the simulation, and, for a worker host, the deaths it reported."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.name, self.proc = name, proc
        self.killed: dict[str, float] = {}
        self.answered = threading.Condition()
        if proc.stdout is not None:
            threading.Thread(target=self._read, name=f"{name}-out", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            words = raw.decode(errors="replace").split()
            with self.answered:
                if len(words) == 3 and words[0] == "killed":
                    self.killed[words[1]] = float(words[2])
                elif len(words) == 2 and words[0] == "unknown":
                    self.killed[words[1]] = math.nan
                self.answered.notify_all()


class SimCluster:
    def __init__(self, model: Path, aws: int, ews: int, per_process: int, log_dir: Path, attention_ms: float,
                 expert_ms: float, kv_cache_mib: int = 16, probe_interval_ms: float = 50.0,
                 lease_ms: float = 3000.0) -> None:
        self.model, self.aws, self.ews, self.log_dir = str(model), aws, ews, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="moe-fabric-sim-")
        self.secret_file = os.path.join(self._dir, "cluster-secret")
        create_secret_file(self.secret_file)
        self.secret = load_secret(self.secret_file)
        self.port = free_port()
        self.gateway_port = free_port()
        addr = f"127.0.0.1:{self.port}"
        common: dict[str, Any] = {"model": self.model, "orchestrator": addr, "transport": "tcp",
                                  "cluster_secret_file": self.secret_file}
        self.orchestrator_cfg = OrchestratorConfig(self.model, expert_workers=ews, port=self.port,
                                                   cluster_secret_file=self.secret_file, recovery_grace_s=0.0,
                                                   lease_ms=lease_ms)
        self.store_cfg = CheckpointStoreConfig(**common, bucket_mib=64)
        self.gateway_cfg = GatewayConfig(**common, port=self.gateway_port, max_waiting=4096,
                                         probe_interval_ms=probe_interval_ms)
        self.aw_cfg = AttentionWorkerConfig(**common, compute="sim", sim_control=True, kv_cache_mib=kv_cache_mib,
                                            sim_attention_ms=attention_ms, max_running=16,
                                            probe_interval_ms=probe_interval_ms)
        self.ew_cfg = ExpertWorkerConfig(**common, compute="sim", sim_control=True, sim_expert_ms=expert_ms,
                                         gather="threshold", max_wait_ms=0.0)
        self.per_process = per_process
        self.hosts: list[Host] = []
        self.orchestrator: Host | None = None
        self.orchestrator_started = 0.0
        self.incarnation = 0

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, command: str, cfg: Any, control: bool = False) -> Host:
        out: IO[bytes] = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115
        try:
            proc = subprocess.Popen([sys.executable, "-m", "launch.cli", command, *to_argv(cfg)],
                                    stdin=subprocess.PIPE if control else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if control else out, stderr=out,
                                    preexec_fn=die_with_parent, start_new_session=True,
                                    env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        finally:
            out.close()
        host = Host(name, proc)
        self.hosts.append(host)
        return host

    def _split(self, n: int) -> list[int]:
        procs = max(1, math.ceil(n / self.per_process))
        return [n // procs + (1 if i < n % procs else 0) for i in range(procs)]

    def start(self) -> None:
        self.start_orchestrator()
        self._spawn("checkpoint-store", "checkpoint-store", self.store_cfg)
        for i, n in enumerate(self._split(self.ews)):
            self._spawn(f"ew-host-{i}", "expert-worker", replace(self.ew_cfg, sim_workers=n), control=True)
        for i, n in enumerate(self._split(self.aws)):
            self._spawn(f"aw-host-{i}", "attention-worker", replace(self.aw_cfg, sim_workers=n), control=True)
        self._spawn("gateway", "gateway", self.gateway_cfg)

    def start_orchestrator(self, recovery_grace_s: float = 0.0) -> None:
        cfg = replace(self.orchestrator_cfg, recovery_grace_s=recovery_grace_s)
        self.orchestrator_started = time.time()
        self.orchestrator = self._spawn(f"orchestrator.{self.incarnation}", "orchestrator", cfg)
        self.incarnation += 1

    def kill_orchestrator(self) -> float:
        assert self.orchestrator is not None
        self.orchestrator.proc.send_signal(signal.SIGKILL)
        at = time.time()
        self.orchestrator.proc.wait()
        self.hosts.remove(self.orchestrator)
        return at

    def kill_worker(self, worker_id: str, pid: int, timeout: float = 10.0) -> float:
        """Kills one simulated worker and returns the wall-clock time it died."""
        host = next((h for h in self.hosts if h.proc.pid == pid and h.proc.stdin is not None), None)
        if host is None or host.proc.stdin is None:
            raise FabricError(f"no host process {pid} for {worker_id}")
        host.proc.stdin.write(f"kill {worker_id}\n".encode())
        host.proc.stdin.flush()
        with host.answered:
            if not host.answered.wait_for(lambda: worker_id in host.killed, timeout):
                raise FabricError(f"{host.name} did not kill {worker_id} within {timeout:.0f} s")
        at = host.killed[worker_id]
        if math.isnan(at):
            raise FabricError(f"{host.name} has no live worker {worker_id}")
        return at

    def stop(self) -> None:
        for h in self.hosts:
            with contextlib.suppress(ProcessLookupError):
                h.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for h in self.hosts:
            try:
                h.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()
        self.hosts.clear()
        with contextlib.suppress(OSError):
            os.unlink(self.secret_file)
            os.rmdir(self._dir)

    # -- the orchestrator's view -----------------------------------------------------------------
    def cluster(self, timeout: float = 10.0) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/cluster?routing=0",
                                     headers={"Authorization": f"Bearer {self.secret.decode()}"} if self.secret else {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))

    def wait_ready(self, timeout: float, say: Any = None) -> float:
        """Waits until every AW and EW serves and the gateway answers. Returns the seconds taken."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < timeout:
            for h in self.hosts:
                if h.proc.poll() is not None:
                    raise FabricError(f"{h.name} exited with code {h.proc.returncode} (see {self.log_dir})")
            try:
                c = self.cluster()
            except OSError:
                time.sleep(0.5)
                continue
            alive = {r: sum(1 for w in c["workers"] if w["role"] == r and w["state"] == "alive")
                     for r in ("attention", "expert", "gateway", "checkpoint_store")}
            line = " ".join(f"{r}={n}" for r, n in alive.items())
            if say is not None and line != last:
                say(f"{time.monotonic() - t0:5.1f} s: {line}")
                last = line
            if alive["attention"] >= self.aws and alive["expert"] >= self.ews and alive["gateway"] and c.get("epoch") \
                    and self._gateway_listens():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise FabricError(f"the simulated fabric was not ready within {timeout:.0f} s (see {self.log_dir})")

    def _gateway_listens(self) -> bool:
        """Whether the gateway's HTTP port takes connections (it registers before it binds them)."""
        try:
            with socket.create_connection(("127.0.0.1", self.gateway_port), timeout=1.0):
                return True
        except OSError:
            return False

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
