"""The attention worker's engine: requests in from gateway connections, one main loop.

The main loop, one step at a time:

1. apply a new routing table, if any, between steps;
2. schedule a mixed batch;
3. forward it, with attention here and experts through the REFE;
4. sample;
5. send each gateway its tokens, never waiting on one (`send_nowait`);
6. free finished requests.

Gateway connections only enqueue submits, aborts, detaches and attaches (attention_worker/sessions.py).

An error that belongs to one request, such as its sampling, fails that request, not the process.
An error in the step's forward pass fails the process, since its state may be inconsistent. The
fabric then resumes its requests elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.forwarding import ForwardingEngine
from attention_worker.grammar_masks import GrammarMasks
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import Chunk, ModelRunner
from attention_worker.request import Sequence, check_submit
from attention_worker.scheduler import Scheduler
from attention_worker.sessions import Sessions
from attention_worker.step_tokens import sample_step, score_chunks
from fabric import cpu_regions, faults, grammar, trace
from fabric.config import AttentionWorkerConfig
from fabric.errors import FabricError, PeerDeadError, ProtocolError, RequestError
from fabric.messages.client import (
    Abort,
    Attach,
    Constraint,
    Detach,
    PromptLogprobs,
    RequestFailed,
    StepOutput,
    Submit,
)
from fabric.messages.liveness import Ping, Pong
from fabric.model.config import ModelConfig
from fabric.transport.base import Connection

log = logging.getLogger("attention_worker")


class AttentionWorker:
    """The engine, built whole once the worker has its id (attention_worker/main.py `registered`).

    It holds the KV cache, the forwarding engine to the EWs, the checkpointer and the model runner."""

    def __init__(self, cfg: AttentionWorkerConfig, model: ModelConfig, kv: KVCache, refe: ForwardingEngine,
                 ckpt: Checkpointer, runner: ModelRunner) -> None:
        self.cfg = cfg
        self.model = model
        self.kv = kv
        self.scheduler = Scheduler(kv.blocks, cfg.max_batch_tokens, cfg.max_running)
        self.refe = refe
        self.ckpt = ckpt
        self.runner = runner
        self.work = asyncio.Event()
        # Request -> its restore, under way.
        self.restoring: dict[str, tuple[asyncio.Task[None], Sequence]] = {}
        self.sessions = Sessions(self._find, self._remove, self._requests)
        self.masks = GrammarMasks(model.vocab_size)
        self.crash_seed = faults.crash_seed()
        self.steps = 0
        self.tokens_out = 0
        self.failed_requests = 0  # requests failed for an error of their own
        self.restore_join_s = 0.0  # steps spent waiting for restores to join them

    def _requests(self) -> list[Sequence]:
        """Every request running, waiting or being restored here."""
        return [*self.scheduler.by_id.values(), *(seq for _, seq in self.restoring.values())]

    def _find(self, request_id: str) -> Sequence | None:
        seq = self.scheduler.by_id.get(request_id)
        if seq is None and request_id in self.restoring:
            seq = self.restoring[request_id][1]
        return seq

    # -- gateway connections ------------------------------------------------------------------
    async def handle_client(self, conn: Connection) -> None:
        """Serves one gateway connection.

        A request's `Sequence.client` is its one owner, the connection its tokens go to. None means
        detached."""
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Submit):
                    self._submit(msg, conn)
                elif isinstance(msg, Abort):
                    self.sessions.abort(conn, msg.request_id, msg.moved)
                elif isinstance(msg, Detach):
                    self.sessions.detach(conn, msg.request_id)
                elif isinstance(msg, Attach):
                    reply = self.sessions.attach(conn, msg)
                    if reply.found:
                        self.work.set()
                    conn.send_nowait(reply)  # before the loop turns: later outputs go to conn now
                elif isinstance(msg, Ping):  # the gateway's liveness probe
                    conn.send_nowait(Pong(msg.nonce))
                else:
                    raise ProtocolError(f"unexpected {msg.kind} from a client")
        finally:
            self.sessions.connection_lost(conn)  # resumable requests run on, detached
            self.work.set()

    def _submit(self, msg: Submit, conn: Connection) -> None:
        try:
            check_submit(msg, self.model.vocab_size, self.model.max_position)
            old = self._find(msg.request_id)
            if old is not None or msg.request_id in self.sessions.parked:
                if self._take_over(msg, conn):
                    return
                if old is not None and old.client is not None and not old.client.closed:
                    raise RequestError(f"request {msg.request_id} is already running here")
                if old is not None:
                    # A detached copy that disagrees with the resume. The gateway's stream wins and
                    # is prefilled again, not restored. The copy's KvDone is queued to the store,
                    # and a restore's fetch would overtake it.
                    self._remove(msg.request_id)
                    msg = dataclasses.replace(msg, restore_from="")
            seq = Sequence.from_submit(msg, conn)
            # A request that has yet to score its prompt prefills it whole. No KV restore skips it.
            if msg.restore_from and not seq.scores(0, seq.num_tokens):
                # Each restore waits for the store. They run side by side, not one after another.
                task = asyncio.create_task(self._restore_and_add(seq, msg.restore_from))
                self.restoring[msg.request_id] = (task, seq)
            elif msg.constraint is not None:
                # Its grammar compiles off this loop (a costly one would stall every stream).
                task = asyncio.create_task(self._restore_and_add(seq, ""))
                self.restoring[msg.request_id] = (task, seq)
            else:
                self._add(seq)
        except RequestError as exc:
            conn.send_nowait(RequestFailed(msg.request_id, str(exc), exc.status))
            return
        self.work.set()

    def _take_over(self, msg: Submit, conn: Connection) -> bool:
        """Resumes `msg` onto the copy that still runs, or finished, here detached.

        Its tokens past those the gateway has go out at once, the rest as they come
        (`Sessions.take_over`)."""
        taken = self.sessions.take_over(conn, msg)
        if taken is None:
            return False
        log.info("%s: resumed onto its own detached run here (%d tokens ahead)", msg.request_id, len(taken.outputs))
        if taken.prompt is not None:
            conn.send_nowait(PromptLogprobs(msg.request_id, taken.prompt))
        if taken.outputs:
            conn.send_nowait(StepOutput(taken.outputs, self.scheduler.outstanding_work()))
        self.work.set()
        return True

    def _add(self, seq: Sequence) -> None:
        try:
            self.scheduler.add(seq)
        except RequestError:
            self.kv.blocks.release(seq.block_table)
            raise

    async def _restore_and_add(self, seq: Sequence, owner: str) -> None:
        """Restores `seq` from `owner`'s checkpoint (if `owner`) and builds its grammar's matcher (if
        it has one), then schedules it."""
        try:
            if seq.submit is not None and seq.submit.constraint is not None:
                await self._build_matcher(seq, seq.submit.constraint)
            if owner:
                await self._restore(seq, owner)
        except RequestError as exc:
            self._tell(seq, RequestFailed(seq.request_id, str(exc), exc.status))
            return
        finally:
            self.restoring.pop(seq.request_id, None)  # an abort has popped it already
        try:
            self._add(seq)
        except RequestError as exc:
            self._tell(seq, RequestFailed(seq.request_id, str(exc), exc.status))
            return
        self.work.set()

    async def _build_matcher(self, seq: Sequence, c: Constraint) -> None:
        """The request's grammar matcher, advanced over the tokens it has (a resumed request's), so
        its next masks are those of the run it continues. Compiled off this loop."""
        try:
            grammars = await asyncio.to_thread(grammar.grammars_for, self.cfg.model, self.model.vocab_size,
                                               tuple(sorted(seq.stop_token_ids)))
            seq.matcher = await grammar.COMPILES.run(grammars.matcher, c, list(seq.output_ids))
        except grammar.ConstraintError as exc:
            raise RequestError(str(exc)) from None
        except grammar.GrammarBusyError as exc:
            raise RequestError(str(exc), 503) from None
        except TimeoutError:
            raise RequestError(f"the {c.kind} took over {grammar.COMPILE_TIMEOUT_S:.0f} s to compile") from None

    async def _restore(self, seq: Sequence, owner: str) -> None:
        """Per-request restoration (Tarragon §6.2).

        The KV `owner` checkpointed up to its committed frontier goes straight into this AW's cache.
        Only the tokens after it are recomputed. With nothing stored, or no store, the request
        re-prefills (replay)."""
        t0 = time.perf_counter()
        try:
            n = await self.ckpt.restore(seq, owner)
        except (PeerDeadError, TimeoutError) as exc:
            log.warning("%s: no checkpoint to restore from (%s); replaying", seq.request_id, exc)
            return
        if n:
            log.info("%s: restored %d of %d tokens from %s's checkpoint in %.1f ms; recomputing %d", seq.request_id,
                     n, seq.num_tokens, owner, (time.perf_counter() - t0) * 1e3, seq.num_tokens - n)
        else:
            log.info("%s: no checkpoint of %s's to restore from; replaying %d tokens", seq.request_id, owner,
                     seq.num_tokens)

    @staticmethod
    def _tell(seq: Sequence, msg: RequestFailed) -> None:
        if seq.client is not None:
            with contextlib.suppress(PeerDeadError):
                seq.client.send_nowait(msg)

    # -- main loop ----------------------------------------------------------------------------
    async def main_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refe.apply_next_table()  # a new routing table takes effect between steps
            if not self.scheduler.has_work:
                # Cleared before the await below, so a submit arriving during it is kept.
                self.work.clear()
                await self.refe.set_active(False)
                if not self.scheduler.has_work:
                    await _wait_any(self.work, stop)
                continue
            await self.refe.set_active(True)
            await self._join_restores()
            chunks = self.scheduler.schedule()
            # With work pending, something is always schedulable: running requests decode, and with
            # none running every block is free and `add` refused requests larger than the cache.
            assert chunks, "scheduler returned no work although requests are pending"
            if self.crash_seed is not None:
                faults.maybe_crash(self.crash_seed, [c.seq.seed for c in chunks])
            masks = self.masks.start(chunks)  # (filled while the experts compute)
            try:
                logits, scored = await self.runner.forward(chunks)
            except FabricError as exc:
                self._fail_all(chunks, f"expert datapath failed: {exc}")
                continue
            c0 = cpu_regions.start()
            score_chunks(chunks, scored)
            self._emit(chunks, logits, masks.result() if masks is not None else None)
            trace.stamp("emitted", "", self.steps)  # (its tokens are on their way to the gateways)
            self.ckpt.step_done(self.scheduler.running)
            cpu_regions.add("step: sample, tokens to the gateways", c0)
            cpu_regions.count(steps=1, rows=len(chunks))
            await self.ckpt.maybe_pause(self.steps, self.scheduler.running)

    async def expire_loop(self) -> None:
        """Aborts detached requests past their grace. It runs apart, as the main loop may be idle."""
        while True:
            await asyncio.sleep(0.25)
            self.sessions.expire(self.scheduler.running + list(self.scheduler.waiting))

    async def _join_restores(self) -> None:
        """Waits a bounded while for the restores under way, so the step takes them along.

        A restore that finishes just after a step starts waits out that whole step before its
        request decodes again. Restores take tens of ms, a step on a loaded AW one to two hundred.
        A dead AW's requests arrive together."""
        if self.restoring and self.cfg.restore_join_ms > 0:
            t0 = time.perf_counter()
            await asyncio.wait([t for t, _ in self.restoring.values()], timeout=self.cfg.restore_join_ms / 1e3)
            self.restore_join_s += time.perf_counter() - t0

    def _emit(self, chunks: list[Chunk], logits: torch.Tensor, masks: torch.Tensor | None = None) -> None:
        """Samples the step's tokens (attention_worker/step_tokens.py), sends each gateway its own, and frees the
        requests that finished or whose sampling failed."""
        out = sample_step(chunks, logits, masks)
        for seq, why in out.failed:
            self.failed_requests += 1
            self._tell(seq, RequestFailed(seq.request_id, why, 500))
            self._remove(seq.request_id)
        for seq in out.finished:
            self.sessions.finished(seq)
            self._remove(seq.request_id)
        self.steps += 1
        self.tokens_out += out.rows
        load = self.scheduler.outstanding_work()
        for conn, outputs in out.per_client.items():
            try:
                conn.send_nowait(StepOutput(outputs, load))  # a gateway that stops reading loses its link
            except PeerDeadError:
                pass  # handle_client's cleanup detaches its requests

    def _remove(self, request_id: str, hand_off: bool = False) -> None:
        """Aborts a request and frees its KV.

        Its checkpoints are freed too. With `hand_off` they are kept for another AW's restore, as
        its gateway resumed it there."""
        restoring = self.restoring.pop(request_id, None)
        if restoring is not None:
            restoring[0].cancel()  # aborted while its KV was on the way
        if self.scheduler.remove(request_id) is not None or restoring is not None:
            self.ckpt.finished([request_id], hand_off)

    def _fail_all(self, chunks: list[Chunk], message: str) -> None:
        log.error("%s", message)
        for c in chunks:
            self._remove(c.seq.request_id)
            self._tell(c.seq, RequestFailed(c.seq.request_id, message, 503))

    def stats(self) -> dict[str, Any]:
        b, refe, links = self.kv.blocks, self.refe, self.refe.links
        detached = sum(1 for s in self.scheduler.by_id.values() if s.client is None)
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": b.num_blocks - b.num_free, "kv_blocks_free": b.num_free,
            "steps": self.steps, "tokens_out": self.tokens_out, "preemptions": self.scheduler.preemptions,
            "failed_requests": self.failed_requests, "detached": detached, "parked": len(self.sessions.parked),
            "attaches": self.sessions.attaches, "detaches": self.sessions.detaches, "expired": self.sessions.expired,
            "replays": refe.replays, "expert_waits": refe.expert_waits, "spread_layers": refe.calls.spread_layers,
            **refe.collapse.stats(),  # (layers sent to one EW: attention_worker/collapse.py)
            # EWs routed around: declared dead, or unreachable from here and tried again in the background.
            "dead_expert_workers": sorted(links.excluded), "unreachable_expert_workers": sorted(links.unreachable),
            "suspected_at": dict(links.suspected_at),  # EW -> when this AW last lost it
            "ew_relinks": links.relinks, "probes_sent": links.probes_sent,
            "epochs_applied": {str(e): t for e, t in refe.applied.items()},
            **self.ckpt.stats(),
            "restore_join_s": round(self.restore_join_s, 3),
            "forward_s": round(self.runner.forward_s, 3), "expert_wait_s": round(self.runner.expert_wait_s, 3),
        }


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
