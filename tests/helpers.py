"""Small factories and clients shared by tests (no sockets in the factories)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fabric.launcher import free_port

__all__ = ["free_port"]


def write_hf_model(out: Path, arch: str, seed: int = 0) -> Path:
    """A small random checkpoint written by transformers itself. initializer_range is raised so
    logits are peaked enough that greedy choices are rarely near-ties."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    if arch == "mixtral":
        model: Any = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=6, **common))
    else:
        cfg = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=6, head_dim=16,
                             norm_topk_prob=True, **common)
        model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(out)
    return out


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_json(url: str, timeout: float = 10) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def iter_stream(url: str, body: dict[str, Any], timeout: float = 120) -> Iterator[dict[str, Any]]:
    """Raw SSE client yielding each decoded `data:` event as it arrives; asserts the stream ends
    with [DONE]."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    done = False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            yield json.loads(payload)
    assert done, "stream ended without [DONE]"


def stream_completion(url: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    return list(iter_stream(url, body, timeout))
