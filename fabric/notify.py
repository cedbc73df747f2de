"""Telling a supervisor how this process is doing, with systemd's notification protocol.

Datagrams go to the unix socket named by `$NOTIFY_SOCKET`. `READY=1` is sent once the process serves, and
`STOPPING=1` when it shuts down. `WATCHDOG=1` is sent every third of `$WATCHDOG_USEC` from the event loop. A
process whose loop is stuck stops pinging, and its supervisor restarts it.

`moe-fabric serve` speaks the same protocol as systemd (`Type=notify`, `WatchdogSec=`), so the roles behave
alike under either. Without `$NOTIFY_SOCKET` every call here does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from fabric.errors import ConfigError

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path  # '@': an abstract socket
        self.watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec and (not pid or pid == str(os.getpid())):
            if not usec.isdigit() or int(usec) == 0:
                raise ConfigError(f"WATCHDOG_USEC must be a positive integer, got {usec!r}")
            self.watchdog_s = int(usec) / 1e6
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def send(self, state: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(state.encode(), self.address)
        except OSError as exc:  # the supervisor is gone or busy, so nothing to tell
            log.debug("notify %s: %s", state, exc)

    async def watchdog(self) -> None:
        """Pings from the event loop, so a loop that stops turning stops pinging."""
        if self.watchdog_s is None or self._sock is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 3)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


_NOTIFIER: Notifier | None = None


def notifier() -> Notifier:
    """This process's notifier (made on first use)."""
    global _NOTIFIER
    if _NOTIFIER is None:
        _NOTIFIER = Notifier()
    return _NOTIFIER
