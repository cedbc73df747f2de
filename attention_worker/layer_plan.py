"""One MoE layer's rows planned for the experts, and their results combined: the tensor parts of the REFE.

`plan_layer` sorts a layer's rows by expert; `combine` adds the weighted expert results to each token. Both are
pure. The REFE (attention_worker/forwarding.py) sends the planned rows to the EWs in between.

Legend: T tokens, k experts per token, R = T*k rows, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fabric.device import to_device, to_host, to_host_all

# Rows of a layer's expert-sorted rows: a run, or indices [R'].
Rows = slice | torch.Tensor
Part = tuple[Rows, torch.Tensor]  # some rows and their results [R', D]

# numpy has no bfloat16: such tensors are gathered as integers of their size (a gather is a copy).
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class LayerPlan:
    """One MoE layer's rows, sorted by expert. `plan_layer` makes it."""

    layer: int
    xs: torch.Tensor  # [R, D] rows in expert order, in host memory
    spans: dict[int, tuple[int, int]]  # expert -> (first row, rows)
    token_of_row: torch.Tensor  # [R] the token each row belongs to (host)
    weights: torch.Tensor  # [R] router weights, in row order (host)
    tokens: int  # T

    def rows(self, rows: Rows, conn_device: torch.device | None) -> torch.Tensor:
        """Those rows as a connection carries them: in its device's memory where it carries one, else in host memory."""
        if isinstance(rows, slice):  # (all of them, the usual case while a layer goes to one EW: no view made)
            x = self.xs if rows.start == 0 and rows.stop == self.xs.shape[0] else self.xs[rows]
        else:
            x = self.xs.index_select(0, rows)
        return x if conn_device is None else to_device(x, conn_device)


def plan_layer(layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               num_experts: int) -> LayerPlan:
    """x [T, D], experts [T, k], weights [T, k] -> the layer's rows in expert order; pure.

    The plan is made in host memory, where its rows go on the wire and a decode step's few rows sort in a few µs
    an op. On a GPU, x and its routing come to the host first, in one wait."""
    if not x.is_cpu:  # (the check alone: on the host a call costs a few µs of a layer's plan)
        x, experts, weights = to_host_all(x, experts, weights)
    t, k = experts.shape
    flat = experts.numpy().reshape(-1)  # [R]
    order = np.argsort(flat, kind="stable")  # rows sorted by expert, tokens ascending within
    token_of_row = order // k  # [R]
    xs = _gathered(x, token_of_row)  # [R, D]
    spans = spans_of(np.bincount(flat, minlength=num_experts).tolist())
    w = _gathered(weights, order, flat=True)  # [R]
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    return LayerPlan(layer, xs, spans, torch.from_numpy(token_of_row), w, t)


def _gathered(t: torch.Tensor, idx: np.ndarray, flat: bool = False) -> torch.Tensor:
    """t[idx] along the first dimension (of t flattened, with `flat`), for a host tensor of any dtype, with numpy."""
    if t.dtype == torch.bfloat16 or t.dtype.is_complex:
        a = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
        return torch.from_numpy((a.reshape(-1) if flat else a)[idx]).view(t.dtype)
    a = t.numpy()
    return torch.from_numpy((a.reshape(-1) if flat else a)[idx])


def spans_of(counts: list[int]) -> dict[int, tuple[int, int]]:
    """Rows per expert -> expert: (first row, rows), for the experts that have rows."""
    spans: dict[int, tuple[int, int]] = {}
    row = 0
    for e, n in enumerate(counts):
        if n:
            spans[e] = (row, n)
        row += n
    return spans


def combine(plan: LayerPlan, parts: list[Part], like: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's expert results [T, D], on `like`'s device; pure.

    It is summed in host memory, where the results come off the wire, in row order (experts ascending, as
    transformers adds them); on a GPU the sum then goes to the device in one copy. `like` [T, D] gives its dtype
    and device."""
    yw = _joined(parts, plan.xs) * plan.weights[:, None]  # [R, D]
    if like.is_cpu:
        return torch.zeros_like(like).index_add_(0, plan.token_of_row, yw)
    out = torch.zeros(like.shape, dtype=like.dtype, pin_memory=True)
    return to_device(out.index_add_(0, plan.token_of_row, yw), like.device)


def runs_in_order(parts: list[Part], rows: int) -> list[torch.Tensor] | None:
    """The results of runs that tile the layer's `rows` rows, in row order, or None where they do not.

    That is the usual case, with every EW's rows one run; one call with all the rows (a collapsed layer) the most
    usual, taken first."""
    if len(parts) == 1:
        r, res = parts[0]
        if isinstance(r, slice) and r.start == 0 and r.stop == rows and rows:
            return [to_host(res)]
    runs = [(r, res) for r, res in parts if isinstance(r, slice) and r.stop > r.start]
    if len(runs) != sum(1 for r, _ in parts if not isinstance(r, slice) or r.stop > r.start):
        return None  # some rows come as indices
    runs.sort(key=lambda run: run[0].start)
    end = 0
    for r, _ in runs:
        if r.start != end:
            return None
        end = r.stop
    return [to_host(res) for _, res in runs] if runs and end == rows else None


def _joined(parts: list[Part], xs: torch.Tensor) -> torch.Tensor:
    """The results in row order [R, D], in host memory.

    Where they are runs that tile the rows, they are joined as they are. Otherwise they are scattered into
    place."""
    ys = runs_in_order(parts, xs.shape[0])
    if ys is not None:
        return ys[0] if len(ys) == 1 else torch.cat(ys)
    y = torch.zeros_like(xs)
    for rows_, res in parts:
        y[rows_] = to_host(res)
    return y
