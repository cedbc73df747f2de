"""Test-only fault hooks, each enabled by an environment variable that only the tests set.

Unset, nothing here runs.

- `MOE_FABRIC_TEST_CRASH_SEED=N` (attention workers): crash in any step that serves a request with seed N,
  the "query of death". The worker SIGKILLs itself, as a native fault would.
- `MOE_FABRIC_TEST_DROP_ON_SIGUSR1=1` (checkpoint stores): on SIGUSR1, close every AW connection while the
  process serves on. Its peers lose a store the orchestrator finds alive.
- `MOE_FABRIC_TEST_SLOW_STEPS=FIRST_MS,EVERY_MS` (attention and expert workers): the first step served (an
  AW's forward, an EW's batch) takes FIRST_MS longer, every later one EVERY_MS longer. The delay is slept
  inline, as compute runs. This gives a cold first step and a slow device, as a GPU's look from outside.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from fabric.errors import ConfigError

CRASH_ENV = "MOE_FABRIC_TEST_CRASH_SEED"
DROP_ENV = "MOE_FABRIC_TEST_DROP_ON_SIGUSR1"
SLOW_ENV = "MOE_FABRIC_TEST_SLOW_STEPS"
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


class SlowSteps:
    """`MOE_FABRIC_TEST_SLOW_STEPS`: call once per step served, where its compute runs."""

    def __init__(self, first_s: float, every_s: float) -> None:
        self.first_s, self.every_s = first_s, every_s
        self.steps = 0

    def __call__(self) -> None:
        self.steps += 1
        time.sleep(self.first_s if self.steps == 1 else self.every_s)


def slow_steps() -> SlowSteps | None:
    raw = os.environ.get(SLOW_ENV)
    if raw is None:
        return None
    try:
        first, every = (float(x) / 1000 for x in raw.split(","))
    except ValueError:
        raise ConfigError(f"{SLOW_ENV} must be FIRST_MS,EVERY_MS, got {raw!r}") from None
    log.warning("fault injection on: the first step takes %.0f ms longer, every later one %.0f ms (%s)",
                first * 1e3, every * 1e3, SLOW_ENV)
    return SlowSteps(first, every)
