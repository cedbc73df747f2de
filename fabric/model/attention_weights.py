"""Everything an AW holds: embeddings, attention, norms, routers, dense MLPs, lm_head; never experts.

The attention projections and lm_head are `Projection`s: packed for the skinny GEMM kernel
(fabric/kernels/skinny.py) when one is given, else stored transposed ([in, out]): with the few rows
of a decode step, MKL's x @ W runs about a third faster than x @ W^T on this kind of CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fabric.kernels.skinny import Projection, SkinnyGemm
from fabric.model.checkpoint import Checkpoint, layer_prefix, moe_prefix
from fabric.model.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    qkv: Projection  # [D, (H + 2K) d]: fused so one matmul projects all three
    qkv_bias: torch.Tensor | None
    o_proj: Projection  # [H d, D]
    q_norm: torch.Tensor | None  # [d] (qwen3)
    k_norm: torch.Tensor | None
    router: torch.Tensor | None  # [E, D] for MoE layers
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (gate, up, down) for dense layers


@dataclass
class AttentionWeights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: Projection  # [D, V] (the checkpoint's [V, D], transposed)
    bytes_read: int

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, gemm: SkinnyGemm | None = None) -> AttentionWeights:
        ckpt = Checkpoint(model_dir, cfg.torch_dtype)
        layers = [_load_layer(ckpt, cfg, i, gemm) for i in range(cfg.num_layers)]
        embed = ckpt.get("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight") else ckpt.get("lm_head.weight")
        return cls(embed, layers, ckpt.get("model.norm.weight"), Projection(lm_head.t(), gemm), ckpt.bytes_read)


def _load_layer(ckpt: Checkpoint, cfg: ModelConfig, i: int, gemm: SkinnyGemm | None) -> LayerWeights:
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
        qkv=Projection(torch.cat([q, k, v]).t().contiguous(), gemm),
        qkv_bias=bias,
        o_proj=Projection(ckpt.get(f"{p}.self_attn.o_proj.weight").t().contiguous(), gemm),
        q_norm=ckpt.get(f"{p}.self_attn.q_norm.weight") if cfg.qk_norm else None,
        k_norm=ckpt.get(f"{p}.self_attn.k_norm.weight") if cfg.qk_norm else None,
        router=router,
        dense=dense,
    )
