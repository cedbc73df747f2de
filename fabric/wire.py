"""Wire format of every fabric message: a fixed prefix, a msgpack header, raw tensor frames.

    prefix  = magic b"MoF1" | u32 header_len | u32 n_frames | u64 body_len      (20 bytes)
    body    = n_frames x u64 frame_len | header (msgpack map) | frame 0 | frame 1 | ...

The prefix lets a reader check every length against `WireLimits` *before* it allocates or reads the body. So
an oversized length header costs nothing. A frame is host bytes, or a flat uint8 tensor on a device over a UCX
connection that carries device memory (`fabric.transport.ucx`). The bytes on the wire are the same. msgpack
never carries code (no pickle), and the decoded header is walked once to enforce a nesting-depth limit.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import msgpack

from fabric.errors import ProtocolError

if TYPE_CHECKING:
    import torch

    Frame: TypeAlias = bytes | bytearray | memoryview | torch.Tensor  # a tensor is flat uint8, on a device
else:
    # No torch here, as the control plane's processes never import it.
    Frame = object

MAGIC = b"MoF1"
PREFIX = struct.Struct("<4sIIQ")
PREFIX_SIZE = PREFIX.size


@dataclass(frozen=True)
class WireLimits:
    """Upper bounds a decoder enforces; a frame beyond any of them closes its connection."""

    max_header_bytes: int = 1 << 20
    max_frames: int = 64
    max_body_bytes: int = 512 << 20
    max_depth: int = 16

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_frames, self.max_body_bytes, self.max_depth) <= 0:
            raise ValueError("wire limits must be positive")


DEFAULT_LIMITS = WireLimits()


def nbytes(frame: Frame) -> int:
    return memoryview(frame).nbytes if isinstance(frame, (bytes, bytearray, memoryview)) else frame.nbytes


def encode(header: dict[str, Any], frames: Sequence[Frame] | None = None) -> list[Frame]:
    """Returns the buffers of one message, in order; frames are not copied."""
    frames = list(frames or [])
    head = msgpack.packb(header, use_bin_type=True)
    lens = [nbytes(f) for f in frames]
    lens_raw = struct.pack(f"<{len(lens)}Q", *lens)
    body_len = len(lens_raw) + len(head) + sum(lens)
    prefix = PREFIX.pack(MAGIC, len(head), len(frames), body_len)
    return [prefix, lens_raw, head, *frames]


def encode_bytes(header: dict[str, Any], frames: Sequence[Frame] | None = None) -> bytes:
    """One contiguous buffer (for transports that send whole messages, e.g. websockets)."""
    return b"".join(encode(header, frames))  # type: ignore[arg-type]  # (host frames only)


def parse_prefix(raw: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> tuple[int, int, int]:
    """Validates a prefix; returns (header_len, n_frames, body_len)."""
    if len(raw) != PREFIX_SIZE:
        raise ProtocolError(f"truncated prefix ({len(raw)} bytes)")
    magic, header_len, n_frames, body_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if header_len == 0 or header_len > limits.max_header_bytes:
        raise ProtocolError(f"header length {header_len} outside (0, {limits.max_header_bytes}]")
    if n_frames > limits.max_frames:
        raise ProtocolError(f"{n_frames} frames exceed the limit of {limits.max_frames}")
    if body_len > limits.max_body_bytes:
        raise ProtocolError(f"body of {body_len} bytes exceeds the limit of {limits.max_body_bytes}")
    if body_len < 8 * n_frames + header_len:
        raise ProtocolError("body length smaller than its header and frame table")
    return header_len, n_frames, body_len


def parse_body(
    body: bytes | bytearray | memoryview, header_len: int, n_frames: int, limits: WireLimits = DEFAULT_LIMITS
) -> tuple[dict[str, Any], list[Frame]]:
    """Splits a body into its decoded header and zero-copy frame views."""
    view = memoryview(body)
    table = 8 * n_frames
    lens = frame_lengths(view[:table], header_len, view.nbytes)
    header = decode_header(view[table : table + header_len], limits)
    frames: list[Frame] = []
    offset = table + header_len
    for n in lens:
        frames.append(view[offset : offset + n])
        offset += n
    return header, frames


def frame_lengths(table: bytes | bytearray | memoryview, header_len: int, body_len: int) -> tuple[int, ...]:
    """The frame table's lengths (u64 each), which must add up to the body with the header."""
    n_frames = len(table) // 8
    lens: tuple[int, ...] = struct.unpack(f"<{n_frames}Q", table) if n_frames else ()
    if 8 * n_frames + header_len + sum(lens) != body_len:
        raise ProtocolError("frame lengths do not add up to the body length")
    return lens


def decode_bytes(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], list[Frame]]:
    """Inverse of `encode_bytes`."""
    header_len, n_frames, body_len = parse_prefix(bytes(data[:PREFIX_SIZE]), limits)
    if len(data) != PREFIX_SIZE + body_len:
        raise ProtocolError(f"message of {len(data)} bytes does not match its prefix")
    return parse_body(memoryview(data)[PREFIX_SIZE:], header_len, n_frames, limits)


def decode_header(raw: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable header: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ProtocolError("header is not a map with a string 'kind'")
    _check_depth(header, limits.max_depth - 1)
    return header


def _check_depth(obj: Any, budget: int) -> None:
    """Raises where containers nest deeper than `budget`.

    Map keys are scalars, as msgpack cannot hash a container. So only values are walked, and only the
    containers among them."""
    if budget < 0:
        raise ProtocolError("header nested too deeply")
    for v in (obj.values() if type(obj) is dict else obj):
        if type(v) is dict or type(v) is list:
            _check_depth(v, budget - 1)