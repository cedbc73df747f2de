"""AW <-> EW data channel: expert calls and results (its hello and liveness messages are in
fabric/messages/liveness.py, which imports no torch). Legend: R rows (token copies, one per
selected expert), D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fabric.errors import ProtocolError
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
    # Whether this AW sends the EW an empty call at each layer it has no rows for, so that its sync gather may
    # wait for this AW. It says so in every message, and stops only after one that says it stops.
    pads: bool = True

    def check(self, hidden: int, dtype: torch.dtype) -> None:
        """Raises a ProtocolError where the call does not fit a model of this hidden size and dtype."""
        x = self.x
        if len(self.experts) != len(self.counts) or any(n < 0 for n in self.counts):
            raise ProtocolError("expert_call: experts and counts disagree")
        if x.dim() != 2 or x.shape[1] != hidden or x.dtype != dtype:
            raise ProtocolError(f"expert_call: x has shape {tuple(x.shape)} {x.dtype}")
        if sum(self.counts) != x.shape[0]:
            raise ProtocolError("expert_call: counts do not add up to the rows of x")


@register
@dataclass
class ExpertResult(Message):
    kind = "expert_result"
    call_id: int
    y: torch.Tensor  # [R, D], same row order as the call
    # Whether another AW has a batch running too, so that this AW's empty calls can let the gather batch them:
    # with none, they would only cost both sides a message and a wake-up a layer.
    others: bool = True
    # Seconds the EW's batch that computed it took, which the AW weighs against the messages of a layer
    # (attention_worker/collapse.py).
    batch_s: float = 0.0


@register
@dataclass
class ExpertError(Message):
    """The EW could not serve a call (e.g. it does not host that expert); the AW reroutes."""

    kind = "expert_error"
    call_id: int
    message: str
