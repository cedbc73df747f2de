"""The per-layer glue of an AW's step: RMSNorm, the residual adds, RoPE with the KV cache writes, the router's logits
and top-k, the MoE layer's plan and its combine.

`TorchGlue` runs them as fabric/model/ops.py and layer_plan.py write them, 4 to 8 torch ops each. `NativeGlue`
runs each in one call to the CPU's kernel module (fabric/kernels/layer_ops.cpp): fp32 on the host, AVX-512 or AVX2.
At 8 decode rows the torch ops' dispatch took more of a step than its attention; the numerics are the same
(all but RMSNorm and the router's logits and weights bit for bit, those to their last bit: the sums in another
order, the C library's exp). The router's logits are a token's whatever rows its step holds, which torch's matmul's
are not (from 2 rows on), so that a stream's floats do not depend on how its steps were batched.

Legend: T tokens, D hidden, N heads (H query, K kv), d head dim, k experts a token, E experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attention_worker.layer_plan import LayerPlan, Part, combine, plan_layer, runs_in_order, spans_of
from fabric.model.ops import apply_rope, rms_norm, route


class TorchGlue:
    def __init__(self, eps: float) -> None:
        self.eps = eps

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> its RMSNorm with w [D]."""
        return rms_norm(x, w, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h + delta [T, D], and its RMSNorm with w."""
        h = h + delta
        return h, rms_norm(h, w, self.eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, d], cos and sin [T, d] -> [T, N, d]."""
        return apply_rope(x, cos, sin)

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   slots: torch.Tensor, heads: int, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k of a fused projection qkv [T, (H + 2K) d] rotated, k and v written to the caches [slots, K, d]
        at `slots` [T] -> (q [T, H, d], k [T, K, d], v [T, K, d]). With `qk_norms` (q_norm, k_norm [d]: Qwen3's)
        each head of q and of k is RMSNorm'd before it is rotated."""
        t, kv_heads, d = qkv.shape[0], kc.shape[1], kc.shape[2]
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        if qk_norms is None:
            # RoPE on the q and k heads at once: the same product per element, half the ops.
            qk = self.rope(qkv[:, : (heads + kv_heads) * d].view(t, -1, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = self.rope(self.norm(qkv[:, : heads * d].view(t, heads, d), qk_norms[0]), cos, sin)
            k = self.rope(self.norm(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), qk_norms[1]), cos,
                          sin)
        # As kc[slots] = k, without advanced indexing's overhead.
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        return q, k, v

    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, D], the router's weights w [E, D] -> its logits [T, E]."""
        return F.linear(x, w)

    def route(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, experts [T, k] int64) (ops.route)."""
        return route(logits, top_k, normalize)

    def plan(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
             num_experts: int) -> LayerPlan:
        """x [T, D], experts [T, k], weights [T, k] -> the layer's rows in expert order (layer_plan.plan_layer)."""
        return plan_layer(layer, x, experts, weights, num_experts)

    def combine_add(self, h: torch.Tensor, plan: LayerPlan, parts: list[Part]) -> torch.Tensor:
        """h [T, D] + the layer's weighted expert results."""
        return h + combine(plan, parts, h)


class NativeGlue(TorchGlue):
    """The same ops in one kernel call each, where the tensors are fp32 on the host; torch's otherwise."""

    def __init__(self, eps: float, ops: Any) -> None:
        super().__init__(eps)
        self.ops = ops

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:
            return self.ops.rms_norm(x, w, self.eps)
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), w, self.eps).view(x.shape)  # e.g. q [T, H, d]

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if h.dim() != 2 or h.stride(1) != 1 or delta.stride(-1) != 1:
            return super().add_norm(h, delta, w)
        s, y = self.ops.add_rms_norm(h, delta, w, self.eps)
        return s, y

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            x = x.contiguous()
        return self.ops.rope(x, cos, sin)

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   slots: torch.Tensor, heads: int, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qk_norms is None:
            q, k, v = self.ops.rope_cache(qkv, cos, sin, kc, vc, slots, heads)
        else:  # one call where the head norms, their RoPE and the cache writes took six (bench/bench_aw_step.py)
            q, k, v = self.ops.norm_rope_cache(qkv, cos, sin, kc, vc, slots, heads, *qk_norms, self.eps)
        return q, k, v

    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A token's logits whatever rows come with it (torch's matmul sums in an order that changes with the rows)."""
        if x.dim() != 2 or x.stride(1) != 1 or not w.is_contiguous() or w.dtype != torch.float32:
            return super().router_logits(x, w)
        return self.ops.router_logits(x, w)

    def route(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            return route(logits, top_k, normalize)
        weights, experts = self.ops.route(logits, top_k, normalize)
        return weights, experts

    def plan(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
             num_experts: int) -> LayerPlan:
        if not x.is_cpu or x.dim() != 2 or x.stride(1) != 1 or weights.dtype != torch.float32:
            return plan_layer(layer, x, experts, weights, num_experts)
        xs, token_of_row, w, counts = self.ops.plan_rows(x, experts.contiguous(), weights.contiguous(), num_experts)
        return LayerPlan(layer, xs, spans_of(counts.tolist()), token_of_row, w, x.shape[0])

    def combine_add(self, h: torch.Tensor, plan: LayerPlan, parts: list[Part]) -> torch.Tensor:
        ys = runs_in_order(parts, plan.xs.shape[0])
        if ys is None or not all(y.dtype == torch.float32 and y.stride(-1) == 1 for y in ys):
            # rows scattered, none answered (a step with no experts), or results in another layout: torch's way
            return super().combine_add(h, plan, parts)
        return self.ops.combine_add(h, ys, plan.weights, plan.token_of_row)


def glue_for(ops: Any | None, eps: float, dtype: torch.dtype, device: torch.device) -> TorchGlue:
    """The glue of an AW whose kernel module is `ops` (None: torch), for a model of `dtype` on `device`."""
    if ops is not None and dtype == torch.float32 and device.type == "cpu":
        return NativeGlue(eps, ops)
    return TorchGlue(eps)
