"""Message base class: a dataclass with a `kind`, carried as a msgpack header plus tensor frames.

Every field is encoded and checked by its annotation, compiled once per class (`register`):
scalars (int, float, str, bool), `X | None`, `list[T]`, `dict[str, T]`, enums (as their value),
records (plain dataclasses, nested as maps; see `fabric.routing.RoutingTable`), rows (NamedTuples,
as arrays: named in code, positional on the wire; see `fabric.messages.client.TokenOut`), `Any` (passed
through: the wire's depth limit bounds it), `torch.Tensor` and `numpy.ndarray` (the control plane's:
no torch needed), each a raw frame whose dtype and shape go into the header, at any depth. Decoding checks the kind against a registry and
every value against its annotated type, so a well-formed but wrong header is a `ProtocolError`,
never a crash later (a float where a count belongs, a string where a record belongs). A record's
`__post_init__` may check invariants across fields; what it raises is a `ProtocolError` too.

A tensor on a device (CUDA) encodes as a device frame (its bytes as a flat uint8 tensor, no copy),
which only a connection that carries device memory sends (`Connection.frames_device`); such a
connection's reader hands the decoder device frames, and tensors decode as views of them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from fabric.errors import ProtocolError
from fabric.wire import Frame, nbytes

if typing.TYPE_CHECKING:
    import torch

# torch.frombuffer warns on read-only buffers; received tensors are never written in place.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_REGISTRY: dict[str, type[Message]] = {}
_NP_DTYPES = {"int64": np.dtype(np.int64), "int32": np.dtype(np.int32), "int16": np.dtype(np.int16),
              "float32": np.dtype(np.float32)}
_NP_NAMES = {v: k for k, v in _NP_DTYPES.items()}


TORCH_DTYPE_NAMES = ("float32", "bfloat16", "float16", "int64", "int32", "int16")  # a tensor's dtype on the wire


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    """torch's dtypes by wire name, imported on first use: the control plane's messages carry numpy
    arrays, so the orchestrator never imports torch (a second of its restart)."""
    import torch

    return {name: getattr(torch, name) for name in TORCH_DTYPE_NAMES}


@functools.cache
def _torch_itemsizes() -> dict[Any, int]:
    return {dt: dt.itemsize for dt in _torch_dtypes().values()}


@functools.cache
def _torch_names() -> dict[Any, str]:
    return {v: k for k, v in _torch_dtypes().items()}


def _is_torch_tensor(tp: Any) -> bool:
    return getattr(tp, "__module__", None) == "torch" and getattr(tp, "__name__", None) == "Tensor"
M = TypeVar("M", bound="Message")

Frames = list[Frame]  # (what a decoder gets: memoryviews, or flat uint8 tensors on a device)
Encoder = Callable[[Any, Frames], Any]  # value -> header value (tensors appended to the frames)
Decoder = Callable[[Any, Frames, str], Any]  # header value, frames, where (for errors) -> value


@dataclasses.dataclass
class Message:
    """Subclasses set `kind` and are registered by `@register`."""

    kind: ClassVar[str] = ""
    _codec: ClassVar[list[tuple[str, Encoder, Decoder]]] = []


def register(cls: type[M]) -> type[M]:
    if not cls.kind or cls.kind in _REGISTRY:
        raise TypeError(f"message kind {cls.kind!r} missing or registered twice")
    hints = typing.get_type_hints(cls)
    cls._codec = [(f.name, _encoder(hints[f.name]), _decoder(hints[f.name]))
                  for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    _REGISTRY[cls.kind] = cls
    return cls


def encode_message(msg: Message) -> tuple[dict[str, Any], Frames]:
    header: dict[str, Any] = {"kind": msg.kind}
    frames: Frames = []
    for name, enc, _ in msg._codec:
        header[name] = enc(getattr(msg, name), frames)
    return header, frames


def message_class(kind: str) -> type[Message] | None:
    """The message class registered as `kind`, if its module is imported here."""
    return _REGISTRY.get(kind)


def decode_message(header: dict[str, Any], frames: Frames) -> Message:
    cls = _REGISTRY.get(header["kind"])
    if cls is None:
        raise ProtocolError(f"unknown message kind {header['kind']!r}")
    kwargs: dict[str, Any] = {}
    for name, _, dec in cls._codec:
        if name not in header:
            raise ProtocolError(f"{cls.kind}: missing field {name!r}")
        kwargs[name] = dec(header[name], frames, f"{cls.kind}.{name}")
    return _construct(cls, kwargs, cls.kind)


def _construct(cls: type, kwargs: dict[str, Any], where: str) -> Any:
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # a record's own invariants
        raise ProtocolError(f"{where}: {exc}") from exc


# -- compiling a field's annotation into an encoder and a decoder -------------------------------
def _identity(value: Any, frames: Frames) -> Any:
    return value


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional_arg(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _is_row(tp: Any) -> bool:
    """A NamedTuple: an array on the wire, its fields by position."""
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _plain(tp: Any) -> bool:
    """True when values of `tp` go into the header as they are (no tensors, records or enums inside;
    msgpack writes a row, a tuple, as an array)."""
    inner = _optional_arg(tp)
    if inner is not None:
        return _plain(inner)
    if _is_row(tp):
        return all(_plain(a) for a in typing.get_type_hints(tp).values())
    origin = typing.get_origin(tp)
    if origin in (list, tuple, dict):
        return all(_plain(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return tp in (int, float, str, bool, bytes, Any, type(None))


def _encoder(tp: Any) -> Encoder:
    if _plain(tp):
        return _identity
    inner = _optional_arg(tp)
    if inner is not None:
        enc = _encoder(inner)
        return lambda v, frames: None if v is None else enc(v, frames)
    if _is_torch_tensor(tp):
        return _encode_tensor
    if tp is np.ndarray:
        return _encode_array
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v, frames: v.value
    if _is_record(tp):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(tp) if f.init]
        return lambda v, frames: {name: enc(getattr(v, name), frames) for name, enc in fields}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple):
        item = _encoder(args[0])
        return lambda v, frames: [item(x, frames) for x in v]
    if origin is dict:
        value = _encoder(args[1])
        return lambda v, frames: {k: value(x, frames) for k, x in v.items()}
    raise TypeError(f"cannot encode fields of type {tp!r}")


def _encode_tensor(t: torch.Tensor, frames: Frames) -> list[Any]:
    t = t.contiguous()
    meta = [_torch_names()[t.dtype], list(t.shape), len(frames)]
    frames.append(_tensor_bytes(t) if t.is_cpu else _device_bytes(t))
    return meta


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's bytes as a device frame: [nbytes] uint8, a view."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype == _torch_dtypes()["bfloat16"]:
        t = t.view(_torch_dtypes()["int16"])
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _encode_array(a: np.ndarray, frames: Frames) -> list[Any]:
    """A numpy array as a frame, in the same layout as a tensor's (a receiver may take either)."""
    a = np.ascontiguousarray(a)
    if a.dtype not in _NP_NAMES:
        raise TypeError(f"cannot send arrays of {a.dtype}")
    meta = [_NP_NAMES[a.dtype], list(a.shape), len(frames)]
    frames.append(memoryview(a).cast("B") if a.size else memoryview(b""))  # type: ignore[arg-type]  # (ndarray is a buffer)
    return meta


