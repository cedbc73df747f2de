"""CUDA graphs of a pure decode step's layers, on a GPU.

On a GPU an AW's step is bound by its CPU, not the GPU: a layer between two expert calls is some forty small
kernels (RMSNorm alone is eight), each launched from Python. On one H200 at one stream the AW's own work was
1.3 ms of a 2.4 ms layer (docs/performance.md). A CUDA graph launches such a run as one: `LayerGraphs`
captures, for a pure decode step of T sequences, the ops from a layer to the next MoE layer's routing
(`ModelRunner.run_layers`) for B >= T sequences (a bucket: 1, 2, 4, then multiples of 8), on first use, and replays
it from then on.

What a graph reads and writes stays at fixed addresses. A step's metadata (RoPE's cos and sin, the new tokens'
cache slots, the block tables in columns as wide as a sequence's may grow, the lengths) is copied into B's
buffers once a step, the residual into the graph's input before each replay; the cache is written through the
slots buffer. The B - T rows of padding write and read one block of the cache that no sequence gets. A graph's outputs (the residual, the MoE layer's input and routing, the K/V it wrote) are
overwritten by its next replay, a step later: the plan copies the routing to the host at once (the checkpointer
reads a step's K/V from the cache, at the step's own slots).

It needs a paged decode attention (on a GPU the Triton kernel, fabric/kernels/triton_attention.py): torch's way
pads every sequence to the longest, a shape that changes each step. Prefill and mixed steps, steps of more than
`max_tokens` sequences, and the part after the last MoE layer (the final norm, lm_head) run op by op. The
kernels are the same either way, so a graph's results are the ops' own.

Off a GPU (`capture=False`: the tests' way) a graph is the same ops run again on the same buffers: everything
but the capture itself.

Legend: T decode sequences (one token each), B its bucket, D hidden, d head dim, W the widest block table, k experts a token.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attention_worker.model_runner import ModelRunner, Routed, StepMeta, StepState

log = logging.getLogger(__name__)

Layers = tuple[int, torch.Tensor, Routed | None]  # as ModelRunner.run_layers returns them
Replay = Callable[[], Layers]


@dataclass
class _Buffers:
    """A decode step's inputs at fixed addresses, for up to `size` sequences: the residual, and the metadata the
    layers read. Rows past the step's own are padding: they write the scratch block and attend to it alone."""

    size: int  # B, a bucket
    h: torch.Tensor  # [B, D]
    meta: StepMeta  # its cos, sin [B, d], slots [B], dec_tables [B, W] and dec_lens [B] are the buffers
    loaded: StepMeta | None = None  # the step whose metadata the buffers hold
    rows: int = 0  # its sequences, T


