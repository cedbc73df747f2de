"""Where a host's weight store lives. Apart from fabric/model/weight_store.py, which imports torch, so
that the supervisor, which only names the directory, starts without it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from fabric.process import pid_alive

SERVE_TAG = "serve-"  # a `serve` run's store: tagged with its launcher's pid


def default_dir(tag: str, base: Path | None = None) -> Path:
    """Where a store lives: /dev/shm (memory) where the host has it."""
    if base is None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"moe-fabric-weights-{os.getuid()}-{tag}"


def sweep_stale(base: Path | None = None) -> list[Path]:
    """Removes the stores of this user's `serve` runs whose launcher is gone, and returns them.

    A launcher killed by SIGKILL cannot remove its store, and the store's process exits with it (its
    watch of the launcher leaves at once): without this, each such run would hold its weights in
    /dev/shm, memory, until the host restarts. (The pids are this pid namespace's; a worker that mapped a
    store keeps its pages if the file goes.)"""
    prefix = default_dir(SERVE_TAG, base)
    gone = []
    for d in prefix.parent.glob(prefix.name + "*"):
        pid = d.name[len(prefix.name):]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone
