"""AW <-> EW channel. Two connections per pair: `control` (hello, liveness, AW activity) and `data`
(expert calls and results). Legend: R rows (token copies, one per selected expert), D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
class ExpertCall(Message):
    """Rows for several experts of one layer. `counts[i]` rows of `x` belong to `experts[i]`."""

    kind = "expert_call"
    call_id: int
    epoch: int
    layer: int
    experts: list[int]
    counts: list[int]
    x: torch.Tensor  # [R, D]
    replay: bool = False  # replayed after another EW died: served before anything else


@register
@dataclass
class ExpertResult(Message):
    kind = "expert_result"
    call_id: int
    y: torch.Tensor  # [R, D], same row order as the call


@register
@dataclass
class ExpertError(Message):
    """The EW could not serve a call (e.g. it does not host that expert); the AW reroutes."""

    kind = "expert_error"
    call_id: int
    message: str


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
