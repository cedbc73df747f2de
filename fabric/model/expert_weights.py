"""An expert's serving layout, whether an EW reads it from the checkpoint or maps it from the weight store.

The layout is (gate_up_t [D, 2I], down_t [I, D]), fused and transposed. That is the fastest layout for torch's
matmul on the few rows an expert sees per batch. Or both are packed for the skinny GEMM kernel
(fabric/kernels/skinny.py), which reads them about twice as fast."""

from __future__ import annotations

import torch

from fabric.kernels import skinny
from fabric.model.checkpoint import Checkpoint, load_expert
from fabric.model.config import ModelConfig

ExpertTensors = tuple[torch.Tensor, torch.Tensor]  # (gate_up_t, down_t)


def expert_names(layer: int, expert: int) -> tuple[str, str]:
    """The weight store's names of one expert's two tensors."""
    return f"experts.{layer}.{expert}.gate_up_t", f"experts.{layer}.{expert}.down_t"


def ffn_serving(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gemm: skinny.SkinnyGemm | None) -> ExpertTensors:
    """A SwiGLU FFN's checkpoint weights, gate and up [I, D] and down [D, I], in the serving layout: an expert's, and
    a dense layer's MLP on the AW (fabric/model/attention_weights.py `DenseMlp`)."""
    gate_up_t, down_t = torch.cat([gate, up]).t().contiguous(), down.t().contiguous()  # [D, 2I], [I, D]
    if gemm is not None:
        gate_up_t, down_t = gemm.pack(gate_up_t), gemm.pack(down_t)
    return gate_up_t, down_t


def prepare_expert(ckpt: Checkpoint, cfg: ModelConfig, gemm: skinny.SkinnyGemm | None, layer: int,
                   expert: int) -> ExpertTensors:
    return ffn_serving(*load_expert(ckpt, cfg, layer, expert), gemm)
