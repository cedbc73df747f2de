"""One MoE layer's rows planned for the experts, and their results combined: the tensor parts of the REFE.

`plan_layer` sorts a layer's rows by expert; `combine` adds the weighted expert results to each token. Both are
pure. The REFE (attention_worker/forwarding.py) sends the planned rows to the EWs in between.

Legend: T tokens, k experts per token, R = T*k rows, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fabric.device import to_device, to_host

# Rows of a layer's expert-sorted rows: a run, or indices [R'].
Rows = slice | torch.Tensor
Part = tuple[Rows, torch.Tensor]  # some rows and their results [R', D]

# Where numpy computes exactly what torch does (a gather is a copy), a host plan takes a few µs an op.
_NUMPY_DTYPES = (torch.float32, torch.float64)


@dataclass
class LayerPlan:
    """One MoE layer's rows, sorted by expert. `plan_layer` makes it."""

    layer: int
    xs: torch.Tensor  # [R, D] rows in expert order, on the AW's device
    host: torch.Tensor  # [R, D] the same in host memory (xs itself on the CPU)
    spans: dict[int, tuple[int, int]]  # expert -> (first row, rows)
    token_of_row: torch.Tensor  # [R] the token each row belongs to
    weights: torch.Tensor  # [R] router weights, in row order
    tokens: int  # T

    def rows(self, rows: Rows, conn_device: torch.device | None) -> torch.Tensor:
        """Those rows as a connection carries them, in device memory where it can, else in host memory."""
        src = self.xs if conn_device is not None and self.xs.device == conn_device else self.host
        return src[rows] if isinstance(rows, slice) else src.index_select(0, rows.to(src.device))


def plan_layer(layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               num_experts: int) -> LayerPlan:
    """x [T, D], experts [T, k] int64, weights [T, k] -> the layer's rows in expert order.

    It is pure. On a GPU it waits for its kernels, so the transport may read the rows."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and experts.dtype == torch.int64 and weights.dtype == x.dtype:
        return _plan_on_host(layer, x, experts, weights, num_experts)
    return _plan_with_torch(layer, x, experts, weights, num_experts)


def _plan_with_torch(layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     num_experts: int) -> LayerPlan:
    t, k = experts.shape
    flat = experts.reshape(-1)  # [R]
    order = torch.argsort(flat, stable=True)  # rows sorted by expert, tokens ascending within
    token_of_row = order // k  # [R]
    xs = x.index_select(0, token_of_row)  # [R, D]
    host = to_host(xs)  # on a GPU, a copy made before this returns
    spans = _spans(torch.bincount(flat, minlength=num_experts).tolist())
    return LayerPlan(layer, xs, host, spans, token_of_row, weights.reshape(-1).index_select(0, order).to(x.dtype), t)


def _plan_on_host(layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  num_experts: int) -> LayerPlan:
    """`plan_layer` for host tensors with numpy: the same rows, order and weights, bit for bit, at a
    third of the per-op cost of torch on a decode step's few rows."""
    t, k = experts.shape
    flat = experts.numpy().reshape(-1)  # [R]
    order = np.argsort(flat, kind="stable")
    token_of_row = order // k  # [R]
    xs = torch.from_numpy(x.numpy()[token_of_row])  # [R, D]
    spans = _spans(np.bincount(flat, minlength=num_experts).tolist())
    w = torch.from_numpy(weights.numpy().reshape(-1)[order])  # [R]
    return LayerPlan(layer, xs, xs, spans, torch.from_numpy(token_of_row), w, t)


def _spans(counts: list[int]) -> dict[int, tuple[int, int]]:
    """Rows per expert -> expert: (first row, rows), for the experts that have rows."""
    spans: dict[int, tuple[int, int]] = {}
    row = 0
    for e, n in enumerate(counts):
        if n:
            spans[e] = (row, n)
        row += n
    return spans


def combine(plan: LayerPlan, parts: list[Part], like: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's expert results [T, D]; pure.

    `like` [T, D] gives its dtype and device."""
    y = _joined(parts, plan.xs)  # [R, D]
    return torch.zeros_like(like).index_add_(0, plan.token_of_row, y * plan.weights[:, None])


def _joined(parts: list[Part], xs: torch.Tensor) -> torch.Tensor:
    """The results in row order [R, D].

    Where they are runs that tile the rows, they are joined as they are. That is the usual case,
    with every EW's rows one run. Otherwise they are scattered into place."""
    runs: list[tuple[slice, torch.Tensor]] = []
    for rows, res in parts:
        if not isinstance(rows, slice):
            runs = []
            break
        if rows.stop > rows.start:
            runs.append((rows, res))
    runs.sort(key=lambda r: r[0].start)
    end = 0
    for rows, _ in runs:
        if rows.start != end:
            break
        end = rows.stop
    if runs and end == xs.shape[0] and len(runs) == sum(1 for rows, _ in parts if isinstance(rows, slice)
                                                         and rows.stop > rows.start):
        ys = [to_device(res, xs.device) for _, res in runs]
        return ys[0] if len(ys) == 1 else torch.cat(ys)
    y = torch.zeros_like(xs)
    for rows_, res in parts:
        y[rows_] = to_device(res, y.device)
    return y
