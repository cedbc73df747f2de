"""What every launcher of a whole fabric shares.

The local supervisor (launch/supervisor.py) and the Ray driver (launch/ray_cluster.py) both hold a
`ServeConfig`, the cluster secret and TLS, the role configs they start processes with, and the
orchestrator's admin endpoint."""

from __future__ import annotations

import abc
import json
import os
import random
import socket
import ssl
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from fabric.auth import create_secret_file, load_secret
from fabric.errors import FabricError
from fabric.messages.control import Role
from fabric.tls import Tls
from fabric.transport import resolve_transport_name
from launch.config import ServeConfig

COMMAND = {Role.ORCHESTRATOR: "orchestrator", Role.GATEWAY: "gateway", Role.ATTENTION: "attention-worker",
           Role.EXPERT: "expert-worker", Role.STORE: "checkpoint-store", Role.WEIGHT_STORE: "weight-store"}
STOP_ORDER = [[Role.GATEWAY], [Role.ATTENTION], [Role.EXPERT, Role.STORE], [Role.ORCHESTRATOR, Role.WEIGHT_STORE]]
# Seconds. A restartable process that dies younger than this backs off further.
YOUNG = 30.0
MAX_BACKOFF = 10.0


class Proc(Protocol):
    """A fabric process as tests and experiments see it, wherever it runs."""

    pid: int

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host`, below the kernel's ephemeral range where it can.

    A port the kernel hands to `bind(0)` may be handed again to another process's listener, a
    worker's or a control port, before whoever asked binds it. The gateways bind theirs only once
    they can serve."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low // 2), low) if low > 2048 else 0
        if port in _given:  # handed out already, maybe not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _given.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_given: set[int] = set()  # the ports `free_port` has returned in this process


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def say(msg: str) -> None:
    print(f"moe-fabric: {msg}", file=sys.stderr, flush=True)


class Launcher(abc.ABC):
    def __init__(self, cfg: ServeConfig, model: str, log_dir: str | None = None,
                 extra_args: dict[str, list[str]] | None = None, extra_env: dict[str, dict[str, str]] | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.log_dir = log_dir
        # Role command, or one child's name -> flags added to its processes.
        self.extra = extra_args or {}
        # Process name -> environment variables, for tests' fault hooks.
        self.extra_env = extra_env or {}
        self.transport = resolve_transport_name(cfg.transport)
        self.orchestrator_port = cfg.orchestrator_port or free_port(cfg.host)
        # Mode 0700. It holds notify sockets and this run's secret.
        self._sockdir = tempfile.mkdtemp(prefix="moe-fabric-")
        self.secret_file: str | None = None
        if cfg.auth:
            self.secret_file = cfg.cluster_secret_file or os.path.join(self._sockdir, "cluster-secret")
            if create_secret_file(self.secret_file) and cfg.cluster_secret_file:
                say(f"wrote a new cluster secret to {self.secret_file}")
        self.secret = load_secret(self.secret_file) if self.secret_file else None
        self.tls = Tls.of(cfg.tls_cert, cfg.tls_key)
        self.scheme = "https" if self.tls else "http"
        self.configs = cfg.role_configs(model, self.transport, self.orchestrator_port, os.getpid(), self.secret_file,
                                        self.weight_store_dir())
        self.stop_requested = threading.Event()
        self.ready = threading.Event()
        self.failure: str | None = None  # why start-up failed
        self.was_ready = False

    def weight_store_dir(self) -> str | None:
        """Where this run's weight store publishes. None means the workers read the checkpoint."""
        return None

    @abc.abstractmethod
    def run(self) -> None:
        """Starts the fabric and supervises it until `stop_requested` is set; then stops it."""

    @abc.abstractmethod
    def snapshot(self) -> list[tuple[str, Proc]]:
        """(name, process) of every process now; for a restarted one, its newest."""

    @property
    def orchestrator_host(self) -> str:
        """Where the orchestrator listens now."""
        return self.cfg.host

    def where(self) -> str:
        """Where the fabric runs, for the ready line."""
        return "this machine"

    # -- the orchestrator's admin endpoint ----------------------------------------------------
    def ssl(self) -> ssl.SSLContext | None:
        return self.tls.client if self.tls is not None else None

    def admin_request(self, path: str, method: str = "GET") -> urllib.request.Request:
        """A request to the orchestrator's admin endpoint `path`, with the cluster secret."""
        return urllib.request.Request(f"{self.scheme}://{self.orchestrator_host}:{self.orchestrator_port}{path}",
                                      data=b"" if method == "POST" else None, method=method,
                                      headers={"Authorization": f"Bearer {self.secret.decode()}"} if self.secret else {})

    def announce_shutdown(self) -> None:
        """Tells the orchestrator the whole cluster is stopping, so it replaces nobody. Best effort."""
        try:
            urllib.request.urlopen(self.admin_request("/shutdown", "POST"), timeout=2, context=self.ssl()).close()
        except (urllib.error.URLError, ConnectionError, OSError):
            pass

    def cluster(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.admin_request("/cluster"), timeout=5, context=self.ssl()) as r:
            return dict(json.loads(r.read()))


def wait_ready(launcher: Launcher, timeout: float) -> None:
    """Returns once every process of the fabric serves. Raises FabricError if start-up failed."""
    if not launcher.ready.wait(timeout):
        raise FabricError(f"the fabric was not ready within {timeout:.0f}s")
    if launcher.failure is not None:
        raise FabricError(launcher.failure)
