"""The data path's messages, expert calls and results and an AW's tokens of a step, encoded and decoded in
compiled code (msgspec).

Every layer of every decode step sends one `ExpertCall` per EW and gets one `ExpertResult` back. Through the
generic codec (fabric/messages/base.py: a Python loop over the fields, msgpack, a walk of the header for its
depth, then each field's check, then the tensor's) a call took ~8 µs to send and ~13 to receive in a loop; here
msgspec packs a header, and unpacks and checks it against the message's fields, in one call each. Every step an
AW sends each gateway a `StepOutput`, a row per token; the generic codec checks a row in Python (~2 µs a row, 10 %
of a gateway's CPU at 64 streams), msgspec in its one call.

The bytes are the generic codec's, byte for byte (tests/fabric/test_fast_codec.py), so either end may use
either. What this decoder accepts, the generic one accepts as the same message. Anything else (another kind,
an unknown or missing field, a wrong type, a tensor whose shape does not match its frame, an unusual frame
table) it leaves to the generic decoder, which then accepts it or raises its usual `ProtocolError`. A header's
depth needs no walk here: its schema bounds it (`DEPTH`, `STEP_DEPTH`; a lower limit leaves it to the generic
decoder).

Every connection reads a host message's body through `decode_body` (this codec, else the generic one); tcp also
writes calls, results and steps' tokens through `encode`. msgspec is a dependency of the package. Where it is missing (an image with only the base packages), `available`
is False and every message takes the generic codec.

A worker that runs the fabric's C++ kernels also encodes and decodes calls and results with the module's
`encode_data` and `decode_data` (fabric/kernels/codec.h; `use_native`, fabric/kernels/choose.py): the same bytes,
the same messages; in a loop an encode takes a fifth to a quarter of msgspec's time here, a decode two fifths. What
they do not take (they return None) goes the ways above.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np

from fabric.messages.base import (
    TORCH_DTYPE_NAMES,
    Message,
    _tensor_bytes,
    _torch_dtypes,
    _torch_itemsizes,
    _torch_names,
    decode_message,
    message_class,
)
from fabric.messages.client import StepOutput, TokenOut
from fabric.wire import MAGIC, PREFIX, WireLimits, parse_body

if TYPE_CHECKING:
    import torch

    from fabric.messages.expert import ExpertCall, ExpertResult

try:
    import msgspec
except ImportError:  # pragma: no cover - the GPU image's Python has only the base packages
    msgspec = None  # type: ignore[assignment]

available = msgspec is not None
DEPTH = 3  # a call's or result's header: a map holding a tensor's [dtype, shape, frame] holding its shape
# A step's: a map holding its outputs holding a token's row holding its top logprobs holding one [id, logprob].
STEP_DEPTH = 5
_LEN = struct.Struct("<Q")  # the frame table of a message with one frame
# The kinds this codec carries (fabric/messages/expert.py), named here: that module imports torch, which a
# control-plane process (the orchestrator, a gateway) never does, and each makes tcp connections.
CALL, RESULT = "expert_call", "expert_result"
STEP = StepOutput.kind
# A wire dtype's numpy dtype, where numpy has it (not bfloat16): a frame is viewed and sent through numpy.
_NUMPY: dict[str, np.dtype | None] = {name: None if name == "bfloat16" else np.dtype(name) for name in TORCH_DTYPE_NAMES}
# A call's or result's frame under this many bytes goes in one buffer with its header (one write, the frame copied
# into it); a larger one is written where it lies, beside its header.
JOIN_BELOW = 64 << 10
_native: Any = None  # the compiled codec (`use_native`), or None
_classes: tuple[Any, Any] | None = None  # (ExpertCall, ExpertResult) once fabric/messages/expert.py is imported


def use_native(ops: Any | None) -> bool:
    """Encodes and decodes calls and results with `ops` (the kernel module, fabric/kernels/codec.h) from now on in
    this process; None: with msgspec again. Returns whether the compiled codec is on."""
    global _native
    _native = ops if ops is not None and hasattr(ops, "encode_data") else None
    return _native is not None

if msgspec is not None:
    # A tensor in a header: [dtype name, shape, frame index], here always frame 0 (each message has one).
    _Tensor = tuple[Literal[TORCH_DTYPE_NAMES], list[Annotated[int, msgspec.Meta(ge=0)]], Literal[0]]  # type: ignore[valid-type]

    # The header of each message, as the generic codec writes it: "kind" first, then the fields in order. No
    # field is optional, and no other key is taken, as there.
    class _CallHead(msgspec.Struct, tag_field="kind", tag=CALL, forbid_unknown_fields=True):
        call_id: int
        epoch: int
        layer: int
        experts: list[int]
        counts: list[int]
        x: _Tensor
        replay: bool
        pads: bool

    class _ResultHead(msgspec.Struct, tag_field="kind", tag=RESULT, forbid_unknown_fields=True):
        call_id: int
        y: _Tensor
        others: bool
        batch_s: float

    # A `TokenOut` row, its fields in order. `top` is typed here (the generic codec takes any values), which bounds
    # the depth; a logprob that came as an integer stays one, as there.
    _Row = tuple[str, int, str | None, float | int | None, list[list[int | float]] | None]

    class _StepHead(msgspec.Struct, tag_field="kind", tag=STEP, forbid_unknown_fields=True):
        outputs: list[_Row]  # type: ignore[valid-type]
        load: int  # (no default: the generic codec wants every field of a message)

    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder(_CallHead | _ResultHead | _StepHead)


def encode(msg: Message) -> bytes | None:
    """The whole message (prefix, frame table, header, frame) as one buffer; None for any other message, or a
    tensor this codec does not send (on a device, not contiguous)."""
    parts = encode_parts(msg)
    if parts is None:
        return None
    head, frame = parts
    return head if frame is None else head + frame


def encode_parts(msg: Message) -> tuple[bytes, memoryview | None] | None:
    """The message as (everything before its frame, the frame: a view of the tensor's memory, None for a step's
    tokens), uncopied; None as for `encode`. A sender writes the two in one call (writev) without joining them."""
    if msgspec is None or msg.kind not in (CALL, RESULT, STEP):
        return None
    if msg.kind == STEP:
        step: StepOutput = msg  # type: ignore[assignment]
        try:
            packed = _encoder.encode(_StepHead(step.outputs, step.load))  # type: ignore[arg-type]  # (rows: TokenOut tuples)
        except (msgspec.EncodeError, TypeError, OverflowError):
            return None
        return PREFIX.pack(MAGIC, len(packed), 0, len(packed)) + packed, None
    call: ExpertCall = msg  # type: ignore[assignment]
    result: ExpertResult = msg  # type: ignore[assignment]
    t = call.x if msg.kind == CALL else result.y
    if _native is not None:
        out = _native.encode_data(msg, msg.kind == CALL, JOIN_BELOW)
        if out is not None:
            data, joined = out  # (everything, or all before a large frame)
            return (data, None) if joined else (data, _frame(t, _torch_names()[t.dtype]))
    if not t.is_cpu or not t.is_contiguous():
        return None
    name = _torch_names()[t.dtype]
    meta: Any = (name, list(t.shape), 0)
    head: Any = (_CallHead(call.call_id, call.epoch, call.layer, call.experts, call.counts, meta, call.replay, call.pads)
                 if msg.kind == CALL else _ResultHead(result.call_id, meta, result.others, result.batch_s))
    try:
        packed = _encoder.encode(head)
    except (msgspec.EncodeError, TypeError, OverflowError):  # a value msgpack cannot carry: the generic codec says
        return None
    frame = _frame(t, name)
    n = frame.nbytes
    return b"".join((PREFIX.pack(MAGIC, len(packed), 1, 8 + len(packed) + n), _LEN.pack(n), packed)), frame


def _frame(t: torch.Tensor, name: str) -> memoryview:
    """A host tensor's bytes as they lie (a view of its memory)."""
    return t.numpy().data.cast("B") if _NUMPY[name] is not None and t.numel() else _tensor_bytes(t)


