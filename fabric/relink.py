"""Reaching a peer again after this process lost it.

Losing a link is a suspicion, not a verdict. So the peer is tried again in the background until it answers, is
declared dead, or leaves the view. An AW does so for its EWs (attention_worker/ew_links.py), a gateway for its
AWs (gateway/aw_pool.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fabric.errors import PeerDeadError, ProtocolError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds before the first try. The pause doubles at each try, up to RELINK_MAX.
RELINK_MIN = 0.05
RELINK_MAX = 1.0
RELINK_TIMEOUT = 1.0  # one try at most
# Seconds for a first connection to a peer new in the view, a handshake included.
CONNECT_TIMEOUT = 2.0


async def reach_again(try_once: Callable[[], Awaitable[T]], wanted: Callable[[], bool], wake: asyncio.Event,
                      peer: str) -> T | None:
    """Tries `try_once()` until a try succeeds, returning its result, or `wanted()` turns false, returning None.

    Each try is bounded by RELINK_TIMEOUT. Before it comes a pause that doubles from RELINK_MIN to RELINK_MAX.
    The pause is cut short when `wake` is set, as the orchestrator vouched for the peer. A lost connection, a
    malformed answer or a timeout is a failed try."""
    delay, tries = RELINK_MIN, 0
    while True:
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), delay)
        except TimeoutError:
            pass
        delay = min(RELINK_MAX, delay * 2)
        if not wanted():
            return None
        try:
            return await asyncio.wait_for(try_once(), RELINK_TIMEOUT)
        except (PeerDeadError, ProtocolError, TimeoutError) as exc:
            tries += 1
            if tries in (1, 10) or tries % 100 == 0:
                log.info("%s does not answer yet (%d tries; the last: %s)", peer, tries,
                         type(exc).__name__ if isinstance(exc, TimeoutError) else exc)
