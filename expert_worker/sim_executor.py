"""`--compute sim` for an expert worker, as in production except for the expert math.

A cost model replaces the expert math. A batch of one layer takes `expert_ms`, plus `expert_row_us`
per row. A row's output is its input scaled by a factor of its (layer, expert). So outputs are
deterministic and depend on which expert ran them. They weigh what real ones weigh on the wire
(hidden size, dtype). No weights are read or mapped.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from expert_worker.executor import ExpertExecutor
from expert_worker.gather import PendingCall
from fabric.messages.expert import ExpertCall
from fabric.model.config import ModelConfig
from fabric.model.weight_store import MappedStore

SMALL_CALL = 4  # rows: a call this small has its factor column kept (`SimExecutor._column`)
COLUMNS = 1024  # columns kept at most


def sim_factor(layer: int, expert: int) -> float:
    """The factor by which sim expert (layer, expert) multiplies a row.

    It is small, so the residual stream stays bounded.
    """
    return 0.01 * (1 + (layer * 31 + expert * 7) % 13)


class SimExecutor(ExpertExecutor):
    def __init__(self, cfg: ModelConfig, expert_ms: float, expert_row_us: float) -> None:
        super().__init__(cfg, "torch")
        self.expert_s = expert_ms / 1000
        self.row_s = expert_row_us / 1e6
        self.chosen = True
        self._factors: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}
        self._tables: dict[tuple[int, type], np.ndarray] = {}  # (layer, numpy dtype) -> every expert's factor
        self._columns: dict[tuple, torch.Tensor] = {}  # (layer, experts, counts, dtype, device) -> `_column`'s

    @property
    def kernel(self) -> str:
        return "sim"

    def choose_kernel(self) -> str:
        return "sim"

    def load(self, model_dir: str | Path, units: list[tuple[int, int]], store: MappedStore | None = None) -> None:
        for unit in units:
            self.experts[unit] = (torch.empty(0), torch.empty(0))
            self.tokens_by_expert.setdefault(unit, 0)

    def premap(self, store: MappedStore, units: list[tuple[int, int]]) -> None:
        pass

    def warm_up(self) -> int:
        return 0  # nothing cold: no kernels, no weights

    def _factor(self, layer: int, expert: int, like: torch.Tensor) -> torch.Tensor:
        """`sim_factor(layer, expert)` as a 0-dim tensor of `like`'s dtype and device, made once."""
        key = (layer, expert, like.dtype, like.device)
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = torch.tensor(sim_factor(layer, expert), dtype=like.dtype, device=like.device)
        return f

    def _layer_factors(self, layer: int, dtype: type = np.float64) -> np.ndarray:
        """`sim_factor(layer, e)` of every expert e [E], made once a layer and dtype: float64 (converted to a call's dtype
        as a Python float is), or float32 (rounded as that conversion rounds)."""
        f = self._tables.get((layer, dtype))
        if f is None:
            f = (np.array([sim_factor(layer, e) for e in range(self.cfg.num_experts)]) if dtype is np.float64
                 else self._layer_factors(layer).astype(dtype))
            self._tables[(layer, dtype)] = f
        return f

    def _column(self, c: ExpertCall, like: torch.Tensor) -> torch.Tensor:
        """[R', 1] each row's factor, its expert's, as `like`'s dtype and device: from the layer's table, each expert's
        repeated over its rows (numpy), where a list of a Python float a row took twice as long. A small call's (a few
        streams') is kept for the calls of the same layer, experts and counts: made afresh it cost a two-row call more
        than the op. A larger call's is made each time: keeping its many kinds filled memory with small tensors for the
        garbage collector to walk, which cost more than it saved."""
        key = (c.layer, tuple(c.experts), tuple(c.counts), like.dtype, like.device) if c.x.shape[0] <= SMALL_CALL else None
        col = self._columns.get(key) if key is not None else None
        if col is None:
            if like.dtype == torch.float32 and like.is_cpu:  # (the usual case: no conversion, no copy)
                col = torch.from_numpy(np.repeat(self._layer_factors(c.layer, np.float32)[c.experts], c.counts)[:, None])
            else:
                factors = np.repeat(self._layer_factors(c.layer)[c.experts], c.counts)  # [R']
                col = torch.from_numpy(factors).to(like.dtype).to(like.device)[:, None]
            if key is not None and len(self._columns) < COLUMNS:
                self._columns[key] = col
        return col

    def run(self, batch: list[PendingCall]) -> list[torch.Tensor]:
        outs = []
        rows = 0
        for p in batch:
            c = p.call
            n_rows = 0
            for e, n in zip(c.experts, c.counts):
                self.tokens_by_expert[(c.layer, e)] = self.tokens_by_expert.get((c.layer, e), 0) + n
                n_rows += n
            if len(c.counts) == 1 and n_rows:  # one expert's rows (most calls at few streams): one op
                outs.append(c.x * self._factor(c.layer, c.experts[0], c.x))
            elif n_rows:
                outs.append(c.x * self._column(c, c.x))  # [R', D] * [R', 1]: every row by its expert's factor, one op
            else:
                outs.append(torch.empty_like(c.x))
            rows += n_rows
        cost = self.expert_s + rows * self.row_s
        # A sleep of 0 still costs ~90 us on the 2-core VM, so a zero-cost model does not sleep at all.
        if cost > 0:
            time.sleep(cost)  # the cost model; it blocks, as compute does
        return outs
