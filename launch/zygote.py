"""The fork server: one process that imports torch once, and forks the role processes from it.

A role process that starts as `python -m launch.cli ...` spends seconds of CPU importing torch (2-3 s
on a 2-core VM, and a fabric starts eight such processes at once). Forked from this process, it
starts with torch imported and its pages shared. The supervisor (launch/supervisor.py) asks
through a socket pair (`Fork`, answered `Forked`); launch/forked.py is its side.

    main loop   read a Fork -> fork an intermediate -> it forks the role process and exits -> answer its pid

The role process is not this server's child: its parent exits at once, so the kernel hands it to the
supervisor, which is a child subreaper (PR_SET_CHILD_SUBREAPER). The supervisor waits for it, reads
its exit code and signals it as it would a child it started itself. So this server's death ends no
role process, and the supervisor starts the next ones the usual way (`python -m launch.cli`).

Nothing here reads the fabric's configuration or its environment variables: libraries are imported
ahead (PRELOAD), then the roles' modules (`role_modules`), which read neither on import. A process whose
environment differs from this server's in a variable that a library may read on import (IMPORT_ENV) is
started the usual way instead. A process forked from a server runs the role code that server imported
when it started, even where the tree has changed since.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import socket
import struct
import sys
import time
import traceback

from fabric.messages.base import decode_message, encode_message
from fabric.messages.supervisor import Fork, Forked, ForkReady
from fabric.process import die_with_parent, freeze_heap
from fabric.wire import decode_bytes, encode_bytes

PRELOAD = ("numpy", "torch", "msgpack", "aiohttp", "uvloop", "safetensors")
# Variables a preloaded library may read on import: a process that needs others than the server's is not forked.
IMPORT_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS", "CUDA", "NVIDIA", "LD_", "PYTHON", "TRITON", "AIOHTTP",
              "KMP_", "GOMP")
CLI = ["-m", "launch.cli"]  # argv[1:3] of every process it starts
MAX_MESSAGE = 1 << 20
# The server's command line is padded to this many bytes, so that a forked process can write its own
# argv over it, where `ps` and /proc/PID/cmdline read it.
CMDLINE_BYTES = 4096


_server_pid = os.getpid()  # (a forked process tells itself apart by its pid)


def role_modules() -> list[str]:
    """What `python -m launch.cli ROLE` imports, imported ahead after PRELOAD: the CLI and each role's module
    (launch/cli.py ROLES; 0.15-0.25 s each). They read no environment and start no thread on import (a test
    keeps it), so a forked process finds its role imported."""
    from launch.cli import ROLES

    return ["launch.cli", *(module for _, module, _ in ROLES.values())]


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` a preloaded library may read on import."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV)}


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    set_cmdline([sys.executable, "-m", "launch.zygote", sys.argv[1]])
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # (an optional one: the process imports what it needs)
    with contextlib.suppress(Exception):  # (a broken tree: the role process imports it again and says what is wrong)
        for name in role_modules():
            importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a fork would inherit a CUDA context it cannot use
        print("fork server: CUDA was initialised on import; not forking", file=sys.stderr)
        return 1
    # What every forked process inherits, collected once here and frozen (fabric/process.py `freeze_heap`): no
    # process's GC walks it again, and a collection does not write to the pages they share with this one.
    freeze_heap()
    try:
        sock.send(encode_bytes(*encode_message(ForkReady(os.getpid()))))
    except OSError:
        return 0
    role_argv = serve(sock)
    if role_argv is None:
        return 0
    # The role process. (Its exit runs as a fresh interpreter's does: atexit, threads joined.)
    from launch.cli import main as cli

    return cli(role_argv)


def serve(sock: socket.socket) -> list[str] | None:
    """Forks a process per request until the supervisor closes its end.

    Returns None here, and the role's argv in a forked process."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 64)
        except OSError:
            return None
        if not data:
            return None
        try:
            msg = decode_message(*decode_bytes(data))
            if not isinstance(msg, Fork) or msg.argv[1:3] != CLI or len(fds) != len(msg.fds) + msg.log:
                raise ValueError(f"not a fork request for `python {' '.join(CLI)}`")
            pid, go = _fork(sock, msg, fds)
            if pid == 0:
                return msg.argv[3:]
            reply = Forked(pid)
        except Exception as exc:  # answered: the supervisor starts this one the usual way
            reply, go = Forked(0, f"{type(exc).__name__}: {exc}"), -1
        finally:
            if os.getpid() == _server_pid:
                for fd in fds:
                    os.close(fd)
        try:
            sock.send(encode_bytes(*encode_message(reply)))
            if go >= 0:
                os.write(go, b"g")  # the supervisor has its pid: it may start
        except OSError:
            return None
        finally:
            if go >= 0:
                os.close(go)


def _fork(sock: socket.socket, msg: Fork, fds: list[int]) -> tuple[int, int]:
    """Starts the role process. Returns its pid here and 0 in it, with the pipe that tells it to go on.

    It goes on once the supervisor has its pid, so that none runs that the supervisor does not know
    of: one whose answer did not arrive (the server died, or was given up on) ends there."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    mid = os.fork()
    if mid == 0:  # the intermediate: a session of its own, the role process, then gone
        os.close(r)
        os.close(go_w)
        try:
            os.setsid()
            pid = os.fork()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        if pid == 0:
            try:
                os.close(w)
                if os.read(go_r, 1) != b"g":
                    os._exit(1)
                os.close(go_r)
                _become(sock, msg, fds)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            return 0, -1
        os.write(w, struct.pack("<q", pid))
        os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        raw = os.read(r, 8)
    finally:
        os.close(r)
        os.waitpid(mid, 0)
    if len(raw) != 8:
        os.close(go_w)
        raise OSError("the intermediate process failed to fork")
    return int(struct.unpack("<q", raw)[0]), go_w


def _become(sock: socket.socket, msg: Fork, fds: list[int]) -> None:
    """Turns this fresh fork into the role process: its descriptors, its environment, its argv."""
    sock.close()
    above = max([*msg.fds, *fds, 2]) + 1  # received descriptors move above every number they go to
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    if msg.log:
        log, high = high[0], high[1:]
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    for fd, target in zip(high, msg.fds):
        os.dup2(fd, target)  # (inheritable, as Popen's pass_fds)
        os.close(fd)
    for name in os.listdir("/proc/self/fd"):  # nothing else of the server's (as Popen's close_fds)
        fd = int(name)
        if fd > 2 and fd not in msg.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.environ.clear()
    os.environ.update(msg.env)
    sys.argv = [msg.argv[0], *msg.argv[3:]]
    set_cmdline(msg.argv)
    # Once its parent, the intermediate, is gone, the supervisor is its parent: it dies with it, as a
    # process the supervisor started itself (and by `--watch-pid`, as every role process).
    mid, deadline = os.getppid(), time.monotonic() + 1.0
    while os.getppid() == mid and time.monotonic() < deadline:
        time.sleep(0.001)
    die_with_parent()


def set_cmdline(argv: list[str]) -> None:
    """Writes `argv` over this process's command line, as far as its space goes (Linux; best effort)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat
        data = b"\0".join(a.encode() for a in argv)[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data + b"\0" * (end - start - len(data)))
    except (OSError, IndexError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
