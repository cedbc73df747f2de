"""CUDA graphs of an expert worker's batch, on a GPU with the fused kernel (`--kernel triton`; `auto` for fp32).

On one H200 at one stream an EW's batch took ~570 µs of a 1.7 ms layer (docs/performance.md), nearly all of it its
CPU launching a dozen small ops. A graph launches a batch as one: `BatchGraphs` captures, per layer and bucket of B
rows (1, 2, 4, ... up to `max_rows`), the fused kernel's two launches (fabric/kernels/triton_moe.py) over fixed
buffers and the cast to the model's dtype, and replays it for each batch of that layer of at most B rows.

A batch's rows go into the input buffer and its tiles into the bucket's tile buffer, padded with empty tiles to the
grid the graph was captured with, each in one copy from pinned memory, queued; the caller copies the output's first
N rows back. Rows past N hold an earlier batch's: no tile reads them.

A layer's graphs hold the addresses of its stacked experts. When experts load, the executor builds the layer a new
stack (expert_worker/executor.py); a graph names the stack it was captured for and is captured again on its next
use. Batches of rows from several layers, or of more than `max_rows`, run op by op.

Off a GPU (`capture=False`: the tests' way) a graph is the same launches over the same buffers.

Legend: N rows of a batch (one layer's, sorted by expert), B its bucket, D hidden, I intermediate, E' the layer's
experts here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class Stack(Protocol):
    order: list[int]
    gate_up: torch.Tensor  # [E', D, 2I]
    down: torch.Tensor  # [E', I, D]


class BatchGraphs:
    """An EW's graphs, per (layer, bucket of rows), over one set of buffers: batches run one at a time."""

    def __init__(self, kernels: Any, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 max_rows: int, capture: bool = True) -> None:
        self.kernels = kernels  # fabric.kernels.triton_moe
        self.device = device
        self.capture = capture
        b, buckets = 1, []
        while b < max_rows:
            buckets.append(b)
            b *= 2
        self.buckets = [*buckets, max_rows]
        self.x = torch.zeros(max_rows, hidden, dtype=dtype, device=device)  # [Bmax, D]
        self.h = torch.zeros(max_rows, inter, dtype=torch.float32, device=device)  # [Bmax, I]
        self.y = torch.zeros(max_rows, hidden, dtype=torch.float32, device=device)  # [Bmax, D]
        self.out = self.y if dtype == torch.float32 else torch.zeros(max_rows, hidden, dtype=dtype, device=device)
        self.metas: dict[int, torch.Tensor] = {}  # tiles -> [3, tiles] int32
        self.graphs: dict[tuple[int, int], tuple[Stack, Callable[[], None]]] = {}  # (layer, B) -> (its stack, replay)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.side = torch.cuda.Stream(device) if capture else None
        self.capture_s = 0.0
        self.replays = 0
        # Why capturing failed, once it has: from then on batches run op by op.
        self.failed: str | None = None

    def takes(self, rows: int) -> bool:
        return self.failed is None and 0 < rows <= self.buckets[-1]

    def forget(self, layer: int) -> None:
        """Drops a layer's graphs, and with them the stack they hold."""
        for key in [k for k in self.graphs if k[0] == layer]:
            del self.graphs[key]

    def run(self, layer: int, stack: Stack, counts: list[int], x: torch.Tensor) -> torch.Tensor | None:
        """x [N, D] (host memory, pinned on a GPU; rows sorted by expert in the stack's order, counts[i] of
        stack.order[i]) -> its results [N, D] on the device, until the next run; None where capturing failed."""
        n = x.shape[0]
        b = next(b for b in self.buckets if b >= n)
        width = self.kernels.most_tiles(b, len(stack.order))
        meta = self.metas.get(width)
        if meta is None:
            meta = self.metas[width] = torch.zeros(3, width, dtype=torch.int32, device=self.device)
        tiles = self.kernels.tile_meta(counts, width)  # [3, width]
        self.x[:n].copy_(x, non_blocking=True)
        meta.copy_(tiles.pin_memory() if self.capture else tiles, non_blocking=True)
        entry = self.graphs.get((layer, b))
        if entry is None or entry[0] is not stack:
            try:
                entry = self.graphs[(layer, b)] = (stack, self._capture(stack, b, meta))
            except Exception as exc:  # (memory, a kernel that cannot be captured): op by op from here on
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("expert CUDA graphs off: capturing layer %d for %d rows failed (%s); batches run op by op",
                            layer, b, self.failed)
                return None
        entry[1]()
        self.replays += 1
        return self.out[:n]

    def _capture(self, stack: Stack, b: int, meta: torch.Tensor) -> Callable[[], None]:
        x, h, y, out = self.x[:b], self.h[:b], self.y[:b], self.out[:b]

        def body() -> None:
            self.kernels.launch(x, meta, stack.gate_up, stack.down, h, y)
            if out is not y:
                out.copy_(y)  # fp32 -> the model's dtype

        if not self.capture:
            return body
        t0 = time.perf_counter()
        side = self.side
        assert side is not None
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)  # after the batch's copies in
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            body()  # once outside the graph (a Triton compile); it computes this batch, as the replay will again
            side.synchronize()
            # thread_local: a loader thread's copies of experts to the device do not void the capture
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self.capture_s += time.perf_counter() - t0
        log.debug("captured an expert batch of up to %d rows in %.1f ms (%d graphs)", b,
                  (time.perf_counter() - t0) * 1e3, len(self.graphs) + 1)
        return graph.replay
