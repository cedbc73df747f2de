"""AW <-> EW data channel: expert calls and results (its hello and liveness messages are in
fabric/messages/liveness.py, which imports no torch). Legend: R rows (token copies, one per
selected expert), D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fabric.messages.base import Message, register


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
