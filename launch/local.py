"""A local fabric: `moe-fabric serve`, and the handle tests, benchmarks and experiments hold.

`Fabric` runs a `Supervisor` (launch/supervisor.py) in a thread of its own, which lives as long as
the fabric. The kernel's parent-death signal follows the thread that started a child. `serve` runs
the supervisor in the main thread and stops it on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fabric.errors import FabricError
from launch.config import ServeConfig
from launch.launcher import Launcher, Proc, free_port, wait_ready

__all__ = ["Fabric", "default_model_dir", "ensure_demo_model", "free_port", "serve"]


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-fabric"
    return cache / "demo-mixtral-tiny-seed0"


def ensure_demo_model() -> Path:
    path = default_model_dir()
    if not (path / "config.json").exists():
        from fabric.model.demo import write_demo_model

        print(f"writing the demo model to {path} ...", file=sys.stderr)
        write_demo_model(path, arch="mixtral", seed=0, size="tiny")
    return path


def make_launcher(cfg: ServeConfig, model: str, log_dir: str | None = None,
                  extra_args: dict[str, list[str]] | None = None,
                  extra_env: dict[str, dict[str, str]] | None = None) -> Launcher:
    """The supervisor of `--cluster local`, or the Ray driver of `--cluster ray`."""
    if cfg.cluster == "ray":
        from launch.ray_cluster import RaySupervisor

        return RaySupervisor(cfg, model, log_dir, extra_args, extra_env)
    from launch.supervisor import Supervisor

    return Supervisor(cfg, model, log_dir, extra_args, extra_env)


class Fabric:
    """The processes of one fabric, supervised from a background thread.

    `cfg.cluster` says where: on this machine, or on a Ray cluster."""

    def __init__(self, cfg: ServeConfig, extra_args: dict[str, list[str]] | None = None, log_dir: str | None = None,
                 extra_env: dict[str, dict[str, str]] | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.model or str(ensure_demo_model())
        self.supervisor = make_launcher(cfg, self.model, log_dir, extra_args, extra_env)
        self.log_dir = log_dir
        self.port = cfg.port
        self.orchestrator_port = self.supervisor.orchestrator_port
        self.transport = self.supervisor.transport
        self._thread: threading.Thread | None = None

    @property
    def procs(self) -> list[tuple[str, Proc]]:
        """(name, process) of every child now; for a restarted one, its newest process."""
        return self.supervisor.snapshot()

    def pid(self, name: str) -> int:
        return next(p.pid for n, p in self.procs if n == name)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.supervisor.run, name="supervisor", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.supervisor, timeout)

    def cluster(self) -> dict[str, Any]:
        return self.supervisor.cluster()

    @property
    def secret_file(self) -> Path | None:
        return Path(self.supervisor.secret_file) if self.supervisor.secret_file else None

    def admin_headers(self) -> dict[str, str]:
        """`Authorization` for the admin endpoints: /cluster, /shutdown, the gateways' /metrics."""
        secret = self.supervisor.secret
        return {"Authorization": f"Bearer {secret.decode()}"} if secret else {}

    def stop(self) -> None:
        """Stops every process in order and waits for the supervisor. Idempotent."""
        self.supervisor.stop_requested.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Fabric:
        try:
            self.start()
            self.wait_ready(self.cfg.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(cfg: ServeConfig) -> int:
    model = cfg.model or str(ensure_demo_model())
    sup = make_launcher(cfg, model)

    def on_signal(signum: int, frame: object) -> None:
        sup.stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def announce() -> None:
        try:
            wait_ready(sup, cfg.ready_timeout)
        except FabricError as exc:
            sup.failure = sup.failure or str(exc)
            sup.stop_requested.set()
            return
        if sup.stop_requested.is_set():
            return
        print(f"moe-fabric ready: {sup.scheme}://{cfg.host}:{cfg.port}/v1 (model {model}, {cfg.attention_workers} AW + "
              f"{cfg.expert_workers} EW + {cfg.gateways} gateways over {sup.transport} on {sup.where()}; "
              f"cluster view at {sup.scheme}://{sup.orchestrator_host}:{sup.orchestrator_port}/cluster"
              f"{f' with the secret in {sup.secret_file} as Bearer' if sup.secret_file else ''})", flush=True)

    threading.Thread(target=announce, name="announce", daemon=True).start()
    sup.run()  # until Ctrl-C / SIGTERM, or a failed start-up
    if sup.failure is not None:
        print(f"moe-fabric: {sup.failure}", file=sys.stderr)
        return 1
    print("moe-fabric: stopped", file=sys.stderr)
    return 0
