"""`RoleHost`: the Ray actor that runs one fabric process on a Ray node (`serve --cluster ray`).

The fabric process is a child OS process of the actor, started by `moe-fabric <role>` exactly as
the local supervisor starts it. It is tied to the actor's life by the kernel's parent-death signal
and `--watch-pid`. When the node dies with its raylet, the actor's worker process exits and takes
the fabric process with it, at once. The actor speaks for the process to the driver
(launch/ray_cluster.py). It reports the node, pid, readiness and exit, passes on the orchestrator's
requests for replacements, and takes signals from experiments.

Secrets never travel in clear. The actor makes a key pair when it starts, and `hello` hands out the
public half. The driver seals the cluster secret and the API key to it (launch/sealing.py). The
actor writes the secret to a 0600 file in a private 0700 directory on its node.

A restartable process (orchestrator, gateway) is started again here, with backoff, when it exits or
its watchdog goes silent. When the whole node dies, Ray restarts the actor (`max_restarts`) on
another node, and the driver starts it again there.

This module imports no role and no torch, so the actor stays a light process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from fabric.process import die_with_parent
from launch.launcher import MAX_BACKOFF, YOUNG
from launch.sealing import Opener


def node_label(node_id: str) -> str:
    """A Ray node's name in the fabric, as in `$MOE_FABRIC_NODE` of its processes and `GET /cluster`."""
    return f"ray-{node_id[:8]}"


class RoleHost:
    def __init__(self) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.node_id: str = ctx.get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()
        # Ray started us again, as our node died.
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.opener = Opener()
        self.dir = tempfile.mkdtemp(prefix="moe-fabric-host-")  # 0700: the secret, the notify socket
        self.keeper: Keeper | None = None

    def hello(self) -> dict[str, Any]:
        return {"public_key": self.opener.public, "node_id": self.node_id, "node_ip": self.node_ip,
                "restarted": self.restarted, "pid": os.getpid()}

    def start(self, spec: dict[str, Any], box: bytes | None, orchestrator: str | None) -> dict[str, Any]:
        """Starts the fabric process `spec` describes (see `RaySupervisor._spec`) and returns its pid."""
        if self.keeper is not None:
            return {"pid": self.keeper.pid}
        secrets: dict[str, str] = json.loads(self.opener.open(box)) if box is not None else {}
        env = {**spec["env"], "MOE_FABRIC_NODE": node_label(self.node_id)}
        if secrets.get("api_key"):
            env["MOE_FABRIC_API_KEY"] = secrets["api_key"]
        flags = ["--host", self.node_ip, "--watch-pid", str(os.getpid())]
        if secrets.get("cluster_secret"):
            path = os.path.join(self.dir, "cluster-secret")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets["cluster_secret"])
            flags += ["--cluster-secret-file", path]
        if spec["role"] != "orchestrator":
            self.set_orchestrator(orchestrator or "")
            flags += ["--orchestrator-file", os.path.join(self.dir, "orchestrator")]
        self.keeper = Keeper(spec, flags, env, self.dir, again=self.restarted)
        self.keeper.start()
        if not self.keeper.spawned.wait(30):
            raise RuntimeError(f"{spec['name']} did not start within 30 s")
        if self.keeper.failed is not None:
            raise RuntimeError(f"{spec['name']} did not start: {self.keeper.failed}")
        return {"pid": self.keeper.pid}

    def set_orchestrator(self, address: str) -> None:
        """Records where the orchestrator is now. The process reads it before each connection attempt."""
        if not address:
            return
        path = os.path.join(self.dir, "orchestrator")
        with open(path + ".new", "w") as f:
            f.write(address + "\n")
        os.replace(path + ".new", path)

    def until_ready(self, timeout: float) -> bool:
        """True once the process has said READY=1. False means not yet, or it exited."""
        return self.keeper is not None and self.keeper.ready.wait(timeout)

    def exited(self) -> int | None:
        """Blocks until the process has exited for good and returns its code.

        For a restartable one that is until `stop`."""
        assert self.keeper is not None
        self.keeper.done.wait()
        return self.keeper.code

    def state(self) -> dict[str, Any]:
        k = self.keeper
        return {"pid": k.pid if k else 0, "ready": bool(k and k.ready.is_set()), "code": k.code if k else None,
                "incarnation": k.incarnation if k else 0, "node_id": self.node_id}

    def requests(self, timeout: float) -> list[bytes]:
        """The orchestrator's requests for replacement workers. It waits up to `timeout` for one."""
        if self.keeper is None:
            time.sleep(timeout)
            return []
        out = []
        try:
            out.append(self.keeper.requests.get(timeout=timeout))
            while True:
                out.append(self.keeper.requests.get_nowait())
        except queue.Empty:
            pass
        return out

    def tell(self, data: bytes) -> None:
        """Passes a message to the orchestrator's provisioner (WorkerStarted, WorkerExited)."""
        if self.keeper is not None:
            self.keeper.tell(data)

    def signal(self, signum: int) -> int:
        """Sends `signum` to the process now. Returns its pid, or 0 if none runs."""
        k = self.keeper
        if k is None or k.proc is None or k.proc.poll() is not None:
            return 0
        with contextlib.suppress(ProcessLookupError):
            k.proc.send_signal(signum)
        return k.proc.pid

    def stop(self, grace: float) -> int | None:
        """Sends SIGTERM, so it drains and leaves, then SIGKILL after `grace`. Returns the exit code."""
        k = self.keeper
        if k is None:
            return None
        k.stop(grace)
        shutil.rmtree(self.dir, ignore_errors=True)
        return k.code


