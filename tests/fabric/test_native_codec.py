"""The kernel module's codec of calls and results (fabric/kernels/codec.h) on its own: it takes the messages it is
for (no silent fall back to msgspec), its tensors view the received buffer and keep it, and it declines the rest.
tests/fabric/test_fast_codec.py holds it to the generic codec's bytes and verdicts."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fabric.kernels import skinny
from fabric.messages import fast
from fabric.messages.base import encode_message
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.wire import DEFAULT_LIMITS, PREFIX_SIZE, encode_bytes, parse_prefix


@pytest.fixture
def ops() -> Iterator[Any]:
    reason = skinny.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    module = skinny.load()
    assert fast.use_native(module)
    yield module
    fast.use_native(None)


def _body(data: bytes) -> tuple[bytearray, int]:
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE], DEFAULT_LIMITS)
    assert n_frames == 1
    return bytearray(data[PREFIX_SIZE:]), header_len


def test_it_takes_every_call_and_result_it_is_for(ops: Any) -> None:
    rng = random.Random(3)
    for _ in range(50):
        x = torch.randn(rng.choice([0, 1, 3, 40]), 512).to(rng.choice([torch.float32, torch.bfloat16]))
        ids = rng.choice([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1])
        experts = rng.sample(range(400), rng.choice([0, 1, 15, 16, 20]))
        for msg, is_call in ((ExpertCall(ids, rng.randint(0, 9), rng.randint(0, 300), experts,
                                         [rng.randint(0, 70000) for _ in experts], x, rng.random() < 0.5,
                                         rng.random() < 0.5), True),
                             (ExpertResult(ids, x, rng.random() < 0.5, rng.random()), False)):
            out = ops.encode_data(msg, is_call, fast.JOIN_BELOW)
            assert out is not None
            data, joined = out
            assert joined == (x.numel() * x.element_size() < fast.JOIN_BELOW)  # (40 rows: 80 KiB, apart)
            if not joined:
                data += x.view(torch.uint8).numpy().tobytes()
            assert data == encode_bytes(*encode_message(msg))  # the generic codec's bytes
            body, header_len = _body(data)
            got = ops.decode_data(body, header_len, ExpertCall, ExpertResult)
            assert type(got) is type(msg)
            for name, value in vars(msg).items():
                theirs = getattr(got, name)
                if isinstance(value, torch.Tensor):
                    assert theirs.dtype == value.dtype and torch.equal(theirs, value)
                else:
                    assert theirs == value and type(theirs) is type(value)


def test_a_received_tensor_views_its_buffer_and_keeps_it(ops: Any) -> None:
    x = torch.randn(3, 512)
    data = fast.encode(ExpertCall(7, 1, 2, [1], [3], x))
    assert data is not None
    body, header_len = _body(data)
    got = ops.decode_data(body, header_len, ExpertCall, ExpertResult)
    assert got.x.data_ptr() == _address(body) + 8 + header_len  # no copy
    with pytest.raises(BufferError):  # held while the tensor lives: the buffer cannot move
        body.extend(b"x")
    del body
    gc.collect()
    assert torch.equal(got.x, x)
    view = got.x
    del got
    gc.collect()
    assert torch.equal(view, x)


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_what_it_does_not_write_or_read_is_declined(ops: Any) -> None:
    assert ops.encode_data(ExpertCall(1, 1, 1, [1], [1], torch.randn(4, 6).t()), True, fast.JOIN_BELOW) is None
    assert ops.encode_data(ExpertCall(-1 - 2**63, 1, 1, [1], [1], torch.randn(1, 4)), True, fast.JOIN_BELOW) is None
    assert ops.encode_data(ExpertCall(True, 1, 1, [1], [1], torch.randn(1, 4)), True, fast.JOIN_BELOW) is None
    assert ops.encode_data(ExpertResult(1, torch.randn(1, 4), True, 0), False, fast.JOIN_BELOW) is None  # an int
    assert ops.encode_data(ExpertResult(1, torch.zeros(2, dtype=torch.float64)), False, fast.JOIN_BELOW) is None
    large = torch.randn(64, 512)  # 128 KiB: everything but the frame, which goes as it lies
    out = ops.encode_data(ExpertResult(1, large), False, fast.JOIN_BELOW)
    assert out is not None and not out[1]
    assert out[0] + large.numpy().tobytes() == fast.encode(ExpertResult(1, large))
    data = fast.encode(ExpertCall(7, 1, 2, [1], [3], torch.randn(3, 4)))
    assert data is not None
    body, header_len = _body(data)
    assert ops.decode_data(bytes(body), header_len, ExpertCall, ExpertResult) is None  # read-only: msgspec's way
    assert ops.decode_data(body[:-1], header_len, ExpertCall, ExpertResult) is None  # a frame a byte short
    assert ops.decode_data(body, header_len - 1, ExpertCall, ExpertResult) is None
    assert ops.decode_data(body, 0, ExpertCall, ExpertResult) is None
    assert ops.decode_data(body, len(body), ExpertCall, ExpertResult) is None
    for cut in range(len(body)):  # every truncation of the body: declined, never read past it
        assert ops.decode_data(body[:cut], header_len, ExpertCall, ExpertResult) is None


def test_integers_of_every_width_both_signs(ops: Any) -> None:
    """Each msgpack form of an integer at its edges (fixint, 8 to 64 bits, negative ones too), as the generic codec
    writes them, and back."""
    edges = [-1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63, 0, 127, 128, 255, 256, 65535,
             65536, 2**32 - 1, 2**32, 2**64 - 1]
    msg = ExpertCall(5, 1, 1, edges, edges, torch.randn(2, 4))
    out = ops.encode_data(msg, True, fast.JOIN_BELOW)
    assert out is not None and out[0] == encode_bytes(*encode_message(msg))
    body, header_len = _body(out[0])
    got = ops.decode_data(body, header_len, ExpertCall, ExpertResult)
    assert got.experts == edges and got.counts == edges
