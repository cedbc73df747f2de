"""Codec unit tests: round trips, and every limit a decoder enforces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fabric.errors import ProtocolError
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.checkpoint import KvPut
from fabric.messages.client import StepOutput, Submit, TokenOut
from fabric.messages.control import TableDelta, ViewDelta
from fabric.messages.expert import ExpertCall
from fabric.wire import PREFIX_SIZE, WireLimits, decode_bytes, encode_bytes, parse_prefix


def roundtrip(msg):  # type: ignore[no-untyped-def]
    header, frames = encode_message(msg)
    return decode_message(*decode_bytes(encode_bytes(header, frames)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_message_roundtrip(dtype: torch.dtype) -> None:
    x = torch.randn(5, 8).to(dtype)
    out = roundtrip(ExpertCall(7, 3, 1, [0, 2], [2, 3], x))
    assert isinstance(out, ExpertCall) and out.call_id == 7 and out.experts == [0, 2] and out.counts == [2, 3]
    assert out.x.dtype == dtype and torch.equal(out.x, x)


def test_empty_tensor_roundtrip() -> None:
    out = roundtrip(ExpertCall(1, 1, 0, [], [], torch.zeros(0, 8)))
    assert out.x.shape == (0, 8)


def test_scalar_message_roundtrip() -> None:
    msg = Submit(request_id="r1", prompt_ids=[1, 2, 3], max_tokens=5, temperature=0.5, top_p=0.9, top_k=10, seed=2**63 + 5, stop_token_ids=[2], ignore_eos=False, output_ids=[])
    assert roundtrip(msg) == msg


def test_rows_are_arrays_on_the_wire_and_named_in_code() -> None:
    rows = [TokenOut("r1", 7, None, None, None), TokenOut("r2", 9, "length", -0.5, [[9, -0.5], [3, -1.0]])]
    header, _ = encode_message(StepOutput(rows, 4))
    assert header["outputs"][1] == ("r2", 9, "length", -0.5, [[9, -0.5], [3, -1.0]])  # positional
    back = roundtrip(StepOutput(rows, 4))
    assert isinstance(back, StepOutput) and back.outputs == rows and back.outputs[1].finish == "length"
    for bad in (["r1", 7, None, None], ["r1", "7", None, None, None], {"request_id": "r1"}):
        with pytest.raises(ProtocolError, match="outputs"):
            decode_message(*decode_bytes(encode_bytes({"kind": "step_output", "outputs": [bad], "load": 0})))


def test_limits_checked_before_reading_the_body() -> None:
    limits = WireLimits(max_header_bytes=64, max_frames=2, max_body_bytes=1000)
    data = encode_bytes({"kind": "x"})
    parse_prefix(data[:PREFIX_SIZE], limits)
    with pytest.raises(ProtocolError, match="frames"):
        parse_prefix(encode_bytes({"kind": "x"}, [b"a"] * 3)[:PREFIX_SIZE], limits)
    with pytest.raises(ProtocolError, match="body"):
        parse_prefix(encode_bytes({"kind": "x"}, [b"a" * 2000])[:PREFIX_SIZE], limits)
    with pytest.raises(ProtocolError, match="header length"):
        parse_prefix(encode_bytes({"kind": "x" * 100})[:PREFIX_SIZE], limits)
    with pytest.raises(ProtocolError, match="truncated"):
        parse_prefix(data[:5], limits)
    with pytest.raises(ProtocolError, match="magic"):
        parse_prefix(b"XXXX" + data[4:PREFIX_SIZE], limits)


@pytest.mark.parametrize(
    "header",
    [
        {"kind": "expert_call"},  # missing fields
        {"kind": "submit", "request_id": 1},
        {"kind": "hello", "aw_id": "a", "channel": True},  # bool where str expected
        {"kind": "expert_result", "call_id": 1, "y": ["float32", [4, 4], 0]},  # no frame 0
        {"kind": "expert_result", "call_id": 1, "y": ["int8", [1], 0]},  # unknown dtype
        {"kind": "nope"},
    ],
)
def test_wrong_headers_are_protocol_errors(header: dict) -> None:
    with pytest.raises(ProtocolError):
        decode_message(*decode_bytes(encode_bytes(header)))


def test_shape_must_match_frame() -> None:
    data = encode_bytes({"kind": "expert_result", "call_id": 1, "y": ["float32", [100, 100], 0]}, [b"\x00" * 16])
    with pytest.raises(ProtocolError, match="does not match"):
        decode_message(*decode_bytes(data))


def test_depth_limit() -> None:
    obj: object = 1
    for _ in range(40):
        obj = [obj]
    with pytest.raises(ProtocolError, match="deep"):
        decode_bytes(encode_bytes({"kind": "hello", "aw_id": obj}))


def test_depth_limit_boundary() -> None:
    """Containers nested as deep as the limit allows pass; one level more does not."""
    limits = WireLimits(max_depth=4)
    decode_bytes(encode_bytes({"kind": "hello", "a": [[{"b": "leaf"}]]}), limits)  # a value 4 deep
    with pytest.raises(ProtocolError, match="deep"):
        decode_bytes(encode_bytes({"kind": "hello", "a": [[{"b": ["leaf"]}]]}), limits)


def as_tensor_frames(frames: list) -> list[torch.Tensor]:  # type: ignore[type-arg]
    """Host frames as the flat uint8 tensors a connection that lands frames on a device hands the
    decoder (one buffer per frame)."""
    return [torch.frombuffer(bytearray(f), dtype=torch.uint8) if f.nbytes else torch.empty(0, dtype=torch.uint8)
            for f in frames]


def test_device_tensors_go_out_as_device_frames() -> None:
    """A tensor on a device goes out as its bytes, a flat uint8 view on that device, not a copy
    (the meta device stands in for CUDA here: its shapes and dtypes are real, its bytes nowhere)."""
    x = torch.empty(5, 8, dtype=torch.bfloat16, device="meta")  # [R, D]
    header, frames = encode_message(ExpertCall(1, 1, 0, [0], [5], x))
    (frame,) = frames
    assert isinstance(frame, torch.Tensor) and frame.device.type == "meta"
    assert frame.dtype == torch.uint8 and frame.shape == (5 * 8 * 2,)
    out = decode_message(header, frames)
    assert isinstance(out, ExpertCall) and out.x.device.type == "meta" and out.x.dtype == torch.bfloat16
    assert out.x.shape == (5, 8)


@pytest.mark.parametrize("msg", [
    ExpertCall(2, 1, 0, [0, 3], [2, 3], torch.randn(5, 8)),
    ExpertCall(3, 1, 0, [1], [4], torch.randn(4, 8).to(torch.bfloat16)),
    ExpertCall(4, 1, 0, [], [], torch.zeros(0, 8)),
    KvPut(5, "r", 3, torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
    ViewDelta(1, 0, 1, TableDelta(2, [0], ["ew-0"], [], [], ["ew-0"], np.arange(6, dtype=np.int32).reshape(1, 2, 3),
                                  np.ones((1, 2), dtype=np.int16)), [], [], []),
], ids=["fp32", "bf16", "empty", "two-frames", "arrays"])
def test_frames_received_as_tensors_decode_alike(msg: Message) -> None:
    """Frames that arrive as tensors decode to the message that host frames decode to: tensors as
    views of their frames (on the frames' device), arrays in host memory."""
    header, frames = encode_message(msg)
    out = decode_message(header, as_tensor_frames(frames))
    assert type(out) is type(msg)
    for name, want in vars(msg).items():
        got = getattr(out, name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want)
        elif isinstance(want, TableDelta):
            assert got.placement.dtype == np.int32 and np.array_equal(got.placement, want.placement)
            assert np.array_equal(got.active, want.active) and got.changed == want.changed
        else:
            assert got == want
    if isinstance(msg, ExpertCall) and msg.x.numel():
        frame = as_tensor_frames(frames)[0]
        view = decode_message(header, [frame])
        assert isinstance(view, ExpertCall) and view.x.data_ptr() == frame.data_ptr()  # a view, no copy


def test_tensor_frames_of_the_wrong_size_are_protocol_errors() -> None:
    header, frames = encode_message(ExpertCall(2, 1, 0, [0], [5], torch.randn(5, 8)))
    with pytest.raises(ProtocolError, match="does not match"):
        decode_message(header, [torch.empty(5 * 8 * 4 - 4, dtype=torch.uint8)])
