"""Everything an AW holds: embeddings, attention, norms, routers, dense MLPs, lm_head; never experts.

Projection weights are stored transposed ([in, out]): with the few rows of a decode step, MKL's
x @ W runs about a third faster than x @ W^T on this kind of CPU (bench/README.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fabric.model.checkpoint import Checkpoint, layer_prefix, moe_prefix
from fabric.model.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    qkv_t: torch.Tensor  # [D, (H + 2K) d]: fused so one matmul projects all three, stored transposed
    qkv_bias: torch.Tensor | None
    o_proj_t: torch.Tensor  # [H d, D]
    q_norm: torch.Tensor | None  # [d] (qwen3)
    k_norm: torch.Tensor | None
    router: torch.Tensor | None  # [E, D] for MoE layers
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (gate, up, down) for dense layers


@dataclass
class AttentionWeights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]
    bytes_read: int

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig) -> AttentionWeights:
        ckpt = Checkpoint(model_dir, cfg.torch_dtype)
        layers = [_load_layer(ckpt, cfg, i) for i in range(cfg.num_layers)]
        embed = ckpt.get("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight") else ckpt.get("lm_head.weight")
        return cls(embed, layers, ckpt.get("model.norm.weight"), lm_head, ckpt.bytes_read)


def _load_layer(ckpt: Checkpoint, cfg: ModelConfig, i: int) -> LayerWeights:
    p = layer_prefix(cfg, i)
    q, k, v = (ckpt.get(f"{p}.self_attn.{n}_proj.weight") for n in "qkv")
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([ckpt.get(f"{p}.self_attn.{n}_proj.bias") for n in "qkv"])
    router = dense = None
    if i in cfg.dense_layers:
        gate, up, down = (ckpt.get(f"{p}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
        dense = (gate, up, down)
    else:
        router = ckpt.get(f"{moe_prefix(cfg, i)}.gate.weight")
    return LayerWeights(
        input_norm=ckpt.get(f"{p}.input_layernorm.weight"),
        post_norm=ckpt.get(f"{p}.post_attention_layernorm.weight"),
        qkv_t=torch.cat([q, k, v]).t().contiguous(),
        qkv_bias=bias,
        o_proj_t=ckpt.get(f"{p}.self_attn.o_proj.weight").t().contiguous(),
        q_norm=ckpt.get(f"{p}.self_attn.q_norm.weight") if cfg.qk_norm else None,
        k_norm=ckpt.get(f"{p}.self_attn.k_norm.weight") if cfg.qk_norm else None,
        router=router,
        dense=dense,
    )
