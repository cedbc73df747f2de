"""A step's tokens from its logits: each sampling chunk's token (masked by its grammar), its logprobs and the prompt
scores its chunk asked for, appended to its sequence.

Nothing here knows the engine: what goes to which gateway, which requests finished and which failed come back to
it (`StepTokens`), and it sends, frees and counts (attention_worker/engine.py). A request's scores go to its gateway
here, as they are taken, so that they reach it ahead of its token (the engine sends the tokens after).

Legend: S sampling chunks, R scored prompt rows, V vocabulary, W = ceil(V / 32) words of a grammar's mask.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from attention_worker.model_runner import Chunk
from attention_worker.request import Sequence
from attention_worker.sampler import greedy_rows, is_greedy, sample, score_tokens, token_logprobs
from fabric import grammar
from fabric.errors import PeerDeadError
from fabric.messages.client import PromptLogprobs, TokenOut
from fabric.transport.base import Connection

log = logging.getLogger("attention_worker")


@dataclass
class StepTokens:
    rows: int = 0  # sampling chunks, failed ones included
    per_client: dict[Connection, list[TokenOut]] = field(default_factory=lambda: defaultdict(list))
    finished: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # (request, why its sampling failed)


def score_chunks(chunks: list[Chunk], scored: torch.Tensor) -> None:
    """Prompt scores of the chunks that asked for them. `scored` [R, V] holds their rows in order."""
    row = 0
    for c in chunks:
        positions = c.seq.scores(c.start, c.n)
        if not positions:
            continue
        seq, n = c.seq, len(positions)
        targets = torch.tensor(seq.prompt_ids[positions.start + 1 : positions.stop + 1], dtype=torch.long)
        seq.add_scores(c.start, score_tokens(scored[row : row + n], targets, seq.prompt_logprobs))
        row += n


def sample_step(chunks: list[Chunk], logits: torch.Tensor, masks: torch.Tensor | None = None) -> StepTokens:
    """Advances every chunk's sequence over the tokens it computed and samples each sampling chunk's next token from
    its row of `logits` [S, V] (masked by its grammar's row of `masks` [S, W]). The argmax of every sampled row is one
    op: greedy requests are most of a decode batch. A request whose sampling raises is given back as failed (its own
    fault: the step goes on)."""
    out = StepTokens()
    greedy = greedy_rows(logits) if any(c.samples and is_greedy(c.seq.temperature, c.seq.top_k)
                                        for c in chunks) else []
    for c in chunks:
        seq = c.seq
        seq.num_computed += c.n
        if not c.samples:
            continue
        out.rows += 1
        row = out.rows - 1
        try:
            if greedy and seq.matcher is None and seq.logprobs < 0 and is_greedy(seq.temperature, seq.top_k):
                token, logprob, top = greedy[row], None, None  # (no row taken out: ~1 µs a row, cold 2-3)
            else:
                row_logits = logits[row]  # [V]
                if seq.matcher is not None and masks is not None:
                    grammar.apply(row_logits, masks[row])  # (logprobs report the masked distribution)
                token = sample(row_logits, seq.temperature, seq.top_p, seq.top_k, seq.seed,
                               len(seq.output_ids), greedy[row] if greedy and seq.matcher is None else None)
                logprob, top = token_logprobs(row_logits, token, seq.logprobs)
        except Exception as exc:
            log.exception("%s: sampling failed; failing this request", seq.request_id)
            out.failed.append((seq, f"sampling failed: {exc}"))
            continue
        scores = seq.take_scores()
        if scores is not None and seq.client is not None:
            try:
                seq.client.send_nowait(PromptLogprobs(seq.request_id, scores))
            except PeerDeadError:
                pass
        reason = seq.append(token)
        token_out = TokenOut(seq.request_id, token, reason, logprob, top)
        seq.outputs.append(token_out)
        if seq.client is not None:
            out.per_client[seq.client].append(token_out)
        if reason is not None:
            out.finished.append(seq)
    return out
