"""`moe-fabric serve`: every role as its own OS process on this machine.

Order: orchestrator (reports its port through a file) -> EWs -> AWs -> gateway; ready when
`GET /v1/models` answers 200. Ctrl-C/SIGTERM stops the children (SIGTERM, then SIGKILL after a
grace period). Children die with the launcher even if it is SIGKILLed (PDEATHSIG plus a
parent-pid watch), so no orphans are left.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fabric.config import ServeConfig
from fabric.errors import FabricError
from fabric.process import die_with_parent
from fabric.transport import resolve_transport_name


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (for local fabrics in tests, benchmarks, experiments)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


class Fabric:
    """The set of child processes of one `serve`; usable from tests and benchmarks too."""

    def __init__(self, cfg: ServeConfig, extra_args: dict[str, list[str]] | None = None, log_dir: str | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.model or str(ensure_demo_model())
        self.transport = resolve_transport_name(cfg.transport)
        self.extra = extra_args or {}
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.log_dir = log_dir
        self.orchestrator_port = 0
        self.port = cfg.port

    def _spawn(self, name: str, role: str, args: list[str], env: dict[str, str] | None = None, extra: bool = True) -> None:
        cmd = [sys.executable, "-m", "fabric.cli", role, *args, "--parent-pid", str(os.getpid()),
               *(self.extra.get(role, []) if extra else [])]
        out = open(Path(self.log_dir) / f"{name}.log", "wb") if self.log_dir else None  # noqa: SIM115
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which then stops
        # the roles in order (gateway drains first, orchestrator last).
        proc = subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=out, stderr=subprocess.STDOUT if out else None,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, proc))

    def _check_children(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise FabricError(f"{name} exited with code {proc.returncode} during start-up")

    def role_args(self) -> dict[str, list[str]]:
        """Each worker role's flags, less `--orchestrator` (the orchestrator's port is not known yet;
        its provisioner adds it when it starts a replacement)."""
        cfg = self.cfg
        common = ["--model", self.model, "--host", cfg.host, "--transport", self.transport,
                  *(["--dtype", cfg.dtype] if cfg.dtype else [])]
        probes = ["--probe-interval-ms", str(cfg.probe_interval_ms), "--probe-misses", str(cfg.probe_misses)]
        sched = ["--sched", cfg.sched]
        return {
            "expert-worker": [*common, *sched, "--gather", cfg.gather, *self.extra.get("expert-worker", [])],
            "attention-worker": [*common, *sched, *probes, "--checkpoint", cfg.checkpoint,
                                 *self.extra.get("attention-worker", [])],
            "checkpoint-store": [*common[:6], *sched, *self.extra.get("checkpoint-store", [])],
        }

    def start(self) -> None:
        cfg = self.cfg
        args = self.role_args()
        with tempfile.TemporaryDirectory() as tmp:
            port_file = Path(tmp) / "orchestrator.port"
            self._spawn("orchestrator", "orchestrator", [
                "--model", self.model, "--expert-workers", str(cfg.expert_workers), "--host", cfg.host,
                "--port", str(cfg.orchestrator_port), "--port-file", str(port_file),
                "--shadows-per-expert", str(cfg.shadows_per_expert), "--provisioner", cfg.provisioner,
                "--spawn-expert-args", shlex.join(args["expert-worker"]),
                "--spawn-attention-args", shlex.join(args["attention-worker"]),
                "--spawn-store-args", shlex.join(args["checkpoint-store"]),
                *(["--spawn-log-dir", self.log_dir] if self.log_dir else [])])
            deadline = time.monotonic() + 60
            while not port_file.exists():
                self._check_children()
                if time.monotonic() > deadline:
                    raise FabricError("the orchestrator did not start within 60s")
                time.sleep(0.05)
            self.orchestrator_port = int(port_file.read_text())
        orch = ["--orchestrator", f"{cfg.host}:{self.orchestrator_port}"]
        for i in range(cfg.checkpoint_stores):
            self._spawn(f"checkpoint-store-{i}", "checkpoint-store", [*args["checkpoint-store"], *orch], extra=False)
        for i in range(cfg.expert_workers):
            self._spawn(f"expert-worker-{i}", "expert-worker", [*args["expert-worker"], *orch], extra=False)
        for i in range(cfg.attention_workers):
            self._spawn(f"attention-worker-{i}", "attention-worker", [*args["attention-worker"], *orch], extra=False)
        name = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
        policy = ["--max-waiting", str(cfg.max_waiting), "--drain-timeout", str(cfg.drain_timeout), "--routing", cfg.routing,
                  "--probe-interval-ms", str(cfg.probe_interval_ms), "--probe-misses", str(cfg.probe_misses),
                  "--resume", cfg.resume, "--sched", cfg.sched]
        key = {"MOE_FABRIC_API_KEY": cfg.api_key} if cfg.api_key else None  # not on the command line: ps shows it
        self._spawn("gateway", "gateway", ["--model", self.model, *orch, "--host", cfg.host, "--port", str(cfg.port),
                                           "--transport", self.transport, *name, *policy], env=key)

    def _all_alive(self) -> bool:
        url = f"http://{self.cfg.host}:{self.orchestrator_port}/cluster"
        with urllib.request.urlopen(url, timeout=2) as r:
            workers = json.loads(r.read())["workers"]
        alive = [w["role"] for w in workers if w["state"] == "alive"]
        return (alive.count("attention") == self.cfg.attention_workers and alive.count("expert") == self.cfg.expert_workers
                and alive.count("checkpoint_store") >= self.cfg.checkpoint_stores)

    def wait_ready(self, timeout: float) -> None:
        """Ready: every worker registered and alive, and the gateway answers `GET /v1/models`."""
        url = f"http://{self.cfg.host}:{self.port}/v1/models"
        deadline = time.monotonic() + timeout
        while True:
            self._check_children()
            try:
                if self._all_alive():
                    auth = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
                    with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=2) as r:
                        if r.status == 200:
                            return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise FabricError(f"the fabric was not ready within {timeout:.0f}s")
            time.sleep(0.1)

    def announce_shutdown(self) -> None:
        """Tells the orchestrator the whole cluster is stopping, so it replaces nobody (best effort)."""
        if not self.orchestrator_port:
            return
        url = f"http://{self.cfg.host}:{self.orchestrator_port}/shutdown"
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=2).close()
        except (urllib.error.URLError, ConnectionError, OSError):
            pass

    def cluster(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.cfg.host}:{self.orchestrator_port}/cluster", timeout=5) as r:
            return dict(json.loads(r.read()))

    def stop(self, grace: float = 10.0) -> None:
        """Idempotent. The gateway first (it drains its running requests), then the AWs, then the
        EWs and checkpoint stores, then the orchestrator (which stops the replacements it
        started), so no worker outlives the orchestrator it reports to; SIGKILL after `grace`."""
        if any(p.poll() is None for n, p in self.procs if n == "orchestrator"):
            self.announce_shutdown()
        def rank(name: str) -> int:  # AWs before the EWs and stores they use, which then see no "lost" peer
            if name in ("gateway", "orchestrator"):
                return 0 if name == "gateway" else 3
            return 1 if name.startswith("attention-worker") else 2

        for r in range(4):
            self._stop_group([p for n, p in self.procs if rank(n) == r],
                             self.cfg.drain_timeout + grace if r == 0 else grace)

    @staticmethod
    def _stop_group(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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
    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    fabric = Fabric(cfg)
    try:
        fabric.start()
        fabric.wait_ready(cfg.ready_timeout)
        print(
            f"moe-fabric ready: http://{cfg.host}:{cfg.port}/v1 (model {fabric.model}, "
            f"{cfg.attention_workers} AW + {cfg.expert_workers} EW over {fabric.transport}; "
            f"cluster view at http://{cfg.host}:{fabric.orchestrator_port}/cluster)",
            flush=True,
        )
        reported: set[str] = set()
        while True:
            for name, proc in fabric.procs:
                if proc.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"moe-fabric: {name} exited with code {proc.returncode}", file=sys.stderr)
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("moe-fabric: stopping", file=sys.stderr)
        fabric.stop()
        failed = [f"{name} ({proc.returncode})" for name, proc in fabric.procs if proc.returncode not in (0, None)]
        if failed:
            print(f"moe-fabric: exited non-zero: {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0
    except FabricError as exc:
        print(f"moe-fabric: {exc}", file=sys.stderr)
        return 1
    finally:
        fabric.stop()
