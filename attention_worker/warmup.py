"""The AW's cold paths, run before it registers, inline as its steps run.

A worker says it is ready only once its first real step will be warm. A cold first step pays for
lazy initialisation: CUDA context and cuBLAS handles, lazily loaded kernels, Triton's JIT, oneDNN
primitives and OpenMP's threads. On a GPU that took seconds. Here it is paid at start-up. Steps of
each shape class the kernels treat apart run with experts that add nothing, so no EW is needed.
They run on blocks of the AW's own KV cache, which nothing uses yet. A request writes every
position it reads, so what the warm-up leaves there is never read.

The shapes are a prefill chunk beside a decode (the mixed path), and decode steps whose block
tables are 1, 3 and 16 blocks wide. Triton specialises an integer argument equal to 1 or divisible
by 16, so those three classes cover every table width. The batch size only sizes the launch grid.
Sampling runs on each step's logits, greedy and seeded.
"""

from __future__ import annotations

from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence
from attention_worker.sampler import sample, token_logprobs

PREFILL_TOKENS = 17
DECODE_BATCHES = ((1, 1), (2, 3), (1, 16))  # (sequences, blocks in each one's table)


def _sequence(i: int, n: int, vocab: int) -> Sequence:
    prompt = [(7 * i + 3 * j + 1) % vocab for j in range(n)]
    return Sequence(f"warm-up-{i}", prompt, [], 1, 0.8, 0.9, 50, i, frozenset(), True)


def warm_up(runner: ModelRunner) -> int:
    """Runs the warm-up steps and returns how many.

    It blocks, as compute does. The control loop answers meanwhile.
    """
    blocks = runner.kv.blocks
    s, vocab = blocks.block_size, runner.cfg.vocab_size
    widest = min(16, blocks.num_blocks, runner.cfg.max_position // s)
    table = list(range(widest))  # blocks nothing uses yet; every sequence may share them
    steps: list[list[Chunk]] = []
    if widest >= 2:
        prefill = _sequence(0, min(PREFILL_TOKENS, widest * s - 1), vocab)
        decode = _sequence(1, s + 2, vocab)
        decode.num_computed = decode.num_tokens - 1
        steps.append([Chunk(prefill, 0, prefill.num_tokens), Chunk(decode, decode.num_computed, 1)])
    for n, width in DECODE_BATCHES:
        width = min(width, widest)
        if width < 1:
            continue
        seqs = [_sequence(i, width * s - i % s, vocab) for i in range(n)]
        for q in seqs:
            q.num_computed = q.num_tokens - 1
        steps.append([Chunk(q, q.num_computed, 1) for q in seqs])
    for chunks in steps:
        for c in chunks:
            c.seq.block_table = table[:-(-c.seq.num_tokens // s)]
        logits, _ = runner.forward_local(chunks)
        for row, c in enumerate(c for c in chunks if c.samples):
            token = sample(logits[row], c.seq.temperature if row % 2 else 0.0, c.seq.top_p, c.seq.top_k, c.seq.seed, 0)
            token_logprobs(logits[row], token, 5)
    return len(steps)

