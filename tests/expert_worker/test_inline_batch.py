"""An expert worker runs the batch a call completes in that call's read callback (expert_worker/batching.py), with no
hop through its main loop: the results are sent before the callback returns. A batch that fails there fails the worker, as one in its
main loop does (its main loop raises it), not the AW whose call completed it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from expert_worker.main import ExpertWorker
from fabric.config import ExpertWorkerConfig
from fabric.messages.base import Message
from fabric.messages.expert import ExpertCall, ExpertResult


class Conn:
    """A data connection that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_nowait(self, msg: Message) -> None:
        self.sent.append(msg)


def worker(model: Path) -> ExpertWorker:
    ew = ExpertWorker(ExpertWorkerConfig(model=str(model), orchestrator="127.0.0.1:1", compute="sim",
                                         sim_expert_ms=0.0))
    ew.executor.load("", [(1, 0), (1, 1)])
    ew.batching.active_aws = {"aw-0", "aw-1"}  # both have a batch running: the sync gather waits for both
    return ew


def call(ew: ExpertWorker, call_id: int) -> ExpertCall:
    return ExpertCall(call_id, 0, 1, [0, 1], [1, 1], torch.randn(2, ew.model.hidden_size))


def test_the_call_that_completes_a_batch_runs_it_in_its_read_callback(hf_models: dict[str, Path]) -> None:
    async def body() -> None:
        ew = worker(hf_models["mixtral"])
        a, b = Conn(), Conn()
        ew._on_data("aw-0", a, call(ew, 1))  # type: ignore[arg-type]
        assert a.sent == [] and len(ew.batching.pending) == 1 and ew.batching.wakeup.is_set()  # waits for aw-1's call
        ew.batching.wakeup.clear()
        ew._on_data("aw-1", b, call(ew, 2))  # type: ignore[arg-type]
        # Both answered before the callback returned; nothing left for the main loop, which is not woken.
        assert [type(m) for m in a.sent] == [ExpertResult] and [m.call_id for m in b.sent] == [2]  # type: ignore[attr-defined]
        assert ew.batching.pending == [] and ew.batching.batches == 1 and not ew.batching.wakeup.is_set()

    asyncio.run(body())


def test_a_batch_that_fails_in_a_read_callback_fails_the_worker(hf_models: dict[str, Path]) -> None:
    async def body() -> None:
        ew = worker(hf_models["mixtral"])
        ew.batching.active_aws = {"aw-0"}

        def broken(batch: object) -> list[torch.Tensor]:
            raise RuntimeError("device lost")

        ew.executor.run = broken  # type: ignore[method-assign,assignment]
        ew._on_data("aw-0", Conn(), call(ew, 1))  # type: ignore[arg-type]  # (it does not raise to the AW's link)
        assert isinstance(ew.batching.failed, RuntimeError) and ew.batching.wakeup.is_set()
        with pytest.raises(RuntimeError, match="device lost"):
            await asyncio.wait_for(ew.batching.run_loop(asyncio.Event()), 5)

    asyncio.run(body())


def test_a_batch_counts_held_until_its_results_are_sent(hf_models: dict[str, Path]) -> None:
    """A probe answered while a batch's results are being sent still says the EW holds the AW's calls. Said
    to hold none just before the results left, an AW whose calls outlasted the send deadline suspected the EW
    (a slow first step that ended as a probe came)."""

    class Watching(Conn):
        def __init__(self, ew: ExpertWorker, peer: str) -> None:
            super().__init__()
            self.ew, self.peer = ew, peer
            self.said: list[tuple[float, int]] = []

        def send_nowait(self, msg: Message) -> None:
            self.said.append(self.ew.load(self.peer))  # what the control loop would answer now
            super().send_nowait(msg)

    class Unsent(Conn):
        """A data connection whose last result is still in this process."""

        def unread(self) -> int:
            return 0

        def unsent(self) -> int:
            return 4096

    async def body() -> None:
        ew = worker(hf_models["mixtral"])
        ew.batching.active_aws = {"aw-0"}
        conn = Watching(ew, "aw-0")
        ew._on_data("aw-0", conn, call(ew, 1))  # type: ignore[arg-type]
        assert [m.call_id for m in conn.sent] == [1]  # type: ignore[attr-defined]
        assert conn.said[0][1] == 1  # held while its result went out
        assert ew.load("aw-0") == (0.0, 0)  # and no longer once it had
        ew.conns["aw-0"] = {"data": Unsent()}  # type: ignore[dict-item]
        assert ew.load("aw-0")[1] == 1  # a result not yet out of the process counts as held too

    asyncio.run(body())
