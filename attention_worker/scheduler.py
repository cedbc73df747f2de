"""Continuous batching.

Every step mixes decodes (1 token each) and prefill chunks under a token budget. This is
FailSafe's token-budget chunked prefill. Running sequences go first, oldest first. A sequence
that cannot get a KV block preempts the newest running one, which later re-prefills (recompute).
Deterministic sampling makes that invisible to its client.
"""

from __future__ import annotations

from collections import deque

from attention_worker.kv_cache import BlockManager
from attention_worker.model_runner import Chunk
from attention_worker.request import Sequence, Status
from fabric import cpu_regions
from fabric.errors import RequestError


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_running: int) -> None:
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.by_id:
            raise RequestError(f"request {seq.request_id} is already running here")
        need = self.blocks.blocks_needed([], seq.num_tokens + seq.max_tokens - len(seq.output_ids))
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"request needs {need} KV blocks, more than this worker's {self.blocks.num_blocks}"
            )
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Drops a request (finished or aborted) and frees its KV blocks at once."""
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        seq.status = Status.FINISHED
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[Chunk]:
        c0 = cpu_regions.start()
        chunks = self._schedule()
        cpu_regions.add("step: schedule", c0)
        return chunks

    def _schedule(self) -> list[Chunk]:
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = seq.chunk_limit(min(seq.num_tokens - seq.num_computed, budget))
            while not self.blocks.grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = seq.chunk_limit(min(seq.num_tokens - seq.num_computed, budget))
            if not self.blocks.grow(seq.block_table, seq.num_computed + n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def outstanding_work(self) -> int:
        return sum(s.remaining_work for s in self.by_id.values())