def _type_error(where: str, value: Any, expected: str) -> ProtocolError:
    return ProtocolError(f"{where}: {type(value).__name__} where {expected} belongs")


def _scalar(tp: type) -> Decoder:
    if tp is int:
        def dec_int(v: Any, frames: Frames, where: str) -> Any:
            if type(v) is not int:  # (not a bool)
                raise _type_error(where, v, "an integer")
            return v
        return dec_int
    if tp is float:
        def dec_float(v: Any, frames: Frames, where: str) -> Any:
            if type(v) is not float and type(v) is not int:
                raise _type_error(where, v, "a number")
            return v
        return dec_float

    def dec(v: Any, frames: Frames, where: str) -> Any:
        if type(v) is not tp:
            raise _type_error(where, v, tp.__name__)
        return v
    return dec


def _decoder(tp: Any) -> Decoder:
    inner = _optional_arg(tp)
    if inner is not None:
        dec = _decoder(inner)
        return lambda v, frames, where: None if v is None else dec(v, frames, where)
    if tp is Any:
        return lambda v, frames, where: v
    if tp is type(None):
        def dec_none(v: Any, frames: Frames, where: str) -> Any:
            if v is not None:
                raise _type_error(where, v, "null")
            return None
        return dec_none
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp)
    if _is_torch_tensor(tp):
        return _decode_tensor
    if tp is np.ndarray:
        return _decode_array
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if _is_record(tp):
        return _record_decoder(tp)
    if _is_row(tp):
        return _row_decoder(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple):
        return _list_decoder(args[0])
    if origin is dict:
        if args[0] is not str:
            raise TypeError("dict fields must have str keys")
        value = _decoder(args[1])

        def dec_dict(v: Any, frames: Frames, where: str) -> Any:
            if type(v) is not dict:
                raise _type_error(where, v, "a map")
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise _type_error(where, k, "a string key")
                out[k] = value(x, frames, where)
            return out
        return dec_dict
    raise TypeError(f"cannot decode fields of type {tp!r}")