class Keeper(threading.Thread):
    """Starts the process from this thread and keeps it.

    The parent-death signal follows the thread that started a child, so this thread lives as long
    as the process. It reads the process's notifications, kills it when its watchdog goes silent,
    and starts a restartable one again."""

    def __init__(self, spec: dict[str, Any], flags: list[str], env: dict[str, str], workdir: str, again: bool) -> None:
        super().__init__(name=f"keeper-{spec['name']}", daemon=True)
        self.spec, self.flags, self.env, self.workdir = spec, flags, env, workdir
        self.incarnation = 1 if again else 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.code: int | None = None
        self.failed: str | None = None
        self.spawned, self.ready, self.done = threading.Event(), threading.Event(), threading.Event()
        self.stopping = threading.Event()
        self.requests: queue.Queue[bytes] = queue.Queue()
        self._provision: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._pinged = 0.0

    # -- the thread ---------------------------------------------------------------------------
    def run(self) -> None:
        backoff = 0.0
        while True:
            try:
                notify = self._spawn()
            except OSError as exc:
                self.failed = str(exc)
                self.spawned.set()
                self.done.set()
                return
            self.spawned.set()
            started = time.monotonic()
            code = self._watch(notify)
            self.code = code
            if self.stopping.is_set() or not self.spec["restart"]:
                self.done.set()
                return
            young = time.monotonic() - started < YOUNG
            backoff = min(MAX_BACKOFF, backoff * 2 if young and backoff else self.spec["restart_delay_s"])
            print(f"moe-fabric: {self.spec['name']} (pid {self.pid}) exited with code {code}; starting it again "
                  f"in {backoff:.1f} s", file=sys.stderr, flush=True)
            if self.stopping.wait(backoff):
                self.done.set()
                return
            self.incarnation += 1

    def _spawn(self) -> socket.socket:
        spec = self.spec
        path = os.path.join(self.workdir, f"notify.{self.incarnation}")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(path)
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": path}
        env.pop("WATCHDOG_USEC", None)
        if spec["restart"] and spec["watchdog_s"] > 0:
            env["WATCHDOG_USEC"] = str(int(spec["watchdog_s"] * 1e6))
        argv = [sys.executable, "-m", "launch.cli", spec["command"],
                *(spec["argv_again"] if self.incarnation else spec["argv"]), *self.flags]
        theirs = None
        if spec["role"] == "orchestrator" and spec["provision"]:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with self._send_lock:
                self._provision = ours
            argv += ["--supervisor-fd", str(theirs.fileno())]
        out: IO[bytes] | None = None
        if spec["log_dir"]:
            suffix = f".{self.incarnation}" if self.incarnation else ""
            out = open(os.path.join(spec["log_dir"], f"{spec['name']}{suffix}.log"), "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, preexec_fn=die_with_parent, stdout=out,
                                         stderr=subprocess.STDOUT if out else None, env=env, start_new_session=True,
                                         pass_fds=(theirs.fileno(),) if theirs is not None else ())
        finally:
            if out is not None:
                out.close()
            if theirs is not None:
                theirs.close()
        self.pid = self.proc.pid
        self._pinged = time.monotonic()
        return notify

    def _watch(self, notify: socket.socket) -> int:
        assert self.proc is not None
        killed = False
        try:
            while True:
                socks = [notify] + ([self._provision] if self._provision is not None else [])
                readable, _, _ = select.select(socks, [], [], 0.05)
                for sock in readable:
                    self._read(sock, sock is notify)
                code = self.proc.poll()
                if code is not None:
                    return code
                silent = time.monotonic() - self._pinged
                if (self.spec["restart"] and self.ready.is_set() and not killed and self.spec["watchdog_s"] > 0
                        and silent > self.spec["watchdog_s"]):
                    print(f"moe-fabric: {self.spec['name']} (pid {self.pid}) is hung: no watchdog ping for "
                          f"{silent:.1f} s; killing it", file=sys.stderr, flush=True)
                    killed = True
                    self.proc.kill()
        finally:
            notify.close()
            with self._send_lock:
                if self._provision is not None:
                    self._provision.close()
                    self._provision = None

    def _read(self, sock: socket.socket, is_notify: bool) -> None:
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if is_notify:
            for line in data.decode(errors="replace").splitlines():
                if line in ("READY=1", "WATCHDOG=1"):
                    self._pinged = time.monotonic()
                if line == "READY=1":
                    self.ready.set()
        elif data:
            self.requests.put(data)
        else:  # the orchestrator closed its end
            with self._send_lock:
                if self._provision is not None:
                    self._provision.close()
                    self._provision = None

    # -- from other threads -------------------------------------------------------------------
    def tell(self, data: bytes) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            if self._provision is not None:
                self._provision.send(data)

    def stop(self, grace: float) -> None:
        self.stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a stopped (hung) process handles SIGTERM once woken
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.done.wait(grace + 5)