class LayerGraphs:
    def __init__(self, runner: ModelRunner, max_tokens: int, capture: bool = True) -> None:
        self.runner = runner
        self.capture = capture
        self.device = runner.kv.device
        blocks = runner.kv.blocks
        # W: the most blocks a sequence's table holds, its context over the block size.
        self.width = min(blocks.num_blocks, blocks.blocks_needed([], runner.cfg.max_position))
        # A block of the cache no sequence gets: what padding rows write and read.
        self.scratch = blocks.reserve()
        self.scratch_slot = self.scratch * blocks.block_size
        # A step of T sequences runs the graph of the smallest bucket >= T, padded: 1, 2, 4, then multiples of 8.
        self.buckets = sorted({b for b in (1, 2, 4, *range(8, max_tokens + 8, 8)) if b < max_tokens} | {max_tokens})
        self.last_moe = max((i for i, lw in enumerate(runner.w.layers) if lw.dense is None), default=-1)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool: graphs replay in turn
        # Where graphs are captured: one stream, so cuBLAS makes one workspace for them (it makes one a stream).
        self.side = torch.cuda.Stream(self.device) if capture else None
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int], Replay] = {}  # (first layer, bucket) -> its replay
        self.capture_s = 0.0  # time spent capturing (the warm-up's log says it)
        self.replays = 0
        # Why capturing failed, once it has: from then on every step runs op by op (a worker that cannot capture
        # still serves; one that died of it would be replaced by one that dies of it too).
        self.failed: str | None = None

    def takes(self, step: StepState) -> bool:
        """Whether the step's next layers run as a graph: a pure decode step of at most `max_tokens` sequences,
        with a MoE layer ahead."""
        meta = step.meta
        return (self.failed is None and meta.all_decode and not meta.prefills and 0 < meta.ids.shape[0] <= self.buckets[-1]
                and step.layer <= self.last_moe and meta.dec_tables.shape[1] <= self.width)

    def run(self, step: StepState) -> Layers | None:
        """Runs the step's layers up to the next MoE layer's routing as `ModelRunner.run_layers` does, from a graph;
        None where the step is not one for a graph (`takes`)."""
        if not self.takes(step):
            return None
        t = step.meta.ids.shape[0]
        b = next(b for b in self.buckets if b >= t)
        buf = self.buffers.get(b) or self._buffers(b, step.meta)
        if buf.loaded is not step.meta:
            self._load(buf, step.meta)
        buf.h[:t].copy_(step.h)
        replay = self.graphs.get((step.layer, b))
        if replay is None:
            try:
                replay = self.graphs[(step.layer, b)] = self._capture(step.layer, buf)
            except Exception as exc:  # (a model's op that cannot be captured, memory): op by op from here on
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graphs off: capturing layers %d.. for %d sequences failed (%s); steps run op by op",
                            step.layer, b, self.failed)
                return None
        i, h, routed = replay()
        self.replays += 1
        assert routed is not None  # (`takes`: a MoE layer ahead)
        x, weights, experts = routed
        return i, h[:t], (x[:t], weights[:t], experts[:t])

    def _buffers(self, b: int, meta: StepMeta) -> _Buffers:
        dev = self.device

        def like(x: torch.Tensor, fill: float = 0) -> torch.Tensor:
            return torch.full((b, *x.shape[1:]), fill, dtype=x.dtype, device=dev)

        tables = torch.full((b, self.width), -1, dtype=meta.dec_tables.dtype, device=dev)  # [B, W]
        tables[:, 0] = self.scratch
        # The fields the layers read, as buffers; the others (ids, rows, spans) stay the first step's, unread.
        fixed = dataclasses.replace(meta, cos=like(meta.cos), sin=like(meta.sin), slots=like(meta.slots, self.scratch_slot),
                                    dec_tables=tables, dec_lens=like(meta.dec_lens, 1))
        h = torch.zeros(b, self.runner.cfg.hidden_size, dtype=self.runner.cfg.torch_dtype, device=dev)
        buf = self.buffers[b] = _Buffers(b, h, fixed)
        return buf

    def _load(self, buf: _Buffers, meta: StepMeta) -> None:
        """The step's metadata into the buffers (copies queued on the device, no wait)."""
        f, t = buf.meta, meta.ids.shape[0]
        for dst, src in ((f.cos, meta.cos), (f.sin, meta.sin), (f.slots, meta.slots), (f.dec_lens, meta.dec_lens)):
            dst[:t].copy_(src, non_blocking=True)
        # Columns past this step's widest table keep an earlier step's blocks: the attention reads a sequence's
        # table only up to its length.
        f.dec_tables[:t, : meta.dec_tables.shape[1]].copy_(meta.dec_tables, non_blocking=True)
        if buf.rows > t:  # rows that held an earlier step's sequences are padding again
            f.slots[t : buf.rows] = self.scratch_slot
            f.dec_lens[t : buf.rows] = 1
            f.dec_tables[t : buf.rows, 0] = self.scratch
        buf.loaded, buf.rows = meta, t

    def _capture(self, first: int, buf: _Buffers) -> Replay:
        """The layers from `first` on, over the buffers, as a graph (or, without capture, as a function)."""
        def body() -> Layers:
            return self.runner.run_layers(first, buf.h, buf.meta)

        if not self.capture:
            return body
        t0 = time.perf_counter()
        side = self.side
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            body()  # once outside the graph (cuBLAS's workspace, a Triton compile); it writes what the replay will
            side.synchronize()
            # thread_local: another thread's CUDA call (a checkpoint copy's wait) does not void the capture
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = body()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.capture_s += time.perf_counter() - t0
        log.debug("captured layers %d.. for %d sequences in %.1f ms (%d graphs)", first, buf.size,
                  (time.perf_counter() - t0) * 1e3, len(self.graphs) + 1)

        def replay() -> Layers:
            graph.replay()
            return out

        return replay


def graphs_for(runner: ModelRunner, max_tokens: int) -> LayerGraphs | None:
    """An AW runner's graphs: on a CUDA device with a paged decode attention and `max_tokens` > 0, where the cache
    can spare a block for the padding; else None."""
    if runner.kv.device.type != "cuda" or max_tokens <= 0 or runner.paged is None or not runner.attends:
        return None
    if runner.kv.blocks.num_free < 2:
        log.warning("no CUDA graphs: the KV cache has %d block(s), none to spare for their padding",
                    runner.kv.blocks.num_free)
        return None
    return LayerGraphs(runner, max_tokens)
