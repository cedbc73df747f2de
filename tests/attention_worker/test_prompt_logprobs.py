"""Scoring a prompt over the fabric, as lm-eval and vLLM's clients ask for it: `echo` with
`logprobs` (the prompt tokens' logprobs, the first null), `max_tokens: 0` (pure scoring) and vLLM's
`prompt_logprobs`, for a batch of prompts, streamed and not, with prefills split into chunks over
several steps. Every number equals transformers' log-softmax on the same weights (fp32, 1e-4):
the prefill that computes them runs through the expert workers like any other."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attention_worker.request import Sequence
from fabric.errors import ProtocolError
from fabric.messages.base import decode_message, encode_message
from fabric.messages.client import PromptLogprobs, PromptScores, Submit
from fabric.wire import decode_bytes, encode_bytes
from tests.conftest import running_fabric
from tests.helpers import post_json, stream_completion

TOL = 1e-4


def reference(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, transformers' log-softmax over the vocabulary at every position [P, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def token_id(text: str) -> int:
    """A token's text from a model without a tokenizer is `<id>`."""
    assert text.startswith("<") and text.endswith(">"), text
    return int(text[1:-1])


def check_echoed(prompt: list[int], ref: torch.Tensor, lp: dict[str, Any], k: int, label: str) -> None:
    """`lp` (an OpenAI logprobs block) starts with the prompt: its tokens, their logprobs (the
    first null) and top k, each equal to the reference."""
    n = len(prompt)
    assert [token_id(t) for t in lp["tokens"][:n]] == prompt, label
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, label
    if "text_offset" in lp:  # (whole responses): where each token starts in the text
        assert lp["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in lp["tokens"][:-1]])), label
    for i in range(1, n):
        want = float(ref[i - 1, prompt[i]])
        assert abs(lp["token_logprobs"][i] - want) < TOL, f"{label}: prompt token {i}: {lp['token_logprobs'][i]} != {want}"
        top = lp["top_logprobs"][i]
        want_top = torch.topk(ref[i - 1], k).values.tolist()
        assert len(top) == k and all(abs(a - b) < TOL for a, b in zip(sorted(top.values(), reverse=True), want_top)), label
        for text, value in top.items():
            assert abs(value - float(ref[i - 1, token_id(text)])) < TOL, label


def check_vllm_field(prompt: list[int], ref: torch.Tensor, field: list[Any], k: int, label: str) -> None:
    """vLLM's `prompt_logprobs`: null, then per token {id: {logprob, rank, decoded_token}}, the
    token itself and the top k."""
    assert len(field) == len(prompt) and field[0] is None, label
    for i in range(1, len(prompt)):
        row, t = ref[i - 1], prompt[i]
        entry = field[i][str(t)]
        assert abs(entry["logprob"] - float(row[t])) < TOL, label
        near = int(((row - row[t]).abs() < TOL).sum())  # (tokens whose order a rounding could swap)
        assert abs(entry["rank"] - (1 + int((row > row[t]).sum()))) < near, label
        assert entry["decoded_token"] == f"<{t}>"
        ranked = {int(tok): e for tok, e in field[i].items() if e["rank"] <= k}
        assert len(ranked) >= k and all(abs(e["logprob"] - float(row[tok])) < TOL for tok, e in ranked.items()), label


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_prompt_logprobs_equal_transformers(arch: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 2, 7, 30, 61)]
    model = hf_models[arch]
    ref = reference(model, prompts)
    # A 16-token step budget: the longer prompts are prefilled (and scored) over several steps.
    with running_fabric(model, tmp_path, aws=2, ews=3, extra={"attention-worker": ["--max-batch-tokens", "16"]}) as f:
        url = f"http://127.0.0.1:{f.port}/v1/completions"
        # Pure scoring, a batch, not streamed.
        status, whole = post_json(url, {"prompt": prompts, "echo": True, "logprobs": 3, "max_tokens": 0,
                                        "temperature": 0})
        # lm-eval's request (echo, logprobs 1, max_tokens 1) plus vLLM's prompt_logprobs, streamed, n = 2.
        events = stream_completion(url, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 2, "n": 2,
                                         "prompt_logprobs": 2, "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True})
        bad_status, bad = post_json(url, {"prompt": prompts[0], "max_tokens": 0})
    assert status == 200, whole
    assert [c["index"] for c in whole["choices"]] == list(range(len(prompts)))
    assert whole["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                              "total_tokens": sum(map(len, prompts))}
    for c, prompt, r in zip(whole["choices"], prompts, ref):
        label = f"{arch} whole, prompt of {len(prompt)}"
        assert c["finish_reason"] == "length" and c["text"] == "".join(f"<{t}>" for t in prompt), label
        assert len(c["logprobs"]["tokens"]) == len(prompt), label  # the prompt only
        check_echoed(prompt, r, c["logprobs"], 3, label)

    firsts: dict[int, dict[str, Any]] = {}
    logprobs: dict[int, list[float | None]] = {}
    tokens: dict[int, list[int]] = {}
    for ev in events:
        for c in ev["choices"]:
            firsts.setdefault(c["index"], c)
            logprobs.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
            tokens.setdefault(c["index"], []).extend(c["token_ids"])
            assert "prompt_logprobs" not in c or c is firsts[c["index"]], "prompt logprobs come once, first"
    assert sorted(firsts) == list(range(2 * len(prompts)))
    for index, first in firsts.items():
        prompt, r = prompts[index // 2], ref[index // 2]
        label = f"{arch} stream, choice {index}, prompt of {len(prompt)}"
        check_echoed(prompt, r, first["logprobs"], 1, label)
        check_vllm_field(prompt, r, first["prompt_logprobs"], 2, label)
        assert first["text"].startswith("".join(f"<{t}>" for t in prompt)), label
        assert len(logprobs[index]) == len(prompt) + 2 and len(tokens[index]) == 2, label
        assert abs(logprobs[index][len(prompt)] - float(r[-1].max())) < TOL, label  # the greedy first token
        assert tokens[index][0] == int(r[-1].argmax()) or float(r[-1].topk(2).values.diff().abs()) < TOL, label
    assert bad_status == 400 and bad["error"]["param"] == "max_tokens"


def scores(n: int, k: int = 2) -> PromptScores:
    return PromptScores(np.full((n,), -1.5, np.float32), np.ones(n, np.int64), np.zeros((n, k), np.int64),
                        np.zeros((n, k), np.float32))


def test_only_a_fresh_requests_first_prefill_scores_its_prompt() -> None:
    sub = Submit(request_id="r", prompt_ids=[5, 6, 7, 8, 9], max_tokens=4, temperature=0.0, top_p=1.0, top_k=-1, seed=0, stop_token_ids=[], ignore_eos=True, output_ids=[], prompt_logprobs=2)
    seq = Sequence.from_submit(sub, None)
    assert list(seq.scores(0, 3)) == [0, 1, 2] and list(seq.scores(3, 2)) == [3]  # the last row samples
    seq.add_scores(0, scores(3))
    seq.add_scores(0, scores(3))  # preempted and prefilled again: starts over
    seq.add_scores(3, scores(1))
    joined = seq.take_scores()
    assert joined is not None and joined.logprobs.shape == (4,) and joined.top_ids.shape == (4, 2)
    assert seq.take_scores() is None  # sent once; kept for an Attach
    assert seq.prompt_scores is joined
    resumed = Sequence.from_submit(dataclasses.replace(sub, output_ids=[3]), None)  # its gateway has them
    assert not resumed.scores(0, 6) and resumed.take_scores() is None
    one = Sequence.from_submit(dataclasses.replace(sub, prompt_ids=[5]), None)
    empty = one.take_scores()
    assert empty is not None and empty.logprobs.shape == (0,) and empty.top_ids.shape == (0, 2)
    plain = Sequence.from_submit(dataclasses.replace(sub, prompt_logprobs=-1), None)
    assert not plain.scores(0, 5) and plain.take_scores() is None


def test_prompt_scores_on_the_wire() -> None:
    msg = PromptLogprobs("r", scores(6, 3))
    header, frames = encode_message(msg)
    out = decode_message(*decode_bytes(encode_bytes(header, frames)))
    assert isinstance(out, PromptLogprobs) and np.array_equal(out.scores.top_ids, msg.scores.top_ids)
    header["scores"]["top_logprobs"] = header["scores"]["logprobs"]  # well-formed tensors, wrong shapes: refused
    with pytest.raises(ProtocolError, match="prompt scores"):
        decode_message(*decode_bytes(encode_bytes(header, frames)))
