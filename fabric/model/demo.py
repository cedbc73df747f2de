"""Deterministic random-weight Mixture-of-Experts checkpoints for tests, demos and benchmarks.

The fabric has to be exercised end to end (tokenizer, chat template, sharded safetensors, expert routing)
without downloading gigabytes of real weights. Tests need the *same bytes* on every machine, so that golden
outputs stay comparable. Files are written by hand in the layout transformers reads. So this module needs torch,
safetensors and tokenizers but never imports transformers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "write_demo_model"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2: padding / end of text, ChatML turn start, ChatML turn end (the stop token)."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ARCHS = ("mixtral", "qwen3_moe")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_STD = 0.02

# Our own prose, so the tokenizer learns ordinary English merges without any downloaded data.
_CORPUS = """\
Serving a language model is mostly a problem of moving numbers to the right place at the right
time. A request arrives as text, the tokenizer turns it into integers, and the model spends the
rest of its life multiplying those integers' embeddings by large matrices. The first pass over
the prompt, called prefill, is heavy and parallel; every later step, called decode, produces a
single token and is limited by how fast weights and cached keys can be read from memory.
A mixture of experts changes the shape of that work. Each layer holds several feed-forward
networks, the experts, and a small router picks two of them for every token. Only a fraction of
the parameters is touched per token, so a model with many billions of weights can answer about
as quickly as a much smaller dense one. The price is traffic: tokens must be sent to whichever
machine owns the chosen experts, and the answers must come back before the next layer can start.
Batching hides much of that cost. When dozens of conversations decode together, the experts see
full matrices instead of thin vectors, and the network carries fewer, larger messages. A good
scheduler keeps the batch full, admits new requests between steps, evicts finished ones at
once, and never lets one long prompt starve everybody else who is waiting for a short reply.
Memory is the other budget. The key and value cache grows with every generated token, so the
server pages it in fixed blocks, shares common prefixes such as a system prompt, and refuses
work politely when no blocks are left rather than crashing halfway through an answer.
Failures are normal at scale. A worker may restart, a link may drop, a disk may fill up. The
orchestrator therefore tracks which experts live where, replays the tokens that were in flight,
and reroutes traffic to a replica, while clients only notice a slightly slower response.
Finally, everything should be measured. Time to first token, tokens per second per user,
throughput per machine, and tail latency under load tell different stories, and a change that
improves one of them often hurts another. Honest benchmarks use fixed seeds, warm caches, and
the same prompts every run, so that a regression shows up as a number instead of a feeling.
Quick tests matter too: tiny random models let developers check routing, streaming, stop words,
chat templates, and unicode handling in seconds, long before a real checkpoint is downloaded.
Streaming changes how an answer feels. Instead of waiting for the whole reply, the gateway
forwards each decoded piece as soon as it is ready, taking care never to split a multibyte
character such as an accented vowel, a Chinese word, or an emoji across two network frames.
Stop sequences, length limits, temperature, and nucleus sampling are applied per request, even
though the requests share one batch; a deterministic mode with greedy decoding makes outputs
reproducible, which is exactly what regression suites and careful operators want to see.
Configuration deserves the same care as code. Ports, shard sizes, expert placement, timeouts,
and retry budgets should be validated at start-up with clear error messages, because a typo
discovered at midnight under production load is far more expensive than one rejected early.
Security is part of serving as well: authenticate callers, cap request sizes, log without
leaking private prompts, and keep weights readable only by the processes that need them.
"""


@dataclass(frozen=True)
class _Size:
    """Shape of one preset; `tok_vocab` is the BPE target, `shard_bytes` the default shard cap."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_inter: int  # per-expert FFN width
    vocab: int  # minimum; raised to the tokenizer size rounded up to 64
    max_pos: int
    tok_vocab: int
    shard_bytes: int | None


