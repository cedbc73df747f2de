"""Test-only fault hooks, each enabled by an environment variable that only the tests set; unset,
nothing here runs.

- `MOE_FABRIC_TEST_CRASH_SEED=N` (attention workers): crash (SIGKILL itself, as a native fault
  would) in any step that serves a request with seed N, the "query of death".
- `MOE_FABRIC_TEST_STALL_ON_SIGUSR1=1` (expert workers): on SIGUSR1, stop reading every data
  connection, while the control channels keep answering probes: a stuck reader on a live socket.
- `MOE_FABRIC_TEST_DROP_ON_SIGUSR1=1` (checkpoint stores): on SIGUSR1, close every AW connection
  while the process serves on: its peers lose a store the orchestrator finds alive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from fabric.errors import ConfigError

CRASH_ENV = "MOE_FABRIC_TEST_CRASH_SEED"
STALL_ENV = "MOE_FABRIC_TEST_STALL_ON_SIGUSR1"
DROP_ENV = "MOE_FABRIC_TEST_DROP_ON_SIGUSR1"
log = logging.getLogger(__name__)


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def crash_seed() -> int | None:
    seed = _int_env(CRASH_ENV)
    if seed is not None:
        log.warning("fault injection on: this worker crashes on any request with seed %d (%s)", seed, CRASH_ENV)
    return seed


def stall_on_signal(stalled: asyncio.Event) -> None:
    """With the hook on, SIGUSR1 sets `stalled` (the data loops then stop reading)."""
    if not _int_env(STALL_ENV):
        return
    log.warning("fault injection on: SIGUSR1 makes this worker stop reading expert calls (%s)", STALL_ENV)

    def stall() -> None:
        log.warning("fault injection: no longer reading expert calls")
        stalled.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, stall)


def drop_on_signal(drop: Callable[[], None]) -> None:
    """With the hook on, SIGUSR1 calls `drop` (which closes the process's peer connections)."""
    if not _int_env(DROP_ENV):
        return
    log.warning("fault injection on: SIGUSR1 makes this process close its peers' connections (%s)", DROP_ENV)

    def on_signal() -> None:
        log.warning("fault injection: closing every peer connection")
        drop()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_signal)


def maybe_crash(seed: int, seeds: list[int]) -> None:
    if seed in seeds:
        log.warning("fault injection: crashing on a request with seed %d", seed)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
