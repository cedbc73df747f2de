"""The host-memory weight store's format (ReMP's shared CPU-memory weight store).

It holds every tensor a worker serves with, in its serving layout (cast, fused, transposed, packed for the
kernel), in one file on /dev/shm. The weight-store process (weight_store/main.py) writes it once, and every
worker on the host maps it.

    <dir>/manifest.json     {format, key, data, size, tensors: {name: [offset, dtype, shape, transposed]}}
    <dir>/weights-<id>.bin  the tensors, each at a page-aligned offset

The manifest is written after its data file is complete and replaces the old one atomically. So a manifest that
parses names a whole file. A worker maps each tensor it needs on its own (copy-on-write, pre-faulted). Pages are
shared with every other worker on the host, and nothing is copied. What a worker mapped stays valid after the
store is gone or republished: the old file is unlinked, and its pages live on while mapped. `key` says which
checkpoint and which layout. A worker whose key differs (another dtype, another kernel) reads the checkpoint
instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fabric.errors import FabricError

log = logging.getLogger(__name__)

FORMAT = 2  # 2: dense layers' MLPs as (gate_up, down), as experts; weights of any width packed for the kernel
ALIGN = mmap.ALLOCATIONGRANULARITY  # every tensor starts on a page, so each can be mapped alone
MANIFEST = "manifest.json"
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14: read faults now, pages stay shared
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class StoreMiss(FabricError):
    """No usable store here (absent, another model or layout, a broken file), so read the checkpoint."""

    recoverable = True


@dataclass(frozen=True)
class StoreKey:
    fingerprint: str  # the checkpoint's files (names, sizes, modification times)
    dtype: str  # the serving dtype, e.g. "torch.float32"
    # The projections' and experts' layout: "skinny" (packed) or "torch".
    kernel: str


def fingerprint(model_dir: str | Path) -> str:
    h = hashlib.sha256()
    root = Path(model_dir).resolve()
    h.update(str(root).encode())
    for f in sorted(root.iterdir()):
        if f.suffix in (".safetensors", ".json") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:32]


def publish(directory: Path, key: StoreKey, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Writes every tensor, then the manifest naming them (atomically), then unlinks older data files.

    Returns the manifest."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = f"weights-{os.getpid()}-{time.time_ns()}.bin"
    entries: dict[str, list[Any]] = {}
    with open(directory / data, "wb") as f:
        for name, t in tensors:
            if name in entries:
                raise ValueError(f"tensor {name!r} published twice")
            transposed = t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()
            body = (t.t() if transposed else t).contiguous()  # a transposed view keeps its layout
            f.write(b"\0" * (-f.tell() % ALIGN))
            entries[name] = [f.tell(), str(body.dtype), list(body.shape), transposed]
            if body.numel():
                f.write(body.reshape(-1).view(torch.uint8).numpy().data)
        size = f.tell()
    manifest = {"format": FORMAT, "key": asdict(key), "data": data, "size": size, "tensors": entries}
    tmp = directory / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / MANIFEST)
    for old in directory.glob("weights-*.bin"):
        if old.name != data:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return manifest


def read_manifest(directory: Path, key: StoreKey | None = None) -> dict[str, Any]:
    """The manifest of a complete store with this key; StoreMiss says why not."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise StoreMiss(f"no weight store in {directory}") from None
    except (OSError, ValueError) as exc:
        raise StoreMiss(f"unreadable weight store manifest in {directory}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise StoreMiss(f"weight store format {manifest.get('format')}, this build reads {FORMAT}")
    if key is not None and manifest.get("key") != asdict(key):
        raise StoreMiss(f"the weight store holds {manifest.get('key')}, this worker needs {asdict(key)}")
    try:
        if (directory / manifest["data"]).stat().st_size != manifest["size"]:
            raise StoreMiss(f"weight store data {manifest['data']} has the wrong size")
    except FileNotFoundError:
        raise StoreMiss(f"weight store data {manifest['data']} is gone") from None
    return manifest


class MappedStore:
    """A worker's view of the store: `get(name)` maps one tensor, with no copy and no checkpoint read.

    The data file is mapped once, private and writable, as torch wants a writable buffer. Nothing writes, so
    every page stays the store's, shared with every worker of the host. Each tensor is a view of it whose pages
    are faulted in read-only up front (MADV_POPULATE_READ), so the first step takes no page faults. There is one
    file descriptor per store, whatever the tensor count."""

    def __init__(self, directory: str | Path, key: StoreKey) -> None:
        self.dir = Path(directory)
        # A store may republish between our reads of manifest and data.
        for attempt in range(3):
            manifest = read_manifest(self.dir, key)
            try:
                fd = os.open(self.dir / manifest["data"], os.O_RDONLY)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise StoreMiss(f"weight store data in {self.dir} keeps changing") from None
        try:
            size = int(manifest["size"])
            self._region = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        finally:
            os.close(fd)  # the mapping keeps what it needs
        self._bytes = torch.frombuffer(self._region, dtype=torch.uint8) if self._region is not None else None
        self._tensors: dict[str, list[Any]] = manifest["tensors"]
        self.bytes_mapped = 0

    @classmethod
    def wait(cls, directory: str | Path, key: StoreKey, timeout: float) -> MappedStore:
        """The store once its manifest is there, waiting at most `timeout` seconds.

        A store may still be building at start-up. Raises StoreMiss if it does not come or has another key."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls(directory, key)
            except StoreMiss as exc:
                if (Path(directory) / MANIFEST).exists() or time.monotonic() >= deadline:
                    raise exc from None
            time.sleep(0.05)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        entry = self._tensors.get(name)
        if entry is None:
            raise StoreMiss(f"the weight store lacks tensor {name!r}")
        offset, dtype_name, shape, transposed = entry
        dtype = _DTYPES[dtype_name]
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        assert self._region is not None and self._bytes is not None
        if offset + nbytes > len(self._region):
            raise StoreMiss(f"weight store tensor {name!r} lies outside its data file")
        # On a kernel before 5.14, pages are faulted in on first use instead.
        with contextlib.suppress(OSError, ValueError):
            self._region.madvise(MADV_POPULATE_READ, offset, nbytes)
        t = self._bytes[offset:offset + nbytes].view(dtype).view(shape)
        self.bytes_mapped += nbytes
        return t.t() if transposed else t

    def close(self) -> None:
        """Drops this view; the tensors mapped from it stay valid (they hold the mapping)."""
        self._bytes = None
        self._region = None


def store_key(model_dir: str | Path, dtype: torch.dtype, gemm: object | None) -> StoreKey:
    """The key of a store of this checkpoint for workers whose projections use `gemm`.

    `gemm` is the skinny kernel (packed layout), or None for torch's matmul."""
    return StoreKey(fingerprint(model_dir), str(dtype), "skinny" if gemm is not None else "torch")


def open_store(directory: str | None, model_dir: str | Path, dtype: torch.dtype, gemm: object | None,
               wait_s: float) -> MappedStore | None:
    """A worker's store, or None to read the checkpoint, with the reason logged.

    `gemm` is the kernel its projections use. Blocking: call from a thread."""
    if not directory:
        return None
    try:
        return MappedStore.wait(directory, store_key(model_dir, dtype, gemm), wait_s)
    except StoreMiss as exc:
        log.warning("reading the checkpoint: %s", exc)
        return None
