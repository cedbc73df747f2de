"""An EW's data path: the calls it holds, the batch its gather policy picks, run and answered.

A call that completes a batch runs it in its own read callback (`take`), sparing a hop through the main loop
(`run_loop`), which takes the turns that time or a wake-up brings: a policy's deadline, an AW that stopped or went.
Replays from a dead EW's AWs go first, whatever the policy says. A batch that fails in a read callback fails the
worker, not the AW whose call completed it: the main loop raises it.

The worker (expert_worker/main.py) validates a call, and fences dead AWs; the control loop reads `held` for its
probes' answers.
"""

from __future__ import annotations

import asyncio
import time

import torch

from expert_worker.executor import ExpertExecutor
from expert_worker.gather import GatherPolicy, PendingCall
from expert_worker.sim_executor import SimExecutor
from fabric import cpu_regions, trace
from fabric.errors import PeerDeadError
from fabric.faults import SlowSteps
from fabric.messages.expert import ExpertCall, ExpertResult
from fabric.steps import StepClock
from fabric.transport.base import Connection


class Batching:
    def __init__(self, executor: ExpertExecutor | SimExecutor, policy: GatherPolicy, clock: StepClock,
                 slow: SlowSteps | None) -> None:
        self.executor = executor
        self.policy = policy
        self.clock = clock
        self.slow = slow  # the test-only fault hook: slow batches
        self.pending: list[PendingCall] = []
        self.computing: list[PendingCall] = []  # the batch under way
        self.failed: Exception | None = None  # what a batch run from a read callback raised
        self.active_aws: set[str] = set()  # AWs with a batch running: those a gather may wait for
        self.not_padding: set[str] = set()  # AWs whose last call said they do not pad (`ExpertCall.pads`)
        self.wakeup = asyncio.Event()
        self.empty_calls = 0
        self.batches = 0
        self.mixed_batches = 0  # batches that held calls for more than one layer (each layer's experts read apart)
        self.compute_s = 0.0  # cumulative time running experts (for stats)

    def take(self, aw_id: str, conn: Connection, call: ExpertCall) -> None:
        """Holds a valid call of `aw_id`'s, and runs the batch it completes, if any, here."""
        self.active_aws.add(aw_id)
        if call.pads:
            self.not_padding.discard(aw_id)
        else:
            self.not_padding.add(aw_id)
        self.empty_calls += not call.counts
        trace.stamp("arrive", aw_id, call.call_id)
        self.pending.append(PendingCall(aw_id, conn, call))
        if not self.computing and self.failed is None:
            try:
                self.turn()  # the batch this call completes, here
            except Exception as exc:  # the worker's failure, not this AW's: the main loop raises it
                self.failed = exc
        if self.pending or self.failed is not None:
            self.wakeup.set()

    def linked(self, aw_id: str) -> None:
        """A new data link of `aw_id`'s: it pads until a call of its says otherwise."""
        self.not_padding.discard(aw_id)

    def activity(self, aw_id: str, active: bool) -> None:
        """Whether `aw_id` has a batch running: gather policies wait only for those that do."""
        if active:
            self.active_aws.add(aw_id)
        else:
            self.active_aws.discard(aw_id)
        self.wakeup.set()

    def drop(self, conn: Connection) -> None:
        """Drops the calls that came on `conn`, which ended: nobody reads their results."""
        self.pending = [p for p in self.pending if p.conn is not conn]

    def forget(self, aw_id: str) -> None:
        """Drops `aw_id`'s calls and never waits for it again until its next call or activity (its link is gone, or
        it was declared dead)."""
        self.pending = [p for p in self.pending if p.aw_id != aw_id]
        self.active_aws.discard(aw_id)
        self.not_padding.discard(aw_id)
        self.wakeup.set()

    def held(self, aw_id: str) -> int:
        """How many of `aw_id`'s calls are queued or in the batch under way (on the control loop: lists copied under
        the GIL). A batch's calls are held until their results are sent (`turn`)."""
        return sum(p.aw_id == aw_id for p in [*self.pending, *self.computing])

    async def run_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.failed is not None:
                raise self.failed  # (a batch run from a read callback)
            ran, wait = self.turn()
            if ran:
                continue
            self.wakeup.clear()
            # A timer, not wait_for, which would wrap the wait in a task of its own every layer.
            timer = asyncio.get_running_loop().call_later(wait if wait is not None else 1.0, self.wakeup.set)
            try:
                await self.wakeup.wait()
            finally:
                timer.cancel()

    def turn(self) -> tuple[bool, float | None]:
        """Runs and answers the batch the policy picks now, if any: (whether one ran, seconds until the policy's
        next time-based decision). The main loop takes turns, and so does the read callback of a call that
        completes a batch, sparing the hop through the main loop."""
        replays = [p for p in self.pending if p.call.replay]
        # Replayed work from a dead EW's AWs goes first, whatever the policy says.
        if replays:
            batch, wait = replays, None
        else:
            batch, wait = self.policy.select(self.pending, self.awaited(), time.monotonic())
        if not batch:
            return False, wait
        # The control loop counts the batch held (`held`) from before it leaves `pending` until its results are sent:
        # a probe answered between the two would tell its AWs that this EW holds none of their calls.
        self.computing = batch
        chosen = {id(p) for p in batch} if len(batch) < len(self.pending) else None  # (None: all of them)
        self.pending = [p for p in self.pending if id(p) not in chosen] if chosen else []
        try:
            t0 = time.perf_counter()
            c0 = cpu_regions.start()
            outputs = self.clock.run(self._run, batch)
            cpu_regions.add("batch: run", c0)
            c0 = cpu_regions.start()
            took = time.perf_counter() - t0
            active = self.active_aws
            for p, y in zip(batch, outputs):  # the results first: their AWs wait for them, the counts below wait for nobody
                if not p.rows:
                    # An AW's empty call, sent so that the gather does not wait for it. Nobody waits for an answer.
                    continue
                try:
                    # Never wait on one slow AW. (`others`: an AW other than this one has a batch running.)
                    others = len(active) > 1 or (len(active) == 1 and p.aw_id not in active)
                    p.conn.send_nowait(ExpertResult(p.call.call_id, y, others, took))
                    trace.stamp("sent", p.aw_id, p.call.call_id)
                except PeerDeadError:
                    pass  # that AW is gone; nobody waits for these rows
            self.compute_s += took
            self.policy.ran(took)
            self.batches += 1
            self.mixed_batches += len(batch) > 1 and len({p.call.layer for p in batch}) > 1
            cpu_regions.add("batch: encode and write the results", c0)
            if cpu_regions.on:
                cpu_regions.count(batches=1, rows=sum(p.rows for p in batch))
        finally:
            self.computing = []
        return True, None

    def awaited(self) -> set[str]:
        """The AWs a sync gather waits for: those with a batch running whose last call said they pad.

        An AW that does not pad sends nothing at a layer it has no rows for here, so waiting for it could
        last until `max_wait`. One stops padding only when this EW's results tell it that no other AW has a
        batch running, or while its layers' rows go to one EW each (attention_worker/collapse.py), and only
        through a message that says so, which lands before any layer it skips."""
        return self.active_aws - self.not_padding if self.not_padding else self.active_aws

    def _run(self, batch: list[PendingCall]) -> list[torch.Tensor]:
        """Runs one batch on this loop. The control plane answers for the worker meanwhile."""
        for p in batch:
            trace.stamp("run", p.aw_id, p.call.call_id)
        if self.slow is not None:
            self.slow()
        outputs = self.executor.run(batch)
        trace.stamp("ran", "", -1)
        return outputs