_SIZES = {
    "tiny": _Size(2, 64, 4, 2, 4, 2, 128, 1024, 2048, 1000, None),
    "bench": _Size(8, 512, 8, 4, 8, 2, 1024, 8192, 4096, 4000, 100_000_000),
}


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE: every UTF-8 string (emoji, CJK) round-trips, none maps to unk."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # The prose alone supports ~1.2k merges. Upper/title-cased copies and space-less word forms roughly double
    # that, letting the bench tokenizer grow past a toy vocabulary.
    variants = [_CORPUS, _CORPUS.upper(), _CORPUS.title(), "\n".join(_CORPUS.split())]
    tok.train_from_iterator(variants, trainer)
    return tok


def _config(arch: str, s: _Size, vocab: int, dtype: str) -> dict[str, Any]:
    """config.json with the keys transformers itself writes for `arch` (minus its version)."""
    cfg: dict[str, Any] = {
        "attention_dropout": 0.0, "dtype": dtype, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": s.hidden, "initializer_range": _STD, "max_position_embeddings": s.max_pos,
        "model_type": arch, "num_attention_heads": s.heads, "num_experts_per_tok": s.top_k,
        "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads,
        "output_router_logits": False, "pad_token_id": 0, "router_aux_loss_coef": 0.001,
        "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": vocab,
    }
    if arch == "mixtral":
        cfg.update(architectures=["MixtralForCausalLM"], bos_token_id=1, head_dim=None,
                   intermediate_size=s.expert_inter, num_local_experts=s.experts,
                   rms_norm_eps=1e-5, router_jitter_noise=0.0)
    else:
        # qwen3_moe. intermediate_size only sizes dense layers, and mlp_only_layers is empty.
        cfg.update(architectures=["Qwen3MoeForCausalLM"], attention_bias=False, bos_token_id=None,
                   decoder_sparse_step=1, head_dim=s.hidden // s.heads,
                   intermediate_size=4 * s.hidden, mlp_only_layers=[],
                   moe_intermediate_size=s.expert_inter, norm_topk_prob=True,
                   num_experts=s.experts, rms_norm_eps=1e-6, use_sliding_window=False)
    return cfg


