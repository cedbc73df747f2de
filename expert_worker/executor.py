"""Runs a gathered batch: rows grouped by (layer, expert) across calls, each expert once.

Legend: R rows of one call, N rows of one expert across calls, D hidden, I intermediate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expert_worker.gather import PendingCall
from fabric.kernels import skinny
from fabric.model.checkpoint import Checkpoint, load_expert
from fabric.model.config import ModelConfig
from fabric.model.ops import swiglu_ffn_t


class ExpertExecutor:
    def __init__(self, cfg: ModelConfig, kernel: str = "auto") -> None:
        self.cfg = cfg
        # (layer, expert) -> (gate_up_t [D, 2I], down_t [I, D]): fused and transposed, the fastest
        # layout for torch's matmul on the few rows an expert sees per batch; or both packed for
        # the skinny GEMM kernel (fabric/kernels/skinny.py), which reads them about twice as fast.
        self.experts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens_by_expert: dict[tuple[int, int], int] = {}
        self.bytes_loaded = 0
        self.want_kernel = kernel if skinny.SkinnyGemm.fits(cfg.hidden_size, 2 * cfg.expert_intermediate) else "torch"
        self.gemm: skinny.SkinnyGemm | None = None  # (chosen by the first load, off the event loop: it may build)
        self.chosen = False

    @property
    def kernel(self) -> str:
        if not self.chosen:
            return "not chosen yet (no experts loaded)"
        return "skinny" if self.gemm is not None else "torch"

    def load(self, model_dir: str | Path, units: list[tuple[int, int]]) -> None:
        """Reads only these experts' tensors (blocking; call from a thread)."""
        if not self.chosen:
            self.gemm, self.chosen = skinny.gemm_for(self.want_kernel, self.cfg.torch_dtype), True
        ckpt = Checkpoint(model_dir, self.cfg.torch_dtype)
        for layer, expert in units:
            gate, up, down = load_expert(ckpt, self.cfg, layer, expert)
            gate_up_t, down_t = torch.cat([gate, up]).t().contiguous(), down.t().contiguous()
            if self.gemm is not None:
                gate_up_t, down_t = self.gemm.pack(gate_up_t), self.gemm.pack(down_t)
            self.experts[(layer, expert)] = (gate_up_t, down_t)
            self.tokens_by_expert.setdefault((layer, expert), 0)
        self.bytes_loaded = ckpt.bytes_read

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
        for unit, parts in groups.items():
            gate_up_t, down_t = self.experts[unit]
            xs = [batch[ci].call.x[s : s + n] for ci, s, n in parts]
            x = xs[0] if len(xs) == 1 else torch.cat(xs)  # [N, D]
            y = self.gemm.swiglu_ffn(x, gate_up_t, down_t) if self.gemm else swiglu_ffn_t(x, gate_up_t, down_t)  # [N, D]
            self.tokens_by_expert[unit] += x.shape[0]
            offset = 0
            for ci, s, n in parts:
                outs[ci][s : s + n] = y[offset : offset + n]
                offset += n
        return outs
