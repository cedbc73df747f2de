"""Where a worker's tensors live (`--device cpu|cuda|cuda:N`).

Weights, the KV cache and the compute are on the device. The wire and the checkpoint store are in host memory.
The spec is checked when the config is made (`fabric.config_fields.check_device`). It is resolved when the
worker starts (`resolve`), and the device must exist then. `to_host` and `to_device` are the moves at the
boundary, no-ops on the CPU."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import numpy as np
import torch

from fabric.config_fields import check_device
from fabric.errors import ConfigError


def resolve(spec: str) -> torch.device:
    """The torch device of `spec`, which must exist here."""
    check_device(spec)
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + (", a build without CUDA" if torch.version.cuda is None else "")
            raise ConfigError(f"--device {spec}: no CUDA device is visible to this process ({build}; "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            raise ConfigError(f"--device {spec}: only {count} CUDA device(s) are visible")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def visible_gpus() -> int:
    """CUDA devices this process sees (0 on a CPU build or a machine without them)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device(spec: str, index: int) -> str:
    """The device of the `index`-th worker of `serve --device spec`.

    `cuda` hands worker i GPU i modulo the GPUs visible, so each has its own where there are enough. `cpu` and
    `cuda:N` are taken as they are."""
    if spec != "cuda":
        return spec
    gpus = visible_gpus()
    if gpus == 0:
        resolve(spec)  # raises, as there is no CUDA device
    return f"cuda:{index % gpus}"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, for the wire or the checkpoint store.

    It is `t` itself where it is there already. Else it is a copy in pinned memory, made before this returns. The
    copy is a DMA at the bus's speed, not staged through a pageable buffer. torch caches the pinned blocks."""
    return t if t.is_cpu else to_host_all(t)[0]


def host_array(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host tensor's memory as a numpy array of its shape, no copy (bfloat16 as int16: for moving its bytes).

    The checkpoint store writes spans through it: numpy's slicing costs ~1 µs where torch's indexing costs ~5."""
    if isinstance(t, np.ndarray):
        return t
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def to_host_all(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Each of `ts` in host memory, as `to_host` makes it, with one wait for all the copies instead of one each."""
    if all(t.is_cpu for t in ts):
        return list(ts)
    hosts = []
    for t in ts:
        if t.is_cpu:
            hosts.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        hosts.append(host.copy_(t, non_blocking=True))
    for device in {t.device for t in ts if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    return hosts


def to_device_all(ts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device`, as `to_device` puts them, in one copy per dtype instead of one each.

    Each dtype's tensors are packed into one pinned buffer. Its copy is queued on the device's stream, so nothing
    waits for it. The results are views of one device buffer per dtype. On the CPU they are `ts` themselves."""
    if device.type == "cpu":
        return ts
    out: list[torch.Tensor] = list(ts)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        sizes = [ts[i].numel() for i in idx]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        torch.cat([ts[i].reshape(-1) for i in idx], out=host)
        for i, part in zip(idx, host.to(device, non_blocking=True).split(sizes)):
            out[i] = part.view(ts[i].shape)
    return out


def for_wire(t: torch.Tensor, conn_device: torch.device | None) -> torch.Tensor:
    """`t` as a connection carries it.

    It stays as it is where the connection carries `t`'s device memory (`Connection.frames_device`). Else it goes
    in host memory."""
    return t if conn_device is not None and t.device == conn_device else to_host(t)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t`, a host tensor off the wire, on `device`. On the CPU it is `t` itself."""
    return t if t.device == device else t.to(device, non_blocking=True)


async def settled(device: torch.device) -> None:
    """Waits until the kernels queued so far on `device`'s current stream are done.

    It does not hold up the event loop, as a thread waits on a CUDA event. On the CPU it returns at once. Call it
    before a transport reads or writes device memory outside the stream's order (UCX)."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    if not event.query():
        await asyncio.to_thread(event.synchronize)


def done() -> bool:
    return True


class HostCopies:
    """Copies of device tensors into pinned host memory on a side stream, so the step that made them goes on.

    The checkpoint lane's KV segments use it. `start` returns the host tensor at once, and a function that says
    whether its copy is done. On the CPU a tensor is its own copy, done at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
        if self.stream is None or t.is_cpu:
            return t, done
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the kernels that wrote t
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        # t's memory is not reused before the copy has read it.
        t.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return host, event.query
