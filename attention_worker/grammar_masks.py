"""A step's grammar masks, filled in a thread while the step's forward pass runs.

Constrained requests (fabric/grammar.py) need, before sampling, the tokens their grammar allows
next. That depends only on the tokens they have, known when the step starts, so the masks are
filled while the AW waits for the experts (as vLLM fills them beside the model's forward), and
sampling only applies them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from attention_worker.model_runner import Chunk
from fabric import grammar


class GrammarMasks:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # (started with the first constrained request)

    def start(self, chunks: list[Chunk]) -> Future[torch.Tensor] | None:
        """Starts filling the masks of the step's sampled rows, in sampling order; None if none is
        constrained. The matchers stay still until the result is taken (`sample_step` advances them,
        attention_worker/step_tokens.py)."""
        sampled = [c.seq for c in chunks if c.samples]
        rows = [(i, s.matcher) for i, s in enumerate(sampled) if s.matcher is not None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self._fill, rows, len(sampled))

    def _fill(self, rows: list[tuple[int, grammar.Matcher]], n: int) -> torch.Tensor:
        bits = grammar.bitmask(n, self.vocab_size)  # [n, ceil(V / 32)]
        for i, m in rows:
            m.fill(bits, i)
        return bits
