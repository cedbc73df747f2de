"""Selective safetensors reading: each role opens only the tensors (or tensor slices) it needs.

Handles single-file and sharded (`model.safetensors.index.json`) checkpoints, and both expert layouts:
per-expert tensors (`...experts.{j}.w1.weight`, as transformers 4.x and 5.x save) and fused
`...experts.gate_up_proj` / `...experts.down_proj` tensors [E, ...], of which only row j is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from fabric.errors import ModelFormatError
from fabric.model.config import ModelConfig


class Checkpoint:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype) -> None:
        self.dir = Path(model_dir)
        self.dtype = dtype
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: self.dir / f for name, f in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelFormatError(f"{self.dir} has no *.safetensors files")
            self._files = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    for name in h.keys():
                        self._files[name] = f
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name` (or its row `index` along dim 0), cast to the serving dtype."""
        path = self._files.get(name)
        if path is None:
            raise ModelFormatError(f"checkpoint {self.dir} lacks tensor {name!r}")
        with safe_open(str(path), "pt") as h:
            t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t.to(self.dtype).contiguous()


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"model.layers.{layer}"


def moe_prefix(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if cfg.arch == "mixtral" else "mlp"
    return f"{layer_prefix(cfg, layer)}.{block}"


def load_expert(ckpt: Checkpoint, cfg: ModelConfig, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, D], up [I, D], down [D, I]) of one expert, from either checkpoint layout."""
    base = f"{moe_prefix(cfg, layer)}.experts"
    names = ("w1", "w3", "w2") if cfg.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    per_expert = [f"{base}.{expert}.{n}.weight" for n in names]
    if all(ckpt.has(n) for n in per_expert):
        gate, up, down = (ckpt.get(n) for n in per_expert)
        return gate, up, down
    if ckpt.has(f"{base}.gate_up_proj") and ckpt.has(f"{base}.down_proj"):
        gate_up = ckpt.get(f"{base}.gate_up_proj", expert)  # [2I, D]
        inter = gate_up.shape[0] // 2
        return gate_up[:inter].contiguous(), gate_up[inter:].contiguous(), ckpt.get(f"{base}.down_proj", expert)
    raise ModelFormatError(f"checkpoint lacks the weights of layer {layer} expert {expert}")