def decode_body(body: bytes | bytearray | memoryview, header_len: int, n_frames: int, limits: WireLimits) -> Message:
    """The message of a body (what follows its prefix, which the caller checked against `limits`): a call or a
    result by this codec, any other by the generic one, which also gives every refusal (`ProtocolError`)."""
    msg = decode(body, header_len, n_frames, limits)
    if msg is None:
        msg = decode_message(*parse_body(body, header_len, n_frames, limits))
    return msg


def decode(body: bytes | bytearray | memoryview, header_len: int, n_frames: int, limits: WireLimits) -> Message | None:
    """A call, a result or a step's tokens from a message's body; None for anything the generic decoder must look
    at."""
    if msgspec is None or limits.max_depth < DEPTH:
        return None
    if n_frames == 0:
        return _step(memoryview(body), header_len, limits)
    if n_frames != 1:
        return None
    if _native is not None and (_classes is not None or _resolve_classes()):
        assert _classes is not None
        msg = _native.decode_data(body, header_len, *_classes)
        if msg is not None:
            return msg  # type: ignore[no-any-return]
    view = memoryview(body)
    try:
        head = _decoder.decode(view[8:8 + header_len])
    except Exception:  # malformed or not of this schema (DecodeError, ValidationError, UnicodeDecodeError...)
        return None  # the generic decoder's verdict stands
    if type(head) is _StepHead:
        return None
    (n,) = _LEN.unpack_from(view)
    start = 8 + header_len
    cls = message_class(CALL if type(head) is _CallHead else RESULT)  # (None where expert.py is not imported)
    if start + n != view.nbytes or cls is None:
        return None
    if type(head) is _CallHead:
        x = _tensor(head.x, view, start, n)
        return None if x is None else cls(head.call_id, head.epoch, head.layer, head.experts, head.counts, x,  # type: ignore[call-arg]
                                          head.replay, head.pads)
    y = _tensor(head.y, view, start, n)
    return None if y is None else cls(head.call_id, y, head.others, head.batch_s)  # type: ignore[call-arg]


def _resolve_classes() -> bool:
    """Looks the two message classes up once, for the compiled decoder; False while expert.py is not imported."""
    global _classes
    call_cls, result_cls = message_class(CALL), message_class(RESULT)
    if call_cls is None or result_cls is None:
        return False
    _classes = (call_cls, result_cls)
    return True


def _step(body: memoryview, header_len: int, limits: WireLimits) -> StepOutput | None:
    """A step's tokens from a body of a header alone (no frames); None for anything else."""
    if limits.max_depth < STEP_DEPTH or header_len != body.nbytes:
        return None
    try:
        head = _decoder.decode(body)
    except Exception:  # as in `decode`
        return None
    if type(head) is not _StepHead:
        return None
    return StepOutput([TokenOut(*row) for row in head.outputs], head.load)


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
    np_dtype = _NUMPY[meta[0]]
    if np_dtype is not None and not body.readonly:  # (0.8 µs through a numpy view, 1.8 as frombuffer and a view)
        return torch.from_numpy(np.ndarray(shape, np_dtype, body, start))
    return torch.frombuffer(body, dtype=dtype, offset=start, count=numel).view(shape)
