"""A step's metadata (`ModelRunner.prepare`), field by field, against what each chunk says it is: decode tokens of
sequences whose block tables differ in length, a prefill that scores its prompt, and a prefill cut part-way, which
samples nothing."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from attention_worker.forwarding import ForwardingEngine
from attention_worker.glue import TorchGlue
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import Chunk
from attention_worker.request import Sequence
from attention_worker.sim_runner import SimRunner
from fabric.model.config import ModelConfig


def _seq(rid: str, prompt: list[int], out: list[int] | None = None, scores: int = -1) -> Sequence:
    seq = Sequence(rid, prompt, list(out or []), 64, 0.0, 1.0, -1, 0, frozenset(), True)
    seq.prompt_logprobs = scores
    return seq


def test_a_steps_metadata_is_what_its_chunks_say(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    kv = KVCache(cfg, 4, 1 << 20)
    bs = kv.blocks.block_size
    runner = SimRunner(cfg, kv, cast(ForwardingEngine, None), 0.0, glue=TorchGlue(cfg.rms_norm_eps))
    long = _seq("long", list(range(3, 3 + 3 * bs)), [11, 12])  # decodes its last token; a table of 4 blocks
    short = _seq("short", [5, 6], [7])  # a table of 1
    scored = _seq("scored", [20, 21, 22, 23], scores=2)  # prefills whole and scores its prompt
    cut = _seq("cut", [30, 31, 32, 33, 34])  # prefills 3 of 5: nothing to sample yet
    for seq, done in ((long, long.num_tokens - 1), (short, short.num_tokens - 1), (scored, 0), (cut, 0)):
        assert kv.blocks.grow(seq.block_table, seq.num_tokens)
        seq.num_computed = done
    chunks = [Chunk(long, long.num_tokens - 1, 1), Chunk(scored, 0, 4), Chunk(short, short.num_tokens - 1, 1),
              Chunk(cut, 0, 3)]

    def slot(seq: Sequence, p: int) -> int:
        return seq.block_table[p // bs] * bs + p % bs

    tokens = [(c.seq, p) for c in chunks for p in range(c.start, c.start + c.n)]
    for attends in (False, True):
        runner.attends = attends
        m = runner.prepare(chunks)
        assert m.ids.tolist() == [s.token_at(p) for s, p in tokens]
        assert m.pos.tolist() == [p for _, p in tokens]
        assert m.slots.tolist() == [slot(s, p) for s, p in tokens]
        assert m.dec_rows.tolist() == [0, 5] and m.dec_lens.tolist() == [long.num_tokens, short.num_tokens]
        assert m.sample_rows.tolist() == [0, 4, 5]  # long's token, scored's last, short's; not cut's
        assert m.score_rows.tolist() == [1, 2, 3]  # scored's prompt positions 0..2, each scoring the next token
        assert not m.all_decode
        assert m.spans == [("long", long.num_tokens - 1, 1), ("scored", 0, 4), ("short", short.num_tokens - 1, 1),
                           ("cut", 0, 3)]
        assert all(t.dtype == torch.long for t in (m.ids, m.pos, m.slots, m.dec_rows, m.dec_lens, m.sample_rows,
                                                   m.score_rows, m.dec_tables))
        if not attends:  # the simulator reads no tables, masks or RoPE
            assert m.dec_tables.shape == (2, 0) and m.prefills == []
            continue
        widest = len(long.block_table)
        assert m.dec_tables.tolist() == [long.block_table, short.block_table + [-1] * (widest - len(short.block_table))]
        assert [(row, n) for row, n, _, _ in m.prefills] == [(1, 4), (6, 3)]
        for (_, n, kv_slots, mask), c in zip(m.prefills, (chunks[1], chunks[3])):
            assert kv_slots.tolist() == [slot(c.seq, p) for p in range(c.start + n)]
            assert torch.equal(mask, torch.arange(n)[None, :] <= torch.arange(n)[:, None])


def test_a_pure_decode_steps_metadata_says_so(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    kv = KVCache(cfg, 4, 1 << 20)
    runner = SimRunner(cfg, kv, cast(ForwardingEngine, None), 0.0, glue=TorchGlue(cfg.rms_norm_eps))
    seqs = [_seq(f"r{i}", [3 + i] * (i + 2), [9]) for i in range(3)]
    for seq in seqs:
        assert kv.blocks.grow(seq.block_table, seq.num_tokens)
        seq.num_computed = seq.num_tokens - 1
    m = runner.prepare([Chunk(s, s.num_tokens - 1, 1) for s in seqs])
    assert m.all_decode and m.dec_rows.tolist() == m.sample_rows.tolist() == [0, 1, 2]
    assert m.ids.tolist() == [9, 9, 9] and m.pos.tolist() == [s.num_tokens - 1 for s in seqs]
    assert m.score_rows.numel() == 0
