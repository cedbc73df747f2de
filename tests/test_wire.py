"""Codec unit tests: round trips, and every limit a decoder enforces."""

from __future__ import annotations

import pytest
import torch

from fabric.errors import ProtocolError
from fabric.messages.base import decode_message, encode_message
from fabric.messages.client import Submit
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
    msg = Submit("r1", [1, 2, 3], 5, 0.5, 0.9, 10, 2**63 + 5, [2], False, [])
    assert roundtrip(msg) == msg


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
