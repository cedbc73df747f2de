"""Runs a gathered batch: rows grouped by (layer, expert) across calls, each expert once.

Legend: R rows of one call, N rows of one expert across calls, D hidden, I intermediate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expert_worker.gather import PendingCall
from fabric.kernels import skinny
from fabric.model.checkpoint import Checkpoint
from fabric.model.config import ModelConfig
from fabric.model.expert_weights import ExpertTensors, expert_kernel, expert_names, prepare_expert
from fabric.model.ops import swiglu_ffn_t
from fabric.model.weight_store import MappedStore


class ExpertExecutor:
    def __init__(self, cfg: ModelConfig, kernel: str = "auto") -> None:
        self.cfg = cfg
        # (layer, expert) -> (gate_up_t, down_t) in their serving layout (fabric/model/expert_weights.py)
        self.experts: dict[tuple[int, int], ExpertTensors] = {}
        self.tokens_by_expert: dict[tuple[int, int], int] = {}
        self.bytes_read = 0  # from the checkpoint
        self.bytes_mapped = 0  # from the host's weight store
        self.want_kernel = expert_kernel(cfg, kernel)
        self.gemm: skinny.SkinnyGemm | None = None  # (chosen by the first load, off the event loop: it may build)
        self.chosen = False
        # A standby's mappings of every expert in the weight store, made ahead (page tables: the
        # pages are the store's); the first assignment takes its slot's and drops the rest.
        self.premapped: dict[tuple[int, int], ExpertTensors] = {}

    @property
    def kernel(self) -> str:
        if not self.chosen:
            return "not chosen yet (no experts loaded)"
        return "skinny" if self.gemm is not None else "torch"

    def choose_kernel(self) -> str:
        """Chooses (and if need be builds) the kernel; returns the layout name the store keys on."""
        if not self.chosen:
            self.gemm, self.chosen = skinny.gemm_for(self.want_kernel, self.cfg.torch_dtype), True
        return "skinny" if self.gemm is not None else "torch"

    def load(self, model_dir: str | Path, units: list[tuple[int, int]], store: MappedStore | None = None) -> None:
        """Takes these experts from a standby's mappings made ahead, maps them from the weight store,
        or reads only their tensors from the checkpoint (blocking; call from a thread)."""
        self.choose_kernel()
        ckpt: Checkpoint | None = None
        mapped_before = store.bytes_mapped if store is not None else 0
        for layer, expert in units:
            ahead = self.premapped.get((layer, expert))
            if ahead is not None:
                self.experts[(layer, expert)] = ahead
                self.bytes_mapped += sum(t.numel() * t.element_size() for t in ahead)
            elif store is not None:
                gate_up, down = (store.get(n) for n in expert_names(layer, expert))
                self.experts[(layer, expert)] = (gate_up, down)
            else:
                ckpt = ckpt or Checkpoint(model_dir, self.cfg.torch_dtype)
                self.experts[(layer, expert)] = prepare_expert(ckpt, self.cfg, self.gemm, layer, expert)
            self.tokens_by_expert.setdefault((layer, expert), 0)
        self.premapped.clear()
        if store is not None:
            self.bytes_mapped += store.bytes_mapped - mapped_before
        if ckpt is not None:
            self.bytes_read += ckpt.bytes_read

    def premap(self, store: MappedStore, units: list[tuple[int, int]]) -> None:
        """A standby's: maps every one of `units` ahead (blocking; call from a thread)."""
        self.choose_kernel()
        for layer, expert in units:
            gate_up, down = (store.get(n) for n in expert_names(layer, expert))
            self.premapped[(layer, expert)] = (gate_up, down)

    def missing(self, call_layer: int, experts: list[int]) -> list[int]:
        return [e for e in experts if (call_layer, e) not in self.experts]

    def run(self, batch: list[PendingCall]) -> list[torch.Tensor]:
        """One output [R, D] per call, rows in the call's order."""
        outs = [torch.empty_like(p.call.x) for p in batch]
        # (layer, expert) -> list of (call index, row start, row count)
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for ci, p in enumerate(batch):
            start = 0
            for e, n in zip(p.call.experts, p.call.counts):
                if n:
                    groups.setdefault((p.call.layer, e), []).append((ci, start, n))
                start += n
        units = list(groups)
        xs = []  # [N, D] per unit
        for unit in units:
            parts = groups[unit]
            x = [batch[ci].call.x[s : s + n] for ci, s, n in parts]
            xs.append(x[0] if len(x) == 1 else torch.cat(x))
            self.tokens_by_expert[unit] += xs[-1].shape[0]
        if self.gemm is not None:  # every expert in one call to the kernel's module
            ys = self.gemm.swiglu_ffns(xs, [self.experts[u][0] for u in units], [self.experts[u][1] for u in units])
        else:
            ys = [swiglu_ffn_t(x, *self.experts[u]) for x, u in zip(xs, units)]
        for unit, y in zip(units, ys):  # y [N, D]
            offset = 0
            for ci, s, n in groups[unit]:
                outs[ci][s : s + n] = y[offset : offset + n]
                offset += n
        return outs