def _list_decoder(item_tp: Any) -> Decoder:
    if item_tp is Any:
        def dec_any_list(v: Any, frames: Frames, where: str) -> Any:
            if type(v) is not list:
                raise _type_error(where, v, "a list")
            return v
        return dec_any_list
    if item_tp in (int, str):
        def dec_scalar_list(v: Any, frames: Frames, where: str) -> Any:
            if type(v) is not list or not all(type(x) is item_tp for x in v):
                raise ProtocolError(f"{where}: expected a list of {item_tp.__name__}")
            return v
        return dec_scalar_list
    item = _decoder(item_tp)

    def dec_list(v: Any, frames: Frames, where: str) -> Any:
        if type(v) is not list:
            raise _type_error(where, v, "a list")
        return [item(x, frames, where) for x in v]
    return dec_list


def _enum_decoder(tp: type[enum.Enum]) -> Decoder:
    def dec_enum(v: Any, frames: Frames, where: str) -> Any:
        try:
            return tp(v)
        except (ValueError, TypeError):
            raise ProtocolError(f"{where}: {v!r} is not a {tp.__name__}") from None
    return dec_enum


def _record_decoder(tp: type) -> Decoder:
    hints = typing.get_type_hints(tp)
    fields = [(f.name, _decoder(hints[f.name]),
               f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
              for f in dataclasses.fields(tp) if f.init]

    def dec_record(v: Any, frames: Frames, where: str) -> Any:
        if type(v) is not dict:
            raise _type_error(where, v, f"a {tp.__name__}")
        kwargs = {}
        for name, dec, optional in fields:
            if name in v:
                kwargs[name] = dec(v[name], frames, f"{where}.{name}")
            elif not optional:
                raise ProtocolError(f"{where}: missing field {name!r}")
        return _construct(tp, kwargs, where)
    return dec_record


def _row_decoder(tp: type) -> Decoder:
    decs = [_decoder(a) for a in typing.get_type_hints(tp).values()]
    n = len(decs)

    def dec_row(v: Any, frames: Frames, where: str) -> Any:
        if type(v) is not list or len(v) != n:
            raise ProtocolError(f"{where}: expected a {tp.__name__}, an array of {n}")
        return tp(*[dec(x, frames, where) for dec, x in zip(decs, v, strict=True)])
    return dec_row


def _frame_of(meta: Any, frames: Frames, where: str, dtypes: dict[str, Any]) -> tuple[Any, list[int], Frame]:
    """A tensor's or array's (dtype, shape, frame), checked against the header."""
    try:
        dtype_name, shape, index = meta
        dtype = dtypes[dtype_name]
        if type(index) is not int or not 0 <= index < len(frames) or type(shape) is not list:
            raise ValueError("bad frame index or shape")
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError("dimensions must be non-negative integers")
        frame = frames[index]
    except (ValueError, TypeError, KeyError) as exc:
        raise ProtocolError(f"{where}: bad tensor metadata {meta!r}") from exc
    return dtype, shape, frame


def _check_size(shape: list[int], itemsize: int, frame: Frame, where: str) -> int:
    numel = 1
    for s in shape:
        numel *= s
    size = nbytes(frame)
    if numel * itemsize != size:
        raise ProtocolError(f"{where}: shape {shape} does not match a frame of {size} bytes")
    return numel


def _decode_tensor(meta: Any, frames: Frames, where: str) -> torch.Tensor:
    import torch

    dtype, shape, frame = _frame_of(meta, frames, where, _torch_dtypes())
    on_device = not isinstance(frame, (bytes, bytearray, memoryview))
    if _check_size(shape, _torch_itemsizes()[dtype], frame, where) == 0:
        return torch.empty(shape, dtype=dtype, device=frame.device if on_device else None)  # type: ignore[union-attr]
    if on_device:  # a device frame: a view of it
        return frame.view(dtype).view(shape)  # type: ignore[union-attr,call-overload]
    return torch.frombuffer(frame, dtype=dtype).view(shape)


def _decode_array(meta: Any, frames: Frames, where: str) -> np.ndarray:
    dtype, shape, frame = _frame_of(meta, frames, where, _NP_DTYPES)
    if not isinstance(frame, (bytes, bytearray, memoryview)):  # a device frame: arrays are the host's
        frame = memoryview(frame.cpu().numpy())  # type: ignore[arg-type]  # (ndarray is a buffer)
    if _check_size(shape, dtype.itemsize, frame, where) == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(frame, dtype=dtype).reshape(shape)
