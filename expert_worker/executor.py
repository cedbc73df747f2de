"""Runs a gathered batch, with rows grouped by (layer, expert) across calls and each expert run once.

Experts live on the worker's device (`--device`). Calls arrive and results leave in host memory; on a GPU a
batch's rows go to it in one copy and come back in one. With `--kernel triton` (and `auto` on a GPU for fp32), a layer's
hosted experts are stacked as [E', D, 2I] and [E', I, D], and a batch runs each layer's experts in one fused
launch (fabric/kernels/triton_moe.py); on a GPU a layer's batch is a CUDA graph of it (expert_worker/graphs.py).

Legend: R rows of one call, N rows of one expert across calls, D hidden, I intermediate, E' the
experts of a layer this worker hosts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import torch

from expert_worker.gather import PendingCall
from expert_worker.graphs import BatchGraphs
from fabric import device as dev
from fabric.kernels import choose, skinny
from fabric.messages.expert import ExpertCall
from fabric.model.checkpoint import Checkpoint
from fabric.model.config import ModelConfig
from fabric.model.expert_weights import ExpertTensors, expert_names, prepare_expert
from fabric.model.ops import swiglu_ffn_t_into
from fabric.model.weight_store import MappedStore


class LayerStack:
    """One layer's hosted experts, stacked for the fused kernel.

    `order[i]` is the expert at index i.
    """

    def __init__(self, order: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.order = order
        self.index = {e: i for i, e in enumerate(order)}
        self.gate_up = gate_up  # [E', D, 2I]
        self.down = down  # [E', I, D]


class ExpertExecutor:
    def __init__(self, cfg: ModelConfig, kernel: str = "auto", device: str = "cpu", graphs: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device(device)  # resolved and checked by the worker (fabric/device.py)
        kernel = choose.expert_ffn(kernel, self.device, cfg.torch_dtype)  # (auto on a GPU, fp32: the fused kernel)
        self.triton = choose.triton_module("triton_moe", self.device) if kernel == "triton" else None
        # On a GPU with the fused kernel: one layer's batch of up to `graphs` rows as a CUDA graph (`use_graphs`).
        self.graphs: BatchGraphs | None = None
        self.use_graphs(graphs)
        self.stacks: dict[int, LayerStack] = {}  # --kernel triton: layer -> its hosted experts, stacked
        # (layer, expert) -> (gate_up_t, down_t) in their serving layout (fabric/model/expert_weights.py)
        self.experts: dict[tuple[int, int], ExpertTensors] = {}
        self.tokens_by_expert: dict[tuple[int, int], int] = {}
        self.bytes_read = 0  # from the checkpoint
        self.bytes_mapped = 0  # from the host's weight store
        # The skinny GEMM is the CPU's. Elsewhere, and with triton, experts keep torch's layout.
        self.want_kernel = kernel if self.device.type == "cpu" and kernel != "triton" else "torch"
        # Chosen by the first load, off the event loop, since it may build.
        self.gemm: skinny.SkinnyGemm | None = None
        self.chosen = False
        # A standby's mappings of every expert in the weight store, made ahead. They are only page
        # tables; the pages are the store's. The first assignment takes its slot's and drops the rest.
        self.premapped: dict[tuple[int, int], ExpertTensors] = {}

    @property
    def kernel(self) -> str:
        if not self.chosen:
            return "not chosen yet (no experts loaded)"
        return "triton" if self.triton is not None else "skinny" if self.gemm is not None else "torch"

    def choose_kernel(self) -> str:
        """Chooses the kernel, building it if need be.

        Returns the layout name the store keys on.
        """
        if not self.chosen:
            self.gemm, self.chosen = skinny.gemm_for(self.want_kernel, self.cfg.torch_dtype), True
        return "skinny" if self.gemm is not None else "torch"

    def load(self, model_dir: str | Path, units: list[tuple[int, int]], store: MappedStore | None = None) -> None:
        """Loads these experts.

        It takes them from a standby's mappings made ahead, maps them from the weight store, or reads
        only their tensors from the checkpoint. It blocks, so call it from a thread.
        """
        self.choose_kernel()
        ckpt: Checkpoint | None = None
        mapped_before = store.bytes_mapped if store is not None else 0
        new: dict[tuple[int, int], ExpertTensors] = {}
        for layer, expert in units:
            ahead = self.premapped.get((layer, expert))
            if ahead is not None:
                new[(layer, expert)] = ahead
                self.bytes_mapped += sum(t.numel() * t.element_size() for t in ahead)
            elif store is not None:
                gate_up, down = (store.get(n) for n in expert_names(layer, expert))
                new[(layer, expert)] = (gate_up, down)
            else:
                ckpt = ckpt or Checkpoint(model_dir, self.cfg.torch_dtype)
                new[(layer, expert)] = prepare_expert(ckpt, self.cfg, self.gemm, layer, expert)
            self.tokens_by_expert.setdefault((layer, expert), 0)
        self._place(new)
        self.premapped.clear()
        if store is not None:
            self.bytes_mapped += store.bytes_mapped - mapped_before
        if ckpt is not None:
            self.bytes_read += ckpt.bytes_read

    def _place(self, new: dict[tuple[int, int], ExpertTensors]) -> None:
        """Puts newly loaded experts onto the device.

        For the fused kernel, it also rebuilds the stacks of their layers. The experts are then views
        into their stack, so there is one copy on the device. An expert is served once it is in
        `experts`, so it goes there last. The main loop runs batches while a load is under way in its
        thread.
        """
        if self.triton is None:
            self.experts.update({u: (gate_up.to(self.device), down.to(self.device))
                                 for u, (gate_up, down) in new.items()})  # (on the CPU: themselves)
            return
        for layer in sorted({lyr for lyr, _ in new}):
            have = {e: t for (lyr, e), t in [*self.experts.items(), *new.items()] if lyr == layer}
            order = sorted(have)
            # Those already stacked are views on the device. The new ones are still in host memory.
            gate_up = torch.stack([have[e][0].to(self.device) for e in order])
            down = torch.stack([have[e][1].to(self.device) for e in order])
            self.stacks[layer] = LayerStack(order, gate_up, down)
            self.experts.update({(layer, e): (gate_up[i], down[i]) for i, e in enumerate(order)})

    def premap(self, store: MappedStore, units: list[tuple[int, int]]) -> None:
        """For a standby, maps every one of `units` ahead.

        It blocks, so call it from a thread.
        """
        self.choose_kernel()
        for layer, expert in units:
            gate_up, down = (store.get(n) for n in expert_names(layer, expert))
            self.premapped[(layer, expert)] = (gate_up, down)

    def warm_up(self) -> int:
        """Runs the cold paths before the worker says it is ready; returns the number of batches run.

        They run inline, as batches run. Every hosted expert runs once. A standby uses two of the
        experts it mapped ahead. One layer also runs at each row count the kernels treat apart:
        1, 3 and 16, since Triton specialises an integer argument equal to 1 or divisible by 16,
        and 80, past the skinny kernel's 48 rows.
        """
        self.choose_kernel()
        scratch = [] if self.experts else sorted(self.premapped)[:2]
        # A standby warms its kernels and JIT on experts it may never serve.
        if scratch:
            self._place({u: self.premapped[u] for u in scratch})
        counts = dict(self.tokens_by_expert)
        try:
            by_layer: dict[int, list[int]] = {}
            for layer, e in sorted(self.experts):
                by_layer.setdefault(layer, []).append(e)
            batches = [(layer, experts, 1) for layer, experts in by_layer.items()]
            first = next(iter(by_layer.items()), None)
            if first is not None:
                batches += [(first[0], first[1], rows) for rows in (3, 16, 80)]
            for layer, experts, rows in batches:
                per = [rows // len(experts) + (i < rows % len(experts)) for i in range(len(experts))] \
                    if rows > 1 else [1] * len(experts)
                x = torch.zeros(sum(per), self.cfg.hidden_size, dtype=self.cfg.torch_dtype)  # [R, D]
                self._run([PendingCall("warm-up", None, ExpertCall(0, 0, layer, experts, per, x))])  # type: ignore[arg-type]
            return len(batches)
        finally:
            self.tokens_by_expert = counts
            for u in scratch:
                self.experts.pop(u, None)
            for layer in {lyr for lyr, _ in scratch}:
                self.stacks.pop(layer, None)
                if self.graphs is not None:
                    self.graphs.forget(layer)  # (graphs of the scratch stacks, which hold their experts)

    def use_graphs(self, max_rows: int, capture: bool = True) -> None:
        """Runs one layer's batch of up to `max_rows` rows from host memory as a CUDA graph: on a GPU with the fused
        kernel, else nothing changes. `capture=False` (the tests', on the CPU): the same launches, not captured."""
        if self.triton is None or max_rows <= 0 or (capture and self.device.type != "cuda"):
            return
        self.graphs = BatchGraphs(self.triton, self.cfg.hidden_size, self.cfg.expert_intermediate, self.cfg.torch_dtype,
                                  self.device, max_rows, capture)

    def missing(self, call_layer: int, experts: list[int]) -> list[int]:
        return [e for e in experts if (call_layer, e) not in self.experts]

    def run(self, batch: list[PendingCall]) -> list[torch.Tensor]:
        """One output [R, D] per call, rows in the call's order."""
        # The current device is per thread, so set it in whichever thread this runs.
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._run(batch)
        return self._run(batch)

    def _run(self, batch: list[PendingCall]) -> list[torch.Tensor]:
        # (layer, expert) -> list of (call index, row start, row count)
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for ci, p in enumerate(batch):
            start = 0
            for e, n in zip(p.call.experts, p.call.counts):
                if n:
                    groups.setdefault((p.call.layer, e), []).append((ci, start, n))
                start += n
        for unit, parts in groups.items():
            self.tokens_by_expert[unit] = self.tokens_by_expert.get(unit, 0) + sum(n for _, _, n in parts)
        if self.gemm is not None:  # (the CPU's) one call for the batch: every expert, its rows gathered and scattered
            units = list(groups)
            segments = [v for unit in units for part in groups[unit] for v in part]
            ends = list(itertools.accumulate(len(groups[unit]) for unit in units))
            return self.gemm.swiglu_calls([p.call.x for p in batch], segments, ends,
                                          [self.experts[u][0] for u in units], [self.experts[u][1] for u in units])
        return self._grouped(batch, groups)

    def _grouped(self, batch: list[PendingCall], groups: dict[tuple[int, int], list[tuple[int, int, int]]]
                 ) -> list[torch.Tensor]:
        """The torch and Triton paths: the batch's rows in one buffer, sorted by (layer, expert).

        On a GPU, calls in host memory go to it in one copy from pinned memory, and the results come back in one,
        with one wait. Each expert runs on its slice of the buffer, into its slice of one output; the fused kernel
        runs a layer's slice in one launch. The rows then go back into call order. A single call's rows, sorted
        by expert as an AW sends them, are in that order already."""
        units = sorted(groups)  # a layer's experts in its stack's order
        sizes = [p.rows for p in batch]
        first = list(itertools.accumulate(sizes, initial=0))
        order = [first[ci] + s + j for u in units for ci, s, n in groups[u] for j in range(n)]  # [N] joined-call row
        perm = None if all(i == r for i, r in enumerate(order)) else torch.tensor(order)
        joined = batch[0].call.x if len(batch) == 1 else torch.cat([p.call.x for p in batch])  # [N, D]
        staged = self.device.type == "cuda" and joined.device.type == "cpu"
        counts = [sum(n for _, _, n in groups[u]) for u in units]
        if staged:
            x = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
            if perm is None:
                x.copy_(joined)
            else:
                torch.index_select(joined, 0, perm, out=x)
        else:
            x = joined if perm is None else joined.index_select(0, perm.to(joined.device))
        replayed = self._replayed(units, counts, x)  # one layer's batch from host memory as a CUDA graph
        if replayed is not None:
            y = replayed if staged else replayed.clone()  # (the graph's buffer, overwritten by its next batch)
        else:
            if staged:
                x = x.to(self.device, non_blocking=True)
            y = torch.empty_like(x)  # [N, D]
            if self.triton is not None:
                self._fused(units, counts, x, y)
            else:
                row = 0
                for unit, n in zip(units, counts):
                    swiglu_ffn_t_into(x[row : row + n], *self.experts[unit], out=y[row : row + n])
                    row += n
        if staged:
            y = dev.to_host_all(y)[0]  # pinned, after one wait
        elif self.device.type == "cuda":
            # The results leave as device memory, which the transport reads outside the stream's order.
            torch.cuda.current_stream(self.device).synchronize()
        if perm is not None:
            y = torch.empty_like(y).index_copy_(0, perm.to(y.device), y)  # call order
        return list(y.split(sizes))

    def _replayed(self, units: list[tuple[int, int]], counts: list[int], x: torch.Tensor) -> torch.Tensor | None:
        """One layer's batch, x [N, D] in host memory (pinned on a GPU), through its CUDA graph: the results [N, D]
        on the device, in the graph's buffer; None where the batch is not one for a graph (expert_worker/graphs.py).
        (On the CPU only the tests have graphs, not captured.)"""
        if (self.graphs is None or not x.is_cpu or not self.graphs.takes(x.shape[0])
                or units[0][0] != units[-1][0]):
            return None
        ((layer, stack, _, _, per),) = self._layers(units, counts)
        return self.graphs.run(layer, stack, per, x)

    def _fused(self, units: list[tuple[int, int]], counts: list[int], x: torch.Tensor, y: torch.Tensor) -> None:
        """Runs each layer's rows, x's slice, through one fused launch over its stacked experts, into y's slice."""
        assert self.triton is not None
        for _, stack, start, end, per in self._layers(units, counts):
            # The kernel accumulates and returns fp32: the copy casts to the batch's dtype.
            y[start:end].copy_(self.triton.fused_moe(x[start:end], per, stack.gate_up, stack.down))

    def _layers(self, units: list[tuple[int, int]], counts: list[int]
                ) -> Iterator[tuple[int, LayerStack, int, int, list[int]]]:
        """Each layer of a batch whose `units` are sorted, so that a layer's rows are contiguous and in its stack's
        order: (layer, its stack, first row, end row, rows of each stacked expert)."""
        row = 0
        for layer, group in itertools.groupby(zip(units, counts), key=lambda unit_rows: unit_rows[0][0]):
            stack = self.stacks[layer]
            per, start = [0] * len(stack.order), row
            for (_, e), n in group:
                per[stack.index[e]] = n
                row += n
            yield layer, stack, start, row, per
