"""`ModelConfig`: what the fabric needs from a Hugging Face `config.json`, for both architectures.

Accepts what transformers 4.x and 5.x write: `rope_theta` or `rope_parameters`, `num_experts` or
`num_local_experts`, `torch_dtype` or `dtype`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.errors import ModelFormatError

if TYPE_CHECKING:
    import torch

ARCHS = ("mixtral", "qwen3_moe")
# torch is imported where a dtype is used. The orchestrator never needs it.
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    dense_intermediate: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    sliding_window: int | None
    attention_bias: bool
    qk_norm: bool
    # Layers whose FFN is a dense MLP on the AW (qwen3 mlp_only_layers).
    dense_layers: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    dtype: str

    @property
    def itemsize(self) -> int:
        """Bytes per weight element, without torch, as the orchestrator plans with it."""
        return {"float32": 4, "bfloat16": 2}[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.dense_layers]

    def active_params_per_token(self) -> int:
        """Multiply-accumulate weights one token touches (for the compute-limit estimate)."""
        d = self.hidden_size
        attn = d * self.num_heads * self.head_dim * 2 + d * self.num_kv_heads * self.head_dim * 2
        moe = self.top_k * 3 * d * self.expert_intermediate + d * self.num_experts
        dense = 3 * d * self.dense_intermediate
        ffn = sum(dense if i in self.dense_layers else moe for i in range(self.num_layers))
        return self.num_layers * attn + ffn + d * self.vocab_size

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ModelFormatError(f"{model_dir} is not a model directory: no config.json") from exc
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{path}: invalid JSON: {exc}") from exc
        gen = Path(model_dir) / "generation_config.json"
        gen_raw = json.loads(gen.read_text()) if gen.exists() else {}
        return cls.from_dict(raw, dtype=dtype, generation=gen_raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: str | None = None, generation: dict[str, Any] | None = None) -> ModelConfig:
        arch = raw.get("model_type")
        if arch not in ARCHS:
            raise ModelFormatError(f"unsupported model_type {arch!r}; supported: {', '.join(ARCHS)}")
        try:
            return cls._parse(arch, raw, dtype, generation or {})
        except KeyError as exc:
            raise ModelFormatError(f"config.json lacks {exc.args[0]!r}") from exc

    @classmethod
    def _parse(cls, arch: str, raw: dict[str, Any], dtype: str | None, generation: dict[str, Any]) -> ModelConfig:
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelFormatError(f"rope type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise ModelFormatError("config.json has neither rope_theta nor rope_parameters.rope_theta")
        num_experts = raw.get("num_experts", raw.get("num_local_experts"))
        if not num_experts:
            raise ModelFormatError("config.json has neither num_experts nor num_local_experts")
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        layers = raw["num_hidden_layers"]
        if arch == "qwen3_moe":
            if raw.get("use_sliding_window"):
                raise ModelFormatError("qwen3_moe with use_sliding_window is not supported")
            step = raw.get("decoder_sparse_step", 1) or 1
            only = set(raw.get("mlp_only_layers") or [])
            dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
            expert_inter = raw["moe_intermediate_size"]
            norm_topk = bool(raw.get("norm_topk_prob", False))
            window = None
        else:
            dense = ()
            expert_inter = raw["intermediate_size"]
            norm_topk = True
            window = raw.get("sliding_window")
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        chosen = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if chosen not in DTYPES:
            raise ModelFormatError(f"dtype {chosen!r} is not supported; use float32 or bfloat16")
        return cls(
            arch=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            num_experts=int(num_experts),
            top_k=raw["num_experts_per_tok"],
            expert_intermediate=expert_inter,
            dense_intermediate=raw.get("intermediate_size", expert_inter),
            norm_topk_prob=norm_topk,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position=raw.get("max_position_embeddings", 4096),
            sliding_window=window,
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3_moe",
            dense_layers=dense,
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=chosen,
        )
