"""Greedy tokens of the multi-process fabric equal transformers' `generate` on the same weights.

2 AWs + 3 EWs, many concurrent requests (streaming and not), a small step token budget so long
prompts are prefilled in chunks mixed with other requests' decodes; over tcp and ucx; and a qwen3_moe whose middle
layer is a dense MLP, run on the AW; and one request at a time on a model whose logits' product an AW shares with
its second core's helper thread.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import running_fabric
from tests.helpers import post_json, stream_completion, wait_for, write_hf_model

TIE = 1e-4


def reference(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, n in zip(prompts, lengths):
        with torch.no_grad():
            g = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out.append((g.sequences[0, len(prompt):].tolist(), torch.stack(g.logits)[:, 0, :]))
    return out


def assert_matches(got: list[int], want: list[int], logits: torch.Tensor, label: str) -> None:
    """Equal, or first differing where the reference's top-2 logits are within TIE (a near-tie)."""
    assert len(got) == len(want), f"{label}: {len(got)} tokens, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = torch.topk(logits[i], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"{label}: token {i} is {a}, transformers gives {b} (top-2 gap {gap:.2e})"
            return


def run_requests(base: str, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    def one(i: int) -> list[int]:
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if i % 2:
            events = stream_completion(f"{base}/v1/completions", body)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            return [t for e in events for t in e["choices"][0]["token_ids"]]
        status, resp = post_json(f"{base}/v1/completions", body)
        assert status == 200, resp
        return resp["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.mark.parametrize(("arch", "transport"), [("mixtral", "tcp"), ("mixtral", "ucx"), ("qwen3_moe", "tcp"),
                                                  ("qwen3_moe", "ucx"), ("qwen3_moe_dense", "tcp")])
def test_greedy_parity(arch: str, transport: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="the [ucx] extra is part of the test install")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice([3, 9, 17, 40, 70]))] for _ in range(16)]
    lengths = [rng.randrange(8, 20) for _ in prompts]
    model = hf_models[arch]
    expected = reference(model, prompts, lengths)
    extra = {"attention-worker": ["--max-batch-tokens", "24"]}
    with running_fabric(model, tmp_path, transport=transport, aws=2, ews=3, extra=extra) as fabric:
        base = f"http://127.0.0.1:{fabric.port}"
        got = run_requests(base, prompts, lengths)
        cluster = fabric.cluster()
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(tokens, want, logits, f"{arch}/{transport} request {i}")
    aws = [w for w in cluster["workers"] if w["role"] == "attention"]
    ews = [w for w in cluster["workers"] if w["role"] == "expert"]
    assert len(aws) == 2 and len(ews) == 3 and all(w["state"] == "alive" for w in aws + ews)
    assert all(w["info"]["transport"] == transport for w in aws + ews)
    # every expert has one primary, EWs balanced by count, and one shadow on another EW (the default)
    n = 6 * (2 if arch == "qwen3_moe_dense" else 3)  # 6 experts in each MoE layer (the dense one has none)
    replicas = cluster["routing"]["replicas"]
    assert len(replicas) == n and all(len(set(ews)) == len(ews) == 2 for _, _, ews in replicas)
    assert {layer for layer, _, _ in replicas} == ({0, 2} if arch == "qwen3_moe_dense" else {0, 1, 2})
    primaries = sorted(sum(1 for _, _, r in replicas if r[0] == w["id"]) for w in ews)
    assert sum(primaries) == n and primaries[-1] - primaries[0] <= 1
    assert sorted(len(w["experts"]) for w in ews) == [2 * n // 3] * 3  # primaries and shadows both loaded


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an AW starts its second core only where it may use two CPUs")
def test_greedy_parity_with_the_logits_shared_over_two_cores(tmp_path: Path) -> None:
    """One request at a time (one row a step) on a Mixtral with a vocabulary of 8192, so that its lm_head (64 x 8192,
    2 MiB in 128 blocks) is past the threshold at which an AW shares a product of one to four rows with its helper
    thread (fabric/kernels/second_core.h): the greedy tokens are still transformers'. Whether the helper found a CPU
    for some of the blocks depends on the machine's load; each AW's stats say how many it computed."""
    model = write_hf_model(tmp_path / "wide-vocab", "mixtral", vocab_size=8192)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 8192) for _ in range(rng.choice([3, 9, 17]))] for _ in range(6)]
    lengths = [rng.randrange(8, 16) for _ in prompts]
    expected = reference(model, prompts, lengths)
    with running_fabric(model, tmp_path, aws=2, ews=2) as fabric:
        base = f"http://127.0.0.1:{fabric.port}"
        got = [run_requests(base, [prompt], [n])[0] for prompt, n in zip(prompts, lengths, strict=True)]
        # (An AW that was still warming up while the other served reports its stats later.)
        cluster = wait_for(fabric, "every AW's stats, and shared products", lambda c: all(
            isinstance(s, list) for s in second_cores(c)) and sum(s[0] for s in second_cores(c)) > 0)
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected, strict=True)):
        assert_matches(tokens, want, logits, f"wide vocabulary, request {i}")
    print(f"products shared, blocks the helper computed, by AW: {second_cores(cluster)}")


def second_cores(cluster: dict[str, Any]) -> list[Any]:
    """Each AW's `second_core` stats ([products shared, blocks the helper computed]), None before it reports them."""
    return [w.get("stats", {}).get("second_core") for w in cluster["workers"] if w["role"] == "attention"]
