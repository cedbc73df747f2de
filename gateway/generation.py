"""One choice of one request: submit to an AW, turn its tokens into text deltas (incremental
detokenisation, stop strings held back), and keep timing for the metrics."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import PeerDeadError
from fabric.messages.client import Submit
from gateway.aw_pool import AwClient, AwPool, Pending
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.protocol import ApiError, GenParams
from gateway.stop_strings import StopMatcher

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """What a choice produced since the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[list[float]] | None]]  # (token, logprob, top)
    finish_reason: str | None = None


@dataclass
class Choice:
    index: int
    request_id: str
    submit: Submit
    client: AwClient | None = None
    pending: Pending | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    resumes: int = 0


class GenerationError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


MAX_RESUMES = 3


async def start_choice(pool: AwPool, choice: Choice) -> None:
    try:
        choice.client, choice.pending = await pool.submit(choice.submit)
    except PeerDeadError as exc:
        raise ApiError(503, f"no attention worker available: {exc}", type_="service_unavailable",
                       headers={"Retry-After": "1"}) from exc


async def run_choice(pool: AwPool, choice: Choice, params: GenParams, tokenizer: Any, metrics: Metrics,
                     arrived: float) -> AsyncIterator[Delta]:
    """Yields deltas until the choice finishes; raises GenerationError if the fabric fails it."""
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    stop = StopMatcher(list(params.stop)) if detok is not None else StopMatcher([])
    pending = choice.pending
    assert pending is not None, "start_choice first"
    last = None
    metrics.enter_waiting()
    waiting = True
    try:
        while True:
            ev = await pending.queue.get()
            now = time.monotonic()
            if waiting:
                metrics.leave_waiting(running=True)
                waiting = False
                if ev.error is None:
                    metrics.ttft.observe(now - arrived)
            if ev.error is not None and ev.retryable and choice.resumes < MAX_RESUMES:
                # The AW died: resume on a healthy one by re-prefilling the prompt plus the tokens
                # already emitted (the paper's parallel replay). Sampling depends only on (seed,
                # token index), so the stream continues with exactly the next token.
                choice.resumes += 1
                dead = choice.client.worker_id if choice.client is not None else ""
                choice.submit = dataclasses.replace(
                    choice.submit, output_ids=list(choice.token_ids),
                    restore_from=dead if pool.resume == "restore" else "",
                    replay_chunk=1 if pool.resume == "sequential" else 0)
                log.warning("%s: %s; resuming after %d tokens", choice.request_id, ev.error, len(choice.token_ids))
                try:
                    await start_choice(pool, choice)
                except ApiError as exc:
                    raise GenerationError(exc.message, exc.status) from exc
                assert choice.pending is not None
                pending = choice.pending
                continue
            if ev.error is not None:
                raise GenerationError(ev.error, ev.status or 500)
            if last is not None:
                metrics.tbt.observe(now - last)
            last = now
            assert ev.token is not None
            choice.token_ids.append(ev.token)
            metrics.generated.inc()
            text = detok.add(ev.token) if detok is not None else ""
            finish = ev.finish_reason
            if finish is not None and detok is not None:
                text += detok.flush()
            text, hit = stop.feed(text)
            if hit:
                finish = "stop"
            elif finish is not None:
                text += stop.flush()
            lp = [(ev.token, ev.logprob, ev.top)] if ev.logprob is not None else []
            if finish is not None:
                choice.finish_reason = finish
                choice.done = True
                metrics.finished.labels(finish).inc()
                yield Delta(text, [ev.token], lp, finish)
                return
            yield Delta(text, [ev.token], lp)
    finally:
        if waiting:
            metrics.leave_waiting(running=False)
        else:
            metrics.running.dec()
        if not choice.done and choice.client is not None:
            await pool.abort(choice.client, choice.request_id)  # stop hit, disconnect or error
