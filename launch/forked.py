"""The supervisor's side of the fork server (launch/zygote.py): start role processes forked from a
process that has torch imported already, and handle them as children.

`ForkServer.spawn` returns a `ForkedProc`, which behaves as the `subprocess.Popen` the supervisor
would otherwise have made (pid, poll, wait, send_signal, kill). It returns None where the process
must be started the usual way: the server is not up or failed to fork, the platform has no child
subreaper, or the process's environment differs from the server's where a library reads it on
import (`zygote.IMPORT_ENV`). The server is started again for the next process after it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from fabric.messages.base import decode_message, encode_message
from fabric.messages.supervisor import Fork, Forked, ForkReady
from fabric.process import die_with_parent
from fabric.wire import decode_bytes, encode_bytes
from launch import zygote

log = logging.getLogger("moe-fabric")

PR_SET_CHILD_SUBREAPER = 36
# A server that takes longer to fork is given up on (a fork takes milliseconds). The process it may
# still fork then ends at once (zygote.py: it waits for the server's go, which never comes).
ANSWER_TIMEOUT_S = 2.0
MAX_FAILURES = 3  # servers in a row that fail before they are ready: no more are started
# How long a fabric's first processes wait for the server's imports (seconds; more on a loaded host).
START_WAIT_S = 120.0


def become_subreaper() -> bool:
    """Makes this process adopt its orphaned descendants, the forked role processes among them (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


class ForkedProc:
    """A role process the fork server started, which this (subreaper) process waits for as a child."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its code is lost
                    self.returncode = -signal.SIGKILL
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (never a reaped pid, which may be someone else's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The fork server of one supervisor. Call it from one thread.

    `start` starts it. `spawn` never waits for it to start (that takes seconds): until it says it is
    ready, and while it is down, processes are started the usual way, and a dead one is started again."""

    def __init__(self) -> None:
        self.usable = True  # until the platform or repeated failures say otherwise
        self._subreaper = False
        self._failures = 0  # servers in a row that died or failed before they were ready
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._env: dict[str, str] = {}
        self._ready = False
        self.forked = 0  # processes started through it
        self.starts = 0  # servers started

    def start(self, wait_s: float = 0.0) -> bool:
        """Starts the server if it is not up, and waits up to `wait_s` for it to be ready. Returns whether it is."""
        if self.usable and not self._subreaper:
            self._subreaper = self.usable = become_subreaper()
        if not self.usable:
            return False
        if not self._up():
            self._start()
        return self._check_ready(wait_s)

    def spawn(self, argv: list[str], env: dict[str, str], out: IO[bytes] | None,
              pass_fds: tuple[int, ...] = ()) -> ForkedProc | None:
        """Starts `argv` forked from the server, or returns None: start it the usual way."""
        if not self.usable or argv[1:3] != zygote.CLI or not self.start():
            return None
        assert self._sock is not None
        if zygote.import_env(env) != zygote.import_env(self._env):
            return None
        fds = ([out.fileno()] if out is not None else []) + list(pass_fds)
        request = encode_bytes(*encode_message(Fork(argv, env, out is not None, list(pass_fds))))
        try:
            socket.send_fds(self._sock, [request], fds)
            self._sock.settimeout(ANSWER_TIMEOUT_S)
            data = self._sock.recv(1 << 16)
            answer = decode_message(*decode_bytes(data)) if data else None
        except (OSError, ValueError) as exc:
            log.warning("the fork server failed (%s); starting processes the usual way until it is back", exc)
            self.close(kill=True)
            return None
        if not isinstance(answer, Forked) or not answer.pid:
            log.warning("the fork server could not start %s: %s", argv[3] if len(argv) > 3 else argv,
                        answer.error if isinstance(answer, Forked) else "no answer")
            if answer is None:
                self.close(kill=True)
            return None
        self.forked += 1
        return ForkedProc(answer.pid, argv)

    @property
    def pid(self) -> int | None:
        """The server's process id while one is started (it may have died since: `poll` on `start` tells)."""
        return self._proc.pid if self._proc is not None else None

    def _up(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._sock is not None

    def _check_ready(self, wait_s: float) -> bool:
        """Reads the server's `ForkReady`, waiting up to `wait_s` for it."""
        if self._ready or self._sock is None:
            return self._ready
        if wait_s > 0:
            self._sock.settimeout(wait_s)
        else:
            self._sock.setblocking(False)
        try:
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            data = b""
        try:
            self._ready = isinstance(decode_message(*decode_bytes(data)), ForkReady) if data else False
        except ValueError:
            self._ready = False
        if self._ready:
            self._failures = 0
            return True
        self._failures += 1
        self.usable = self._failures < MAX_FAILURES
        log.warning("the fork server did not start; starting processes the usual way%s",
                    "" if self.usable else f" from now on ({MAX_FAILURES} servers in a row failed)")
        self.close(kill=True)
        return False

    def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "launch.zygote", str(theirs.fileno()),
                                           " " * zygote.CMDLINE_BYTES],
                                          pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent,
                                          start_new_session=True, stdin=subprocess.DEVNULL)
        except OSError as exc:
            log.warning("cannot start the fork server (%s); starting processes the usual way", exc)
            ours.close()
            self.usable = False
            return
        finally:
            theirs.close()
        self._sock, self._env, self._ready = ours, dict(os.environ), False
        self.starts += 1

    def close(self, kill: bool = False) -> None:
        """Stops the server: at once with `kill` (one given up on), else once it has read its socket's end.

        The processes it started run on."""
        self._ready = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if kill:
                self._proc.kill()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
