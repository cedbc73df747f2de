"""Where a listener's same-host Unix socket lives.

There is one per (host, port), in a directory only this user can enter. A dialer on this machine finds its
peer's socket from the address it already has; a file there means the listener runs on this machine. Nobody else
on the host can reach it. The cluster handshake runs on it as on TCP.

On unless $MOE_FABRIC_SAME_HOST is 0. A write to a Unix socket skips the network stack that a loopback TCP write
runs for its receiver. Side by side on the 2-core VM (2026-11-28, 2 AW + 2 EW; 8 rounds with no compute, 3 with
real compute) a fabric with them ran 2-6 % faster than one over loopback TCP (docs/performance.md). Before the data
path's messages took compiled code (2026-11-26) the same comparison found them no faster, and slower at 16 streams.
A write to a Unix socket whose peer has closed fails at once, where TCP's succeeds; what the peer sent before it
closed is read all the same (fabric/transport/tcp_pipe.py, `Pipe._drain_unread`). They are on whatever the kernel
caps a socket's buffer at (net.core.wmem_max): see SNDBUF.

The directory is $MOE_FABRIC_SOCKET_DIR, else moe-fabric-<uid> in the temp directory. A directory that another
user owns or can write into disables same-host sockets (TCP only). A process killed outright leaves its socket file
behind: a dialer that finds it uses TCP, a listener that gets the port again replaces it, and the first listener of
each process removes the files of listeners that are gone (`sweep`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import stat
import tempfile
import time

log = logging.getLogger(__name__)

MAX_PATH = 100  # bytes; sun_path holds 108 with its terminator


ENABLE = "MOE_FABRIC_SAME_HOST"


# A Unix socket's writes are bounded by the sender's buffer alone, 208 KiB by default (the kernel doubles what it
# grants, up to twice net.core.wmem_max), where loopback TCP's grow to 4 MiB on their own. Each end of a same-host
# connection asks for this much (fabric/transport/tcp_pipe.py), so a large message (four steps' KV checkpoint,
# 2 MiB at 64 streams) goes in one write where the kernel allows it. Where it does not (Linux's default wmem_max),
# they are on all the same: on 2026-11-28 a step's checkpoint, a message a step, then took a wake-up of each side
# per 416 KiB, and incremental checkpointing cost 0.81x the tokens a second at 16 streams (TCP: 1.00x), so they
# were off there; since checkpoints go four steps to a message, gathered when they go, the same cap measured 1.00x
# of none, and against TCP 0.97x / 0.99x / 0.79x the time a layer with no compute; against a 4 MiB cap 1.00x /
# 0.87x / 1.02x (docs/performance.md, seventh round).
SNDBUF = 4 << 20


def enabled() -> bool:
    """Whether listeners and dialers made now use same-host sockets: the environment says so (a process's children
    inherit it), and this user's socket directory can be trusted."""
    return os.environ.get(ENABLE, "1") != "0" and directory() is not None


@functools.cache
def directory() -> str | None:
    """This user's socket directory, made if missing; None where it cannot be trusted."""
    d = os.environ.get("MOE_FABRIC_SOCKET_DIR") or os.path.join(tempfile.gettempdir(), f"moe-fabric-{os.getuid()}")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError as exc:
        log.warning("same-host sockets off: %s: %s", d, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("same-host sockets off: %s is not a directory only this user can use", d)
        return None
    return d


def path(host: str, port: int) -> str | None:
    """The socket of the listener at host:port on this machine, or None if there is no same-host socket."""
    d = directory()
    if d is None or not port:
        return None
    p = os.path.join(d, f"{host.replace('/', '_')}_{port}.sock")
    return p if len(p.encode()) <= MAX_PATH else None


def remove(p: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)


# A socket file younger than this is left alone by `sweep`: its listener may be between bind and listen.
STALE_AFTER_S = 10.0
_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's flags: a listening socket


def listening() -> set[str] | None:
    """The paths of the Unix sockets that listen in this network namespace; None where /proc does not say."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    out = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 8 and int(fields[3], 16) & _ACCEPTING:
            out.add(fields[7])
    return out


def _refused(p: str) -> bool:
    """Whether connecting to the socket at `p` is refused (nobody listens there)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(p)
        except ConnectionRefusedError:
            return True
        except OSError:  # (a full backlog, a file that is not a socket: not known to be dead)
            return False
    return False


def sweep() -> int:
    """Removes the socket files in this user's directory whose listeners are gone; returns how many.

    A file goes where no socket in this network namespace listens on it, it is older than STALE_AFTER_S, and a
    connection to it is refused (so a listener in another namespace that shares the directory keeps its file)."""
    d = directory()
    live = listening() if d is not None else None
    if d is None or live is None:
        return 0
    removed = 0
    for name in os.listdir(d):
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if p in live or not stat.S_ISSOCK(st.st_mode) or time.time() - st.st_mtime < STALE_AFTER_S:
            continue
        if _refused(p):
            remove(p)
            removed += 1
    if removed:
        log.info("removed %d socket files of listeners that are gone from %s", removed, d)
    return removed


@functools.cache
def sweep_once() -> int:
    """`sweep`, the first time a process asks (its first same-host listener)."""
    return sweep()
