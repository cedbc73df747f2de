"""Checkpoint formats: transformers 4.x/5.x config spellings, sharded files, fused expert tensors,
per-role selective reading, and the demo-model writer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fabric.errors import ModelFormatError
from fabric.model.attention_weights import AttentionWeights
from fabric.model.checkpoint import Checkpoint, load_expert
from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model


def test_config_spellings(hf_models: dict[str, Path]) -> None:
    raw = json.loads((hf_models["mixtral"] / "config.json").read_text())
    base = ModelConfig.from_dict(raw)
    old = dict(raw)
    old.pop("rope_parameters", None)
    old["rope_theta"] = base.rope_theta
    old["torch_dtype"] = old.pop("dtype", "float32")
    assert ModelConfig.from_dict(old) == base
    q = json.loads((hf_models["qwen3_moe"] / "config.json").read_text())
    a = dict(q, num_experts=6)
    a.pop("num_local_experts", None)
    b = dict(q, num_local_experts=6)
    b.pop("num_experts", None)
    assert ModelConfig.from_dict(a) == ModelConfig.from_dict(b)
    with pytest.raises(ModelFormatError, match="model_type"):
        ModelConfig.from_dict(dict(raw, model_type="llama"))
    with pytest.raises(ModelFormatError, match="rope type"):
        ModelConfig.from_dict(dict(raw, rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}))
    with pytest.raises(ModelFormatError, match="no config.json"):
        ModelConfig.from_dir("/nonexistent")


def fuse_and_shard(src: Path, dst: Path, cfg: ModelConfig) -> None:
    """Rewrites a per-expert checkpoint with fused [E, ...] expert tensors, split over two shards."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        base = f"model.layers.{layer}.block_sparse_moe.experts"
        gate_up, down = [], []
        for e in range(cfg.num_experts):
            w1, w2, w3 = (tensors.pop(f"{base}.{e}.{n}.weight") for n in ("w1", "w2", "w3"))
            gate_up.append(torch.cat([w1, w3]))
            down.append(w2)
        out[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{base}.down_proj"] = torch.stack(down)
    names = sorted(tensors) + sorted(out)
    tensors.update(out)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_fused_sharded_layout_reads_the_same_weights(hf_models: dict[str, Path], tmp_path: Path) -> None:
    src = hf_models["mixtral"]
    cfg = ModelConfig.from_dir(src)
    fuse_and_shard(src, tmp_path / "fused", cfg)
    a, b = Checkpoint(src, torch.float32), Checkpoint(tmp_path / "fused", torch.float32)
    for layer, e in [(0, 0), (1, 3), (2, 5)]:
        for x, y in zip(load_expert(a, cfg, layer, e), load_expert(b, cfg, layer, e)):
            assert torch.equal(x, y)
    # reading one expert from a fused tensor reads one expert's bytes, not all of them
    expert_bytes = 3 * cfg.hidden_size * cfg.expert_intermediate * 4
    assert b.bytes_read == 3 * expert_bytes
    w = AttentionWeights.load(tmp_path / "fused", cfg)
    assert torch.equal(w.lm_head.w.t(), Checkpoint(src, torch.float32).get("lm_head.weight"))


def test_roles_read_only_their_tensors(hf_models: dict[str, Path]) -> None:
    src = hf_models["qwen3_moe"]
    cfg = ModelConfig.from_dir(src)
    total = sum((t.numel() * t.element_size()) for t in _all(src).values())
    experts = sum(t.numel() * t.element_size() for n, t in _all(src).items() if ".experts." in n)
    aw = AttentionWeights.load(src, cfg)
    assert aw.bytes_read == total - experts  # every non-expert tensor, no expert tensor
    ckpt = Checkpoint(src, cfg.torch_dtype)
    load_expert(ckpt, cfg, 1, 2)
    assert ckpt.bytes_read == 3 * cfg.hidden_size * cfg.expert_intermediate * 4


def _all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_demo_model_is_deterministic_and_loads_in_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = write_demo_model(tmp_path / "a", arch=arch, seed=3)
    b = write_demo_model(tmp_path / "b", arch=arch, seed=3)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.model_type == arch
    tok = AutoTokenizer.from_pretrained(a)
    text = "héllo wörld 你好 🚀"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    cfg = ModelConfig.from_dir(a)
    assert cfg.arch == arch and cfg.eos_token_ids


def test_bf16_checkpoint_loads_in_bf16(tmp_path: Path) -> None:
    path = write_demo_model(tmp_path / "bf", arch="mixtral", dtype="bfloat16")
    cfg = ModelConfig.from_dir(path)
    assert cfg.torch_dtype == torch.bfloat16
    assert AttentionWeights.load(path, cfg).embed.dtype == torch.bfloat16
    assert ModelConfig.from_dir(path, dtype="float32").torch_dtype == torch.float32