def _weight_specs(arch: str, s: _Size, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """All tensor names and shapes in generation order.

    They are the 4.x per-expert names. transformers 5 still converts them on load, and per-expert serving
    workers can slice them without unfusing."""
    h, i, hd = s.hidden, s.expert_inter, s.hidden // s.heads
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    moe, names = (("block_sparse_moe", ("w1", "w2", "w3")) if arch == "mixtral"
                  else ("mlp", ("gate_proj", "down_proj", "up_proj")))
    for n in range(s.layers):
        p = f"model.layers.{n}"
        specs += [(f"{p}.input_layernorm.weight", (h,)),
                  (f"{p}.self_attn.q_proj.weight", (s.heads * hd, h)),
                  (f"{p}.self_attn.k_proj.weight", (s.kv_heads * hd, h)),
                  (f"{p}.self_attn.v_proj.weight", (s.kv_heads * hd, h)),
                  (f"{p}.self_attn.o_proj.weight", (h, s.heads * hd))]
        if arch == "qwen3_moe":
            specs += [(f"{p}.self_attn.{q}_norm.weight", (hd,)) for q in "qk"]
        specs += [(f"{p}.post_attention_layernorm.weight", (h,)),
                  (f"{p}.{moe}.gate.weight", (s.experts, h))]
        for j in range(s.experts):  # names = (gate, down, up) projections
            e = f"{p}.{moe}.experts.{j}"
            specs += [(f"{e}.{names[0]}.weight", (i, h)), (f"{e}.{names[1]}.weight", (h, i)),
                      (f"{e}.{names[2]}.weight", (i, h))]
    return [*specs, ("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _draw(gen: torch.Generator, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Approximately normal values (std 0.02) that are bit-identical on every CPU.

    torch.randn uses vectorised log/cos whose last bits differ between AVX2 and scalar builds. So we sum four
    uniforms instead (Irwin-Hall). torch.rand's bits come straight from the seeded Mersenne Twister, and the
    remaining ops are plain IEEE adds and multiplies. Norms get 1 + noise.
    """
    u = torch.rand((4, *shape), generator=gen, dtype=torch.float32)
    x = (u[0] + u[1] + u[2] + u[3] - 2.0) * (_STD * math.sqrt(3.0))
    return x + 1.0 if name.endswith("norm.weight") else x


def _write_weights(out: Path, specs: list[tuple[str, tuple[int, ...]]], seed: int,
                   dtype: torch.dtype, shard_bytes: int | None) -> None:
    """Write one file or contiguous shards.

    The draw order never depends on the sharding, so sharded and unsharded checkpoints hold identical tensors.
    Only one shard is held in memory."""
    item = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * item
        if shard_bytes is not None and shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else (
            f"model-{k:05d}-of-{len(shards):05d}.safetensors")
        tensors = {n: _draw(gen, n, shape).to(dtype).contiguous() for n, shape in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if len(shards) > 1:
        total = sum(math.prod(shape) for _, shape in specs) * item
        _dump(out / "model.safetensors.index.json",
              {"metadata": {"total_size": total}, "weight_map": weight_map})


def _dump(path: Path, obj: dict[str, Any]) -> None:
    """JSON the way transformers writes it (sorted keys, indent 2, trailing newline)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _write_tokenizer(out: Path, tok: Tokenizer, bos: str | None, max_pos: int) -> None:
    """tokenizer.json plus the config files AutoTokenizer and chat templating look for."""
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    _dump(out / "tokenizer_config.json", {
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": bos,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[2], "model_max_length": max_pos,
        "pad_token": SPECIAL_TOKENS[0], "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })
    _dump(out / "special_tokens_map.json", {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]), "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0], **({"bos_token": bos} if bos is not None else {})})


def write_demo_model(out_dir: str | Path, arch: str = "mixtral", seed: int = 0,
                     size: str = "tiny", dtype: str = "float32",
                     shard_bytes: int | None = None) -> Path:
    """Write a random-weight HF checkpoint of a `mixtral` or `qwen3_moe` MoE model to `out_dir`.

    Same arguments give byte-identical files on any machine. `size` is "tiny" (2 layers, seconds
    to write) or "bench" (~115M parameters, ~100 MB shards by default). Everything is built in a
    hidden sibling directory and renamed into place last, so a crash never leaves a directory
    that looks like a complete model. An existing non-empty `out_dir` is never overwritten.
    """
    for what, value, known in (("arch", arch, _ARCHS), ("size", size, tuple(_SIZES)),
                               ("dtype", dtype, tuple(_DTYPES))):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(known)}")
    if shard_bytes is not None and shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a model" if (out / "config.json").exists() else "other files"
        raise FileExistsError(f"{out} already exists and holds {what}; refusing to overwrite")
    s = _SIZES[size]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tok = _train_tokenizer(min(s.tok_vocab, s.vocab))
        vocab = max(s.vocab, -(-tok.get_vocab_size() // 64) * 64)
        cfg = _config(arch, s, vocab, dtype)
        _write_weights(tmp, _weight_specs(arch, s, vocab), seed, _DTYPES[dtype],
                       shard_bytes if shard_bytes is not None else s.shard_bytes)
        bos = SPECIAL_TOKENS[1] if arch == "mixtral" else None
        _write_tokenizer(tmp, tok, bos, s.max_pos)
        _dump(tmp / "generation_config.json", {
            "bos_token_id": cfg["bos_token_id"], "do_sample": False,
            "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]})
        _dump(tmp / "config.json", cfg)
        # mkdtemp (0700) and safetensors (0600) create private files; models are shared read-only.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            # Verified empty above. rename cannot replace a directory portably.
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
