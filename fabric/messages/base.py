"""Message base class: a dataclass with a `kind`, carried as a msgpack header plus tensor frames.

Scalar fields go into the header; fields typed `torch.Tensor` become raw frames (their dtype and
shape go into the header). Decoding checks the kind against a registry and every field against its
annotated type, so a well-formed but wrong header is still a `ProtocolError`, never a crash later.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from typing import Any, ClassVar, TypeVar

import torch

from fabric.errors import ProtocolError

# torch.frombuffer warns on read-only buffers; received tensors are never written in place.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_REGISTRY: dict[str, type[Message]] = {}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
M = TypeVar("M", bound="Message")


@dataclasses.dataclass
class Message:
    """Subclasses set `kind` and are registered by `@register`."""

    kind: ClassVar[str] = ""
    _fields: ClassVar[list[tuple[str, Any, bool]]] = []  # (name, checker types, is_tensor)


def register(cls: type[M]) -> type[M]:
    if not cls.kind or cls.kind in _REGISTRY:
        raise TypeError(f"message kind {cls.kind!r} missing or registered twice")
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        fields.append((f.name, _accepted(tp), tp is torch.Tensor))
    cls._fields = fields
    _REGISTRY[cls.kind] = cls
    return cls


def _accepted(tp: Any) -> tuple[type, ...]:
    """The runtime types a field of annotated type `tp` may hold."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for a in typing.get_args(tp) for t in _accepted(a))
    origin = typing.get_origin(tp) or tp
    if origin is type(None):
        return (type(None),)
    if origin is float:
        return (float, int)
    if origin in (list, tuple):
        return (list, tuple)
    if origin is Any:
        return (object,)
    return (origin,)


def encode_message(msg: Message) -> tuple[dict[str, Any], list[memoryview]]:
    header: dict[str, Any] = {"kind": msg.kind}
    frames: list[memoryview] = []
    for name, _, is_tensor in msg._fields:
        value = getattr(msg, name)
        if is_tensor:
            t = value.contiguous()
            header[name] = [_DTYPE_NAMES[t.dtype], list(t.shape), len(frames)]
            frames.append(_tensor_bytes(t))
        else:
            header[name] = value
    return header, frames


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def decode_message(header: dict[str, Any], frames: list[memoryview]) -> Message:
    cls = _REGISTRY.get(header["kind"])
    if cls is None:
        raise ProtocolError(f"unknown message kind {header['kind']!r}")
    kwargs: dict[str, Any] = {}
    for name, accepted, is_tensor in cls._fields:
        if name not in header:
            raise ProtocolError(f"{cls.kind}: missing field {name!r}")
        value = header[name]
        if is_tensor:
            value = _decode_tensor(cls.kind, name, value, frames)
        elif isinstance(value, bool) and bool not in accepted and object not in accepted:
            raise ProtocolError(f"{cls.kind}.{name}: unexpected bool")
        elif not isinstance(value, accepted):
            raise ProtocolError(f"{cls.kind}.{name}: {type(value).__name__} not allowed")
        kwargs[name] = value
    return cls(**kwargs)


def _decode_tensor(kind: str, name: str, meta: Any, frames: list[memoryview]) -> torch.Tensor:
    try:
        dtype_name, shape, index = meta
        dtype = _DTYPES[dtype_name]
        frame = frames[index]
        shape = [int(s) for s in shape]
        numel = 1
        for s in shape:
            if s < 0:
                raise ValueError("negative dimension")
            numel *= s
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ProtocolError(f"{kind}.{name}: bad tensor metadata {meta!r}") from exc
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != frame.nbytes:
        raise ProtocolError(f"{kind}.{name}: shape {shape} does not match a frame of {frame.nbytes} bytes")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(frame, dtype=dtype).view(shape)
