"""Hello and liveness on every peer link (an AW's channels to an EW, a gateway's to an AW, a
worker's control port). Torch-free: the orchestrator and the gateway import these without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric.messages.base import Message, register


@register
@dataclass
class Hello(Message):
    """First message on every AW->EW connection: who is calling, and on which channel."""

    kind = "hello"
    aw_id: str
    channel: str  # "control" | "data"


@register
@dataclass
class AwActivity(Message):
    """Control channel: the AW has (or no longer has) a running batch; gather policies wait only
    for active AWs."""

    kind = "aw_activity"
    active: bool


@register
@dataclass
class Ping(Message):
    kind = "ping"
    nonce: int


@register
@dataclass
class Pong(Message):
    """The answer to a `Ping`. An EW's control port also says how long the batch under way has run
    (`busy_s`, 0: none) and how many of the asking AW's calls it holds, queued or in that batch
    (`held`): an AW waits for those, and for calls sent while that batch ran (unread until it ends),
    however long it takes, instead of taking a slow EW for a stuck one."""

    kind = "pong"
    nonce: int
    busy_s: float = 0.0
    held: int = 0

