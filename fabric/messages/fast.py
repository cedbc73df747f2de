"""The data path's two messages, expert calls and results, encoded and decoded in compiled code (msgspec).

Every layer of every decode step sends one `ExpertCall` per EW and gets one `ExpertResult` back. Through the
generic codec (fabric/messages/base.py: a Python loop over the fields, msgpack, a walk of the header for its
depth, then each field's check, then the tensor's) a call took ~8 µs to send and ~13 to receive in a loop; here
msgspec packs a header, and unpacks and checks it against the message's fields, in one call each.

The bytes are the generic codec's, byte for byte (tests/fabric/test_fast_codec.py), so either end may use
either. What this decoder accepts, the generic one accepts as the same message. Anything else (another kind,
an unknown or missing field, a wrong type, a tensor whose shape does not match its frame, an unusual frame
table) it leaves to the generic decoder, which then accepts it or raises its usual `ProtocolError`. A header's
depth needs no walk here: its schema bounds it (`DEPTH`).

msgspec is a dependency of the package. Where it is missing (an image with only the base packages), `available`
is False and every message takes the generic codec.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fabric.messages.base import (
    TORCH_DTYPE_NAMES,
    Message,
    _tensor_bytes,
    _torch_dtypes,
    _torch_itemsizes,
    _torch_names,
)
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.wire import MAGIC, PREFIX, WireLimits

if TYPE_CHECKING:
    import torch

try:
    import msgspec
except ImportError:  # pragma: no cover - the GPU image's Python has only the base packages
    msgspec = None  # type: ignore[assignment]

available = msgspec is not None
DEPTH = 3  # the deepest header here: a map holding a tensor's [dtype, shape, frame] holding its shape
_LEN = struct.Struct("<Q")  # the frame table of a message with one frame

if msgspec is not None:
    # A tensor in a header: [dtype name, shape, frame index], here always frame 0 (each message has one).
    _Tensor = tuple[Literal[TORCH_DTYPE_NAMES], list[Annotated[int, msgspec.Meta(ge=0)]], Literal[0]]  # type: ignore[valid-type]

    # The header of each message, as the generic codec writes it: "kind" first, then the fields in order. No
    # field is optional, and no other key is taken, as there.
    class _CallHead(msgspec.Struct, tag_field="kind", tag=ExpertCall.kind, forbid_unknown_fields=True):
        call_id: int
        epoch: int
        layer: int
        experts: list[int]
        counts: list[int]
        x: _Tensor
        replay: bool
        pads: bool

    class _ResultHead(msgspec.Struct, tag_field="kind", tag=ExpertResult.kind, forbid_unknown_fields=True):
        call_id: int
        y: _Tensor
        others: bool

    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder(_CallHead | _ResultHead)


def encode(msg: Message) -> bytes | None:
    """The whole message (prefix, frame table, header, frame) as one buffer; None for any other message, or a
    tensor this codec does not send (on a device, not contiguous)."""
    if msgspec is None:
        return None
    kind = type(msg)
    t: torch.Tensor
    if kind is ExpertCall:
        call: ExpertCall = msg  # type: ignore[assignment]
        t = call.x
        head: Any = _CallHead(call.call_id, call.epoch, call.layer, call.experts, call.counts,
                              (_torch_names()[t.dtype], list(t.shape), 0), call.replay, call.pads)
    elif kind is ExpertResult:
        result: ExpertResult = msg  # type: ignore[assignment]
        t = result.y
        head = _ResultHead(result.call_id, (_torch_names()[t.dtype], list(t.shape), 0), result.others)
    else:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    try:
        packed = _encoder.encode(head)
    except (msgspec.EncodeError, TypeError, OverflowError):  # a value msgpack cannot carry: the generic codec says
        return None
    frame = _tensor_bytes(t)
    n = frame.nbytes
    return b"".join((PREFIX.pack(MAGIC, len(packed), 1, 8 + len(packed) + n), _LEN.pack(n), packed, frame))


def decode(body: bytes | bytearray | memoryview, header_len: int, n_frames: int, limits: WireLimits) -> Message | None:
    """A call or a result from a message's body (what follows its prefix, which the caller checked against
    `limits`); None for anything the generic decoder must look at."""
    if msgspec is None or n_frames != 1 or limits.max_depth < DEPTH:
        return None
    view = memoryview(body)
    try:
        head = _decoder.decode(view[8:8 + header_len])
    except Exception:  # malformed or not of this schema (DecodeError, ValidationError, UnicodeDecodeError...)
        return None  # the generic decoder's verdict stands
    (n,) = _LEN.unpack_from(view)
    start = 8 + header_len
    if start + n != view.nbytes:
        return None
    if type(head) is _CallHead:
        x = _tensor(head.x, view, start, n)
        if x is None:
            return None
        return ExpertCall(head.call_id, head.epoch, head.layer, head.experts, head.counts, x, head.replay, head.pads)
    y = _tensor(head.y, view, start, n)
    if y is None:
        return None
    return ExpertResult(head.call_id, y, head.others)


def _tensor(meta: tuple[str, list[int], int], body: memoryview, start: int, n: int) -> torch.Tensor | None:
    """The tensor `meta` describes, a view of the body's frame (bytes start:start+n); None if they disagree."""
    import torch

    dtype = _torch_dtypes()[meta[0]]
    shape = meta[1]
    numel = math.prod(shape)
    if numel * _torch_itemsizes()[dtype] != n:
        return None
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(body, dtype=dtype, offset=start, count=numel).view(shape)
