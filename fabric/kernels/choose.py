"""Which kernels a worker runs, from its `--kernel` and `--device`.

On the CPU it runs the compiled module (skinny.py, for AVX-512 or AVX2: the GEMM and paged decode attention) or torch.
`triton` runs the Triton kernels on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how the tests run them. On a GPU `auto` runs an EW's fp32 experts with the fused Triton kernel as CUDA graphs
(expert_worker/graphs.py), and an AW's decode attention with Triton's paged kernel where the AW runs CUDA graphs
(attention_worker/cuda_graphs.py), as a graph needs a paged attention; torch's ops otherwise."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from fabric.errors import ConfigError
from fabric.kernels import skinny

# (q [B, H, d], k_cache, v_cache [blocks * S, K, d], tables [B, T], lens [B], S, scale, window) -> [B, H, d]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, int],
                           torch.Tensor]
PAGED_MAX_HEAD_DIM = 128  # paged_attention.cpp keeps a head's query and sum in registers


def triton_module(name: str, device: torch.device) -> Any:
    """fabric.kernels.<name>, a Triton module, for a worker on `device`.

    Raises a ConfigError saying what `--kernel triton` lacks here."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--kernel triton runs on a CUDA device (--device cuda), or on the CPU under Triton's "
                          "interpreter (TRITON_INTERPRET=1, for tests)")
    try:
        return importlib.import_module(f"fabric.kernels.{name}")
    except ImportError as exc:
        raise ConfigError(f"--kernel triton needs the triton package (pip install 'moe-fabric[gpu]'): {exc}") from None


def expert_ffn(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel an EW runs its experts with: `auto` on a GPU, for fp32, is the fused Triton kernel where triton is
    installed, a layer's batch as one CUDA graph (expert_worker/graphs.py; 1.07x to 1.14x the tokens a second of
    torch's ops on one H200, greedy output as equal to transformers', docs/performance.md). bf16 stays on torch's
    ops: the kernel keeps SwiGLU's product in fp32 where torch rounds it to bf16, and that was not measured against
    transformers. `kernel` itself otherwise (on the CPU: the skinny GEMM for fp32 weights)."""
    if (kernel == "auto" and device.type == "cuda" and dtype == torch.float32
            and importlib.util.find_spec("triton") is not None):
        return "triton"
    return kernel


def gemm(kernel: str, device: torch.device, dtype: torch.dtype) -> skinny.SkinnyGemm | None:
    """The skinny GEMM for the few-row products (the CPU's, fp32, --kernel auto), or None for torch."""
    return skinny.gemm_for(kernel, dtype) if device.type == "cpu" else None


def layer_ops(kernel: str, device: torch.device, dtype: torch.dtype) -> Any | None:
    """The module whose one-call ops (layer_ops.cpp: RMSNorm, RoPE with the cache writes, the router's top-k, the
    plan, the combine) run an AW's per-layer glue, or None for torch's ops: the CPU's, fp32, --kernel auto."""
    return skinny.module_for(kernel, dtype) if device.type == "cpu" else None


def decode_attention(kernel: str, device: torch.device, dtype: torch.dtype, block_size: int,
                     head_dim: int, graphs: bool = False) -> DecodeAttention | None:
    """The AW's decode attention over its paged cache of `block_size`-token blocks.

    None means torch's gather + SDPA (also on the CPU for heads wider than the kernel's 128). On a GPU, `auto`
    with `graphs` (the AW's CUDA graphs, which need a paged attention) is Triton's where triton is installed."""
    if kernel == "auto" and graphs and device.type == "cuda" and not block_size & (block_size - 1):
        kernel = "triton" if importlib.util.find_spec("triton") is not None else kernel
    if kernel == "triton":
        if block_size & (block_size - 1):
            raise ConfigError(f"--kernel triton needs a power-of-two --block-size, not {block_size}")
        mod = triton_module("triton_attention", device)

        def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                block_size: int, scale: float, window: int) -> torch.Tensor:
            return mod.paged_decode_attention(q, kc, vc, tables, lens, block_size, scale, window).to(q.dtype)

        return run
    if device.type != "cpu" or head_dim > PAGED_MAX_HEAD_DIM:
        return None
    ops = skinny.module_for(kernel, dtype)
    return ops.paged_decode if ops is not None else None


def prefills_rowwise(kernel: str, device: torch.device) -> bool:
    """Whether a prefill's rows go through the decode attention `decode_attention` chose, where it chose one, each as a
    decode token of its own: the CPU's kernel (`--kernel auto`). It computes a row the same whatever rows come with it, where SDPA
    over a prefill chunk gave a token other floats than decoding it (a restore recomputes decoded tokens in one
    chunk), and it runs a prefill about as fast as SDPA here (docs/performance.md)."""
    return kernel == "auto" and device.type == "cpu"


def wire_codec(kernel: str, device: str) -> bool:
    """Makes this process encode and decode expert calls and results with the compiled module's codec
    (codec.h: the same bytes, a fraction of msgspec's time) where it runs the CPU's kernels (`--kernel auto`, `--device cpu`),
    whatever the model's dtype; returns whether it does. Elsewhere msgspec's codec stays (fabric/messages/fast.py)."""
    from fabric.messages import fast

    return fast.use_native(skinny.load() if kernel == "auto" and device == "cpu" else None)
