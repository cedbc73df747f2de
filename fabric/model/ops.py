"""Tensor ops shared by both sides.

Legend: T tokens, D hidden, H heads, K kv heads, d head dim, I expert intermediate size. Numerics follow the
transformers implementations (fp32 norm statistics, rotate-half RoPE), so greedy tokens match them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [d/2]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu_ffn_t(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """A SwiGLU FFN, x [T, D] -> [T, D], over fused, transposed weights: gate_up_t [D, 2I] (gate, then up), down_t
    [I, D]."""
    gate, up = (x @ gate_up_t).chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate) * up) @ down_t


def swiglu_ffn_t_into(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`swiglu_ffn_t` written into `out` [T, D], a slice of a batch's output: the same products, bit for bit."""
    gate, up = (x @ gate_up_t).chunk(2, dim=-1)  # [T, I] each
    return torch.matmul(F.silu(gate) * up, down_t, out=out)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), as both architectures route."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
