"""The supervisor of a local fabric (`moe-fabric serve`).

It starts every role process and restarts the orchestrator and the gateways when they die or hang.
It also starts the replacement workers the orchestrator asks for. It tears nothing down for a
death. The fabric handles a dead worker, and a restarted orchestrator rebuilds its state from the
workers. Only `stop()` (Ctrl-C, SIGTERM) stops everything, in order: gateways (they drain),
attention workers, expert workers and stores, the orchestrator last.

The main loop runs in one thread, the one that started every child. So the kernel's parent-death
signal reaches them all if this process dies, even by SIGKILL.

    receive   Every child's notifications (READY=1, WATCHDOG=1), and the orchestrator's requests for
              workers. Notifications use systemd's protocol, one datagram socket per child
              (fabric/notify.py).
    check     Reap children that exited. A restartable one whose watchdog went silent is hung.
    act       Start again what died, backing off while it keeps dying young. Start replacements.

Children also watch this process (`--watch-pid`), so none outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.control import Role
from fabric.messages.supervisor import StartWorker, WorkerExited, WorkerStarted
from fabric.model.store_dir import SERVE_TAG, default_dir, sweep_stale
from fabric.process import die_with_parent
from fabric.wire import decode_bytes, encode_bytes
from launch.config import ServeConfig
from launch.flags import to_argv
from launch.forked import START_WAIT_S, ForkServer
from launch.launcher import COMMAND, MAX_BACKOFF, STOP_ORDER, YOUNG, Launcher, Proc, say

log = logging.getLogger("moe-fabric")
CHECK_LAG_S = 0.5  # a supervisor pass this much later than its 50 ms period does not count against a child


@dataclass
class Child:
    name: str
    role: Role
    # True for the orchestrator and the gateways, which are started again when they die.
    restart: bool
    replaces: str = ""  # a replacement worker: whom it replaces
    # A warm standby serves, and says READY, only once the orchestrator wakes it.
    standby: bool = False
    boot_nice: int = 0  # a replacement boots this much nicer (20: in the idle class)
    proc: Proc | None = None  # (a subprocess.Popen, or a launch.forked.ForkedProc)
    notify: socket.socket | None = None
    provision: socket.socket | None = None  # the orchestrator's provisioning channel (our end)
    ready: bool = False
    pinged: float = 0.0
    started: float = 0.0
    incarnation: int = 0
    backoff: float = 0.0
    due: float | None = None  # when to start it again
    killed: bool = False  # the watchdog killed it; it may take a moment to go
    cpus: str | None = None  # --pin-workers: the CPU it runs on
    device: str | None = None  # --device cuda: the GPU it runs on (cuda:N)


class Supervisor(Launcher):
    def __init__(self, cfg: ServeConfig, model: str, log_dir: str | None = None,
                 extra_args: dict[str, list[str]] | None = None, extra_env: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__(cfg, model, log_dir, extra_args, extra_env)
        self.children: list[Child] = []
        self.lock = threading.Lock()  # guards `children` for readers in other threads
        self._replacements = 0
        # --pin-workers: CPUs of dead workers, for their replacements.
        self._free_cpus: dict[Role, list[str]] = {}
        self._free_devices: dict[Role, list[str]] = {}  # --device cuda: their GPUs
        # --device cuda: workers handed a GPU so far. Worker i gets GPU i mod the GPUs.
        self._devices_given = 0
        self.fork_server = ForkServer() if cfg.fork_server else None
        self._checked = 0.0  # when `_check` last ran

    # -- the processes ------------------------------------------------------------------------
    def plan(self) -> list[Child]:
        cfg = self.cfg
        out = [Child("weight-store", Role.WEIGHT_STORE, restart=True)] if self.configs.weight_store else []
        out += [Child("orchestrator", Role.ORCHESTRATOR, restart=True)]
        out += [Child(f"checkpoint-store-{i}", Role.STORE, False) for i in range(cfg.checkpoint_stores)]
        out += [Child(f"expert-worker-{i}", Role.EXPERT, False) for i in range(cfg.expert_workers)]
        out += [Child(f"attention-worker-{i}", Role.ATTENTION, False) for i in range(cfg.attention_workers)]
        out += [Child(f"{COMMAND[role]}-s{i}", role, False, standby=True)
                for role in (Role.EXPERT, Role.ATTENTION) for i in range(cfg.standby_workers)]
        out += [Child(f"gateway-{i}", Role.GATEWAY, True) for i in range(cfg.gateways)]
        if cfg.pin_workers:
            cpus = sorted(os.sched_getaffinity(0))
            for role in (Role.ATTENTION, Role.EXPERT):  # AW i and EW i on CPU i (standbys float)
                serving = [c for c in out if c.role is role and not c.standby]
                for i, child in enumerate(serving):
                    child.cpus = str(cpus[i % len(cpus)])
        for child in out:
            if child.role in (Role.ATTENTION, Role.EXPERT):
                child.device = self._next_device()
        return out

    def _next_device(self) -> str | None:
        """With --device cuda, the next worker's GPU, round-robin over those visible.

        Otherwise None, and the workers' config says where they run."""
        if self.cfg.device != "cuda":
            return None
        from fabric.device import worker_device  # imports torch: only where GPUs are asked for

        self._devices_given += 1
        return worker_device("cuda", self._devices_given - 1)

    def _argv(self, child: Child, pass_fd: int | None) -> list[str]:
        c = self.configs
        cfg: Any = {Role.ORCHESTRATOR: c.orchestrator, Role.GATEWAY: c.gateway, Role.ATTENTION: c.attention,
                    Role.EXPERT: c.expert, Role.STORE: c.store, Role.WEIGHT_STORE: c.weight_store}[child.role]
        if child.role is Role.ORCHESTRATOR:
            # The first orchestrator has no one to wait for; a restarted one waits for the workers.
            grace = cfg.recovery_grace_s if child.incarnation else 0.0
            cfg = replace(cfg, supervisor_fd=pass_fd, recovery_grace_s=grace)
        # Restarted beside serving workers, its imports yield the CPU to them.
        if child.incarnation:
            cfg = replace(cfg, boot_nice=self.cfg.restart_boot_nice)
        if child.boot_nice:
            cfg = replace(cfg, boot_nice=child.boot_nice)
        if child.standby:
            cfg = replace(cfg, standby=True)
        if child.cpus is not None:
            cfg = replace(cfg, cpus=child.cpus)
        if child.device is not None:
            cfg = replace(cfg, device=child.device)
        command = COMMAND[child.role]
        return [sys.executable, "-m", "launch.cli", command, *to_argv(cfg), *self.extra.get(command, []),
                *self.extra.get(child.name, [])]

    def _spawn(self, child: Child) -> None:
        path = os.path.join(self._sockdir, f"{child.name}.{child.incarnation}.sock")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(path)
        notify.setblocking(False)
        env = {**os.environ, **self.extra_env.get(child.name, {}), "NOTIFY_SOCKET": path}
        env.pop("WATCHDOG_USEC", None)
        if child.restart and self.cfg.watchdog_s > 0:
            env["WATCHDOG_USEC"] = str(int(self.cfg.watchdog_s * 1e6))
        if child.role is Role.GATEWAY and self.cfg.api_key:
            env["MOE_FABRIC_API_KEY"] = self.cfg.api_key  # not on the command line: `ps` shows flags
        pass_fds: tuple[int, ...] = ()
        theirs = None
        if child.role is Role.ORCHESTRATOR and self.cfg.provisioner == "auto":
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.setblocking(False)
            child.provision = ours
            pass_fds = (theirs.fileno(),)
        argv = self._argv(child, theirs.fileno() if theirs is not None else None)
        out: IO[bytes] | None = None
        if self.log_dir:
            suffix = f".{child.incarnation}" if child.incarnation else ""
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.log_dir) / f"{child.name}{suffix}.log", "wb")  # noqa: SIM115
        try:
            # A session of its own. A terminal's Ctrl-C reaches only the supervisor, which then
            # stops the roles in order.
            child.proc = self.fork_server.spawn(argv, env, out, pass_fds) if self.fork_server else None
            if child.proc is None:
                child.proc = subprocess.Popen(argv, preexec_fn=die_with_parent, stdout=out,
                                              stderr=subprocess.STDOUT if out else None, env=env, pass_fds=pass_fds,
                                              start_new_session=True)
        finally:
            if out is not None:
                out.close()
            if theirs is not None:
                theirs.close()
        child.notify, child.ready, child.due, child.killed = notify, False, None, False
        child.started = child.pinged = time.monotonic()

    def _close_sockets(self, child: Child) -> None:
        for sock in (child.notify, child.provision):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        child.notify = child.provision = None

    # -- the main loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Starts the fabric and supervises it until `stop_requested` is set; then stops it."""
        try:
            for gone in sweep_stale():
                log.info("removed the weight store of a serve run that is gone: %s", gone)
            with self.lock:
                self.children = self.plan()
            if self.fork_server is not None:
                self.fork_server.start(START_WAIT_S)  # (the imports, once, before the first process)
            for child in self.children:
                self._spawn(child)
            while not self.stop_requested.is_set() and self.failure is None:
                self._receive(0.05)
                self._check()
                self._act()
        except Exception as exc:  # the supervisor itself failed: stop what it started
            log.exception("the supervisor failed")
            self.failure = self.failure or f"the supervisor failed: {exc}"
        finally:
            self._shutdown()
            self.ready.set()  # wakes a waiter; `failure` says how it went

    def _receive(self, timeout: float) -> None:
        socks = {}
        for child in self.children:
            if child.notify is not None:
                socks[child.notify] = (child, "notify")
            if child.provision is not None:
                socks[child.provision] = (child, "provision")
        readable, _, _ = select.select(list(socks), [], [], timeout)
        for sock in readable:
            child, what = socks[sock]
            while True:
                try:
                    data = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    data = b""
                if what == "notify":
                    self._notified(child, data.decode(errors="replace"))
                    if not data:
                        break
                elif not data:
                    self._close_provision(child)
                    break
                else:
                    self._provision(child, decode_message(*decode_bytes(data)))

    def _close_provision(self, child: Child) -> None:
        if child.provision is not None:
            child.provision.close()
            child.provision = None

    def _notified(self, child: Child, state: str) -> None:
        for line in state.splitlines():
            if line == "READY=1":
                child.ready = True
            if line in ("READY=1", "WATCHDOG=1"):
                child.pinged = time.monotonic()

    def _provision(self, orch: Child, msg: Message) -> None:
        if not isinstance(msg, StartWorker) or msg.role not in (Role.ATTENTION, Role.EXPERT, Role.STORE):
            log.error("moe-fabric: the orchestrator asked for something unexpected: %s", msg)
            return
        if self.stop_requested.is_set():
            return
        self._replacements += 1
        with self.lock:
            free_cpus, free_devices = self._free_cpus.get(msg.role), self._free_devices.get(msg.role)
            cpus = free_cpus.pop(0) if free_cpus and not msg.standby else None  # standbys float over the CPUs
            device = free_devices.pop(0) if free_devices else None
        if device is None and msg.role is not Role.STORE:
            device = self._next_device()
        child = Child(f"{COMMAND[msg.role]}-r{self._replacements}", msg.role, False, replaces=msg.key,
                      boot_nice=msg.boot_nice, standby=msg.standby, cpus=cpus, device=device)
        self._spawn(child)
        with self.lock:
            self.children.append(child)
        assert child.proc is not None
        why = f"to replace {msg.replaces}" if msg.replaces else "to scale out"
        say(f"started {child.name} (pid {child.proc.pid}) {why}"
            + (" (as a standby: the one it replaces was answered by waking one)" if msg.standby else ""))
        self._tell_orchestrator(WorkerStarted(msg.key, child.proc.pid))

    def _tell_orchestrator(self, msg: Message) -> None:
        orch = next((c for c in self.children if c.role is Role.ORCHESTRATOR and c.provision is not None), None)
        if orch is None or orch.provision is None:
            return
        header, frames = encode_message(msg)
        with contextlib.suppress(OSError):
            orch.provision.send(encode_bytes(header, frames))

    def _check(self) -> None:
        now = time.monotonic()
        # A pass this late means this loop did not run (a long spawn, a starved host): the children's
        # silence meanwhile is its own, not theirs.
        lag = now - self._checked - CHECK_LAG_S if self._checked else 0.0
        self._checked = now
        for child in list(self.children):
            if lag > 0:
                child.pinged += lag
            proc = child.proc
            if proc is None or child.due is not None:
                continue
            code = proc.poll()
            if code is None:
                if (child.restart and child.ready and not child.killed and self.cfg.watchdog_s > 0
                        and now - child.pinged > self.cfg.watchdog_s):
                    say(f"{child.name} (pid {proc.pid}) is hung: no watchdog ping for {now - child.pinged:.1f} s; "
                         "killing it")
                    child.killed = True
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGKILL)
                continue
            self._exited(child, code, now)
        if not self.was_ready and all(c.ready for c in self.children
                                      if c.proc is not None and not c.replaces and not c.standby):
            self.was_ready = True
            self.ready.set()

    def _exited(self, child: Child, code: int, now: float) -> None:
        assert child.proc is not None
        pid = child.proc.pid
        self._close_sockets(child)
        if not self.was_ready:
            self.failure = f"{child.name} exited with code {code} during start-up"
            return
        if child.replaces or child.role in (Role.ATTENTION, Role.EXPERT, Role.STORE):
            say(f"{child.name} (pid {pid}) exited with code {code}; the fabric takes over its work")
            self._tell_orchestrator(WorkerExited(pid, code))
            with self.lock:
                self.children.remove(child)
                if child.cpus is not None:  # its replacement gets its CPU
                    self._free_cpus.setdefault(child.role, []).append(child.cpus)
                if child.device is not None:  # and its GPU
                    self._free_devices.setdefault(child.role, []).append(child.device)
            return
        young = now - child.started < YOUNG
        child.backoff = min(MAX_BACKOFF, child.backoff * 2 if young and child.backoff else self.cfg.restart_delay_s)
        child.due = now + child.backoff
        child.ready = False
        say(f"{child.name} (pid {pid}) exited with code {code}; starting it again in {child.backoff:.1f} s")

    def _act(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.due is not None and now >= child.due:
                child.incarnation += 1
                self._spawn(child)
                assert child.proc is not None
                say(f"{child.name} started again (pid {child.proc.pid})")

    # -- stopping -----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        if any(c.role is Role.ORCHESTRATOR and c.proc is not None and c.proc.poll() is None for c in self.children):
            self.announce_shutdown()
        for roles in STOP_ORDER:
            group = [c for c in self.children if c.role in roles and c.proc is not None]
            grace = self.cfg.drain_timeout + 10.0 if roles == [Role.GATEWAY] else 10.0
            _stop_group([c.proc for c in group if c.proc is not None], grace)
        for child in self.children:
            self._close_sockets(child)
        if self.fork_server is not None:
            self.fork_server.close()
        shutil.rmtree(self._sockdir, ignore_errors=True)
        # Its process removes it. This covers one that was killed.
        if self.configs.weight_store is not None:
            shutil.rmtree(self.configs.weight_store.dir, ignore_errors=True)

    def weight_store_dir(self) -> str | None:
        return str(default_dir(f"{SERVE_TAG}{os.getpid()}")) if self.cfg.weight_store and self.cfg.compute != "sim" else None

    # -- for callers in other threads -----------------------------------------------------------
    def snapshot(self) -> list[tuple[str, Proc]]:
        with self.lock:
            return [(c.name, c.proc) for c in self.children if c.proc is not None]


def _stop_group(procs: list[Proc], grace: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a stopped (hung) process handles SIGTERM once woken
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
