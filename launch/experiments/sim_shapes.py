"""The model shapes of the scale experiment, as config.json files for `--compute sim` (no weights).

A shape sets the routing table (MoE layers x experts x copies), the bytes on the wire (hidden size,
bf16) and the KV checkpoint traffic (KV heads x head dim per layer).

DeepSeek-V3's attention is MLA. Its cache holds one 576-wide latent (512 + 64 rope) per token and
layer, written here as one KV head of dimension 576. Its first 3 layers are dense.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_COMMON = {"rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "dtype": "bfloat16",
           "tie_word_embeddings": False}

SHAPES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "intermediate_size": 14336, "vocab_size": 32000},
    "qwen3-235b": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 1536, "intermediate_size": 12288, "vocab_size": 151936},
    "deepseek-v3": {"model_type": "qwen3_moe", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 1, "head_dim": 576, "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "intermediate_size": 18432, "mlp_only_layers": [0, 1, 2],
                    "vocab_size": 129280},
}


def write_shape(name: str, root: Path) -> Path:
    """A checkpoint directory holding only `name`'s config.json, which is enough for `--compute sim`."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**_COMMON, **SHAPES[name]}, indent=1))
    return out
