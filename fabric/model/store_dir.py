"""Where a host's weight store lives. Apart from fabric/model/weight_store.py, which imports torch, so
that the supervisor, which only names the directory, starts without it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def default_dir(tag: str) -> Path:
    """Where a store lives: /dev/shm (memory) where the host has it."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"moe-fabric-weights-{os.getuid()}-{tag}"
