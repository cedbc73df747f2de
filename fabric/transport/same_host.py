"""Where a listener's same-host Unix socket lives.

There is one per (host, port), in a directory only this user can enter. A dialer on this machine finds its
peer's socket from the address it already has; a file there means the listener runs on this machine. Nobody else
on the host can reach it. The cluster handshake runs on it as on TCP.

Off unless $MOE_FABRIC_SAME_HOST is 1. Side by side on the 2-core VM (2026-11-26, 2 AW + 2 EW, no compute,
4 rounds) it was no faster than loopback TCP at one stream (0.98x the time between tokens). It was slower at 16
(1.11x), though a lone round trip through it takes 465 µs against 788 µs over TCP (docs/performance.md). Once the
data path's messages took compiled code (2026-11-28) it ran 2-6 % faster than TCP, but it stays off: a write to a
Unix socket whose peer has closed fails at once (EPIPE), and the event loop then ends the connection without
reading what the peer sent before it closed (over TCP that write succeeds and the bytes before the FIN are read
first). An AW that writes a step's tokens to a gateway that just sent `Abort(moved)` and closed would miss the abort.

The directory is $MOE_FABRIC_SOCKET_DIR, else moe-fabric-<uid> in the temp directory. A directory that another
user owns or can write into disables same-host sockets (TCP only).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
import tempfile

log = logging.getLogger(__name__)

MAX_PATH = 100  # bytes; sun_path holds 108 with its terminator


ENABLE = "MOE_FABRIC_SAME_HOST"


def enabled() -> bool:
    """Whether listeners and dialers made now use same-host sockets.

    The environment says so, and a process's children inherit it."""
    return os.environ.get(ENABLE) == "1" and directory() is not None


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
