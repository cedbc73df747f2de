"""Everything an AW holds: embeddings, attention, norms, routers, dense MLPs, lm_head; never experts.

The attention projections and lm_head are `Projection`s, and a dense layer's MLP a `DenseMlp` in an expert's
layout. They are packed for the skinny GEMM kernel (fabric/kernels/skinny.py) when one is given, else stored
transposed ([in, out]). With the few rows of a decode step, MKL's x @ W runs about a third faster than x @ W^T on
this kind of CPU. On the kernel a row's floats do not depend on the rows beside it.

`serving_tensors` names every tensor in its serving layout. An AW builds its weights from those names, read from
the checkpoint or mapped from the host's weight store (fabric/model/weight_store.py). So both give the same
layout and the same numerics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fabric.kernels.skinny import Projection, SkinnyGemm
from fabric.model.checkpoint import Checkpoint, layer_prefix, moe_prefix
from fabric.model.config import ModelConfig
from fabric.model.expert_weights import ffn_serving
from fabric.model.ops import swiglu_ffn_t


class DenseMlp:
    """A dense layer's SwiGLU MLP in an expert's serving layout (fabric/model/expert_weights.py `ffn_serving`):
    gate_up [D, 2I] (gate and up fused) and down [I, D], both packed for the kernel where the AW has one (fp32 on the
    CPU), so it runs the expert workers' kernel; else torch's matmul."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gemm: SkinnyGemm | None) -> None:
        self.gate_up, self.down = gate_up, down
        self.gemm = gemm if gate_up.dim() == 3 else None
        if gate_up.dim() != down.dim() or (gate_up.dim() == 3 and gemm is None):
            raise ValueError("a dense MLP's two weights are both packed, for the kernel, or neither")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        if self.gemm is not None:
            return self.gemm.swiglu_ffn(x, self.gate_up, self.down)
        return swiglu_ffn_t(x, self.gate_up, self.down)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    qkv: Projection  # [D, (H + 2K) d], fused so one matmul projects all three
    qkv_bias: torch.Tensor | None
    o_proj: Projection  # [H d, D]
    q_norm: torch.Tensor | None  # [d] (qwen3)
    k_norm: torch.Tensor | None
    router: torch.Tensor | None  # [E, D] for MoE layers
    dense: DenseMlp | None  # dense layers' MLP


@dataclass
class AttentionWeights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: Projection  # [D, V] (the checkpoint's [V, D], transposed)
    bytes_read: int  # from the checkpoint
    bytes_mapped: int = 0  # from the weight store

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, gemm: SkinnyGemm | None = None,
             device: torch.device | None = None) -> AttentionWeights:
        """Reads only the tensors an AW needs from the checkpoint."""
        ckpt = Checkpoint(model_dir, cfg.torch_dtype)
        tensors = dict(serving_tensors(ckpt, cfg, gemm))
        return cls.build(tensors.get, cfg, gemm, bytes_read=ckpt.bytes_read, device=device)

    @classmethod
    def build(cls, get: Callable[[str], torch.Tensor | None], cfg: ModelConfig, gemm: SkinnyGemm | None,
              bytes_read: int = 0, bytes_mapped: int = 0, device: torch.device | None = None) -> AttentionWeights:
        """Builds the weights on `device` from serving tensors by name.

        `get` returns None for a tensor the model does not have. Tensors are copied to `device` from host memory;
        on the CPU they are used as they are."""
        def on_device(name: str) -> torch.Tensor | None:
            t = get(name)
            return t.to(device) if t is not None and device is not None and t.device != device else t

        def need(name: str) -> torch.Tensor:
            t = on_device(name)
            assert t is not None, name
            return t

        def proj(name: str, n: int) -> Projection:
            return Projection.prepared(need(name), gemm, n)

        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim

        layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}"
            dense = None
            if i in cfg.dense_layers:
                dense = DenseMlp(need(f"{p}.dense.gate_up"), need(f"{p}.dense.down"), gemm)
            layers.append(LayerWeights(
                input_norm=need(f"{p}.input_norm"), post_norm=need(f"{p}.post_norm"), qkv=proj(f"{p}.qkv", qkv),
                qkv_bias=on_device(f"{p}.qkv_bias"), o_proj=proj(f"{p}.o_proj", cfg.hidden_size), q_norm=on_device(f"{p}.q_norm"),
                k_norm=on_device(f"{p}.k_norm"), router=on_device(f"{p}.router"), dense=dense))
        return cls(need("embed"), layers, need("norm"), proj("lm_head", cfg.vocab_size), bytes_read, bytes_mapped)


def serving_tensors(ckpt: Checkpoint, cfg: ModelConfig, gemm: SkinnyGemm | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every AW tensor in its serving layout, by name, read from the checkpoint."""
    embed = ckpt.get("model.embed_tokens.weight")
    yield "embed", embed
    yield "norm", ckpt.get("model.norm.weight")
    lm_head = embed if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight") else ckpt.get("lm_head.weight")
    yield "lm_head", Projection(lm_head.t(), gemm).w
    for i in range(cfg.num_layers):
        p, out = layer_prefix(cfg, i), f"layers.{i}"
        q, k, v = (ckpt.get(f"{p}.self_attn.{n}_proj.weight") for n in "qkv")
        yield f"{out}.input_norm", ckpt.get(f"{p}.input_layernorm.weight")
        yield f"{out}.post_norm", ckpt.get(f"{p}.post_attention_layernorm.weight")
        yield f"{out}.qkv", Projection(torch.cat([q, k, v]).t().contiguous(), gemm).w
        yield f"{out}.o_proj", Projection(ckpt.get(f"{p}.self_attn.o_proj.weight").t().contiguous(), gemm).w
        if cfg.attention_bias:
            yield f"{out}.qkv_bias", torch.cat([ckpt.get(f"{p}.self_attn.{n}_proj.bias") for n in "qkv"])
        if cfg.qk_norm:
            yield f"{out}.q_norm", ckpt.get(f"{p}.self_attn.q_norm.weight")
            yield f"{out}.k_norm", ckpt.get(f"{p}.self_attn.k_norm.weight")
        if i in cfg.dense_layers:
            gate, up, down = (ckpt.get(f"{p}.mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            gate_up, down = ffn_serving(gate, up, down, gemm)
            yield f"{out}.dense.gate_up", gate_up
            yield f"{out}.dense.down", down
        else:
            yield f"{out}.router", ckpt.get(f"{moe_prefix(cfg, i)}.gate.weight")
