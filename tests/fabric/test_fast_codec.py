"""The data path's compiled codecs (fabric/messages/fast.py: msgspec's, and the kernel module's for calls and results)
against the generic one: the same bytes out, the same messages in, and whatever they do not accept left to the generic
decoder, whose verdict then stands."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import torch

from fabric.errors import ProtocolError
from fabric.messages import fast
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.client import StepOutput, TokenOut
from fabric.messages.expert import ExpertCall, ExpertError, ExpertResult
from fabric.wire import DEFAULT_LIMITS, MAGIC, PREFIX, PREFIX_SIZE, WireLimits, decode_bytes, encode_bytes, parse_prefix


@pytest.fixture(autouse=True, params=["msgspec", "native"])
def codec(request: pytest.FixtureRequest) -> Any:
    """Every test with msgspec's codec, then with the kernel module's (fabric/kernels/codec.h), which takes calls and
    results first where a worker loaded it."""
    if request.param == "native":
        from fabric.kernels import skinny

        reason = skinny.unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        assert fast.use_native(skinny.load())
    yield request.param
    fast.use_native(None)


def generic_bytes(msg: Message) -> bytes:
    return encode_bytes(*encode_message(msg))


def through_fast(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """What a connection hands on for `data` (`fast.decode_body`): the fast decoder's message, else the generic one's."""
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE], limits)
    return fast.decode_body(bytearray(data[PREFIX_SIZE:]), header_len, n_frames, limits)


def outcome(decode: Any, data: bytes) -> tuple[Any, ...]:
    """A decoder's verdict, comparable: the message's fields (tensors as dtype, shape, values), or the error."""
    try:
        msg = decode(data)
    except ProtocolError:
        return ("refused",)
    fields = []
    for v in vars(msg).values():
        fields.append((v.dtype, tuple(v.shape), v.tolist()) if isinstance(v, torch.Tensor) else v)
    return (type(msg).__name__, *fields)


def messages(rng: random.Random) -> list[Message]:
    out: list[Message] = []
    for _ in range(40):
        rows, dim = rng.choice([0, 1, 2, 7, 64]), rng.choice([4, 8, 512])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        x = torch.randn(rows, dim).to(dtype)
        experts = rng.sample(range(300), rng.randint(0, 4))
        out.append(ExpertCall(rng.choice([0, 5, 2**40, 2**63 + 1]), rng.randint(0, 70000), rng.randint(0, 200),
                              experts, [rng.randint(0, 300) for _ in experts], x, rng.random() < 0.5,
                              rng.random() < 0.5))
        out.append(ExpertResult(rng.randint(0, 2**33), x, rng.random() < 0.5, rng.random() * 1e-3))
        out.append(StepOutput([_token(rng) for _ in range(rng.choice([0, 1, 3, 32]))], rng.choice([0, 7, 2**40])))
    return out


def _token(rng: random.Random) -> TokenOut:
    top = rng.choice([None, [], [[rng.randint(0, 150_000), -rng.random() * 20] for _ in range(rng.randint(1, 5))]])
    return TokenOut(rng.choice(["r-1", "chatcmpl-ünï", "x" * 40]), rng.randint(0, 2**31), rng.choice([None, "stop", "length"]),
                    rng.choice([None, -rng.random() * 20, 0.0, float("-inf")]), top)


def test_the_fast_codec_is_in_use_here() -> None:
    assert fast.available  # msgspec is a dependency: the tests below would test nothing without it


def test_same_bytes_and_same_messages_as_the_generic_codec() -> None:
    for msg in messages(random.Random(0)):
        data = fast.encode(msg)
        assert data == generic_bytes(msg)
        assert outcome(through_fast, data) == outcome(lambda d: decode_message(*decode_bytes(d)), data)
        assert type(through_fast(data)) is type(msg)
        header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE])
        assert fast.decode(data[PREFIX_SIZE:], header_len, n_frames, DEFAULT_LIMITS) is not None  # its own decoder


_DROP = object()
_FRAME = torch.arange(8, dtype=torch.float32).numpy().tobytes()


def _with_header(header: dict[str, Any], frames: list[bytes]) -> bytes:
    """A message of this header and these frames, packed as a peer might (any key order, any types)."""
    head = msgpack.packb(header, use_bin_type=True)
    table = b"".join(len(f).to_bytes(8, "little") for f in frames)
    body = table + head + b"".join(frames)
    return PREFIX.pack(MAGIC, len(head), len(frames), len(body)) + body


def _step_header(**change: Any) -> dict[str, Any]:
    header = {"kind": "step_output", "outputs": [["r-1", 5, None, -0.5, [[5, -0.5], [9, -2.0]]], ["r-2", 7, "stop", None, None]],
              "load": 3}
    header.update(change)
    return {k: v for k, v in header.items() if v is not _DROP}


@pytest.mark.parametrize("change", [
    {}, {"load": _DROP}, {"outputs": []}, {"extra": 1}, {"outputs": _DROP}, {"load": True}, {"load": 1.5},
    {"outputs": [["r", 5, None, -1, None]]},  # an integer logprob stays one
    {"outputs": [["r", True, None, None, None]]}, {"outputs": [["r", 5.0, None, None, None]]},
    {"outputs": [[5, 5, None, None, None]]}, {"outputs": [["r", 5, 3, None, None]]},
    {"outputs": [["r", 5, None, None]]}, {"outputs": [["r", 5, None, None, None, None]]},
    {"outputs": [["r", 5, None, None, [["a", "b"]]]]},  # values the generic codec takes as they come
    {"outputs": [["r", 5, None, None, [[1, [2, [3]]]]]]}, {"outputs": [["r", 5, None, None, [1, 2]]]},
    {"outputs": [["r", 5, None, None, {"a": 1}]]}, {"outputs": {"r": 1}}, {"kind": "expert_result"},
    {"outputs": [["r", 5, None, None, [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]},  # deeper than the depth limit
])
def test_any_step_header_gets_the_generic_codecs_verdict(change: dict[str, Any]) -> None:
    for header in (_step_header(**change), dict(reversed(list(_step_header(**change).items())))):
        data = _with_header(header, [])
        fast_msg, generic = outcome(through_fast, data), outcome(lambda d: decode_message(*decode_bytes(d)), data)
        assert fast_msg == generic
        if fast_msg != ("refused",):  # and each value of the same type (3 == 3.0 in the comparison above)
            assert [type(v) for row in through_fast(data).outputs for v in row] == \
                [type(v) for row in decode_message(*decode_bytes(data)).outputs for v in row]  # type: ignore[attr-defined]


def test_steps_with_frames_or_deeper_than_a_limit_get_the_generic_codecs_verdict() -> None:
    for frames in ([b"xy"], [b"", b""]):
        data = _with_header(_step_header(), frames)
        assert outcome(through_fast, data) == outcome(lambda d: decode_message(*decode_bytes(d)), data)
    data = fast.encode(StepOutput([TokenOut("r", 1, None, -0.1, [[1, -0.1]])], 2)) or b""
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE])
    for depth in range(1, fast.STEP_DEPTH + 2):
        limits = WireLimits(max_depth=depth)
        fast_verdict = outcome(lambda d, lim=limits: through_fast(d, lim), data)
        assert fast_verdict == outcome(lambda d, lim=limits: decode_message(*decode_bytes(d, lim)), data)
        assert (fast.decode(data[PREFIX_SIZE:], header_len, n_frames, limits) is None) == (depth < fast.STEP_DEPTH)
        assert (fast_verdict == ("refused",)) == (depth < fast.STEP_DEPTH)


def test_other_messages_and_tensors_are_left_to_the_generic_codec() -> None:
    assert fast.encode(ExpertError(3, "not hosted")) is None
    assert fast.encode(ExpertResult(1, torch.randn(4, 6).t())) is None  # not contiguous
    data = generic_bytes(ExpertError(3, "not hosted"))
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE])
    assert fast.decode(data[PREFIX_SIZE:], header_len, n_frames, WireLimits()) is None


def _call_header(**change: Any) -> dict[str, Any]:
    header = {"kind": "expert_call", "call_id": 9, "epoch": 2, "layer": 1, "experts": [3, 4], "counts": [1, 1],
              "x": ["float32", [2, 4], 0], "replay": False, "pads": True}
    header.update(change)
    return {k: v for k, v in header.items() if v is not _DROP}


@pytest.mark.parametrize("change", [
    {},
    {"extra": 1},  # an unknown key: the generic codec ignores it
    {"replay": _DROP},  # a missing field: refused
    {"call_id": True}, {"call_id": 9.0}, {"layer": "1"}, {"experts": [3, "4"]}, {"experts": [[3], 4]},
    {"x": ["float64", [2, 4], 0]}, {"x": ["float32", [4, 4], 0]}, {"x": ["float32", [-2, -4], 0]},
    {"x": ["float32", [2, 4], 1]}, {"x": ["float32", [2, 4]]}, {"x": ["float32", [8], 0]},
    {"x": ["float32", [2, 4, 1, 1, 1], 0]}, {"pads": 1}, {"kind": "expert_result"}, {"kind": "ping"},
    {"experts": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]},  # deeper than the depth limit
])
def test_any_header_gets_the_generic_codecs_verdict(change: dict[str, Any]) -> None:
    data = _with_header(_call_header(**change), [_FRAME])
    assert outcome(through_fast, data) == outcome(lambda d: decode_message(*decode_bytes(d)), data)
    reordered = _with_header(dict(reversed(list(_call_header(**change).items()))), [_FRAME])
    assert outcome(through_fast, reordered) == outcome(lambda d: decode_message(*decode_bytes(d)), reordered)


def test_frame_tables_it_does_not_take_go_to_the_generic_codec() -> None:
    for frames in ([_FRAME, b""], [], [_FRAME[:16], _FRAME[16:]]):
        data = _with_header(_call_header(), frames)
        assert outcome(through_fast, data) == outcome(lambda d: decode_message(*decode_bytes(d)), data)


@pytest.mark.parametrize("kind", ["call", "step"])
def test_random_corruption_gets_the_generic_codecs_verdict(kind: str) -> None:
    """Bytes of a real call's (or step's) header and frame table flipped at random: the two decoders agree on each."""
    rng = random.Random(1)
    msg = ExpertCall(77, 3, 5, [1, 6], [1, 1], torch.randn(2, 4)) if kind == "call" else \
        StepOutput([TokenOut("r-1", 77, None, -0.25, [[77, -0.25], [3, -1.5]]), TokenOut("r-2", 5, "stop", None, None)], 9)
    base = bytearray(fast.encode(msg) or b"")
    header_len, n_frames, _ = parse_prefix(bytes(base[:PREFIX_SIZE]))
    agreed = refused = 0
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            data[PREFIX_SIZE + rng.randrange(8 * n_frames + header_len)] = rng.randrange(256)
        try:
            parse_prefix(bytes(data[:PREFIX_SIZE]))
        except ProtocolError:
            continue
        fast_verdict = outcome(through_fast, bytes(data))
        assert fast_verdict == outcome(lambda d: decode_message(*decode_bytes(d)), bytes(data))
        agreed += 1
        refused += fast_verdict == ("refused",)
    assert agreed > 2000 and 0 < refused < agreed  # both kinds of verdict were compared


def test_a_limit_on_depth_below_its_schema_leaves_every_header_to_the_generic_codec() -> None:
    data = fast.encode(ExpertCall(1, 1, 1, [2], [1], torch.randn(1, 4))) or b""
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE])
    assert fast.decode(data[PREFIX_SIZE:], header_len, n_frames, WireLimits(max_depth=fast.DEPTH - 1)) is None
    with pytest.raises(ProtocolError, match="nested"):
        decode_bytes(data, WireLimits(max_depth=fast.DEPTH - 1))


def test_without_msgspec_every_message_takes_the_generic_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = ExpertCall(1, 1, 1, [2], [1], torch.randn(1, 4))
    data = fast.encode(msg) or b""
    header_len, n_frames, _ = parse_prefix(data[:PREFIX_SIZE])
    monkeypatch.setattr(fast, "msgspec", None)
    assert fast.encode(msg) is None
    assert fast.decode(data[PREFIX_SIZE:], header_len, n_frames, DEFAULT_LIMITS) is None
    assert outcome(through_fast, data) == outcome(lambda d: decode_message(*decode_bytes(d)), data)
