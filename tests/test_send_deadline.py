"""A peer that stops reading (a stuck reader on a live socket, while its other channels answer) is
declared dead by the send deadline, and serving goes on: on both transports, and in a fabric whose
expert worker stops reading its expert calls (a test-only fault hook) but keeps answering probes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import torch

from fabric.errors import PeerStalledError
from fabric.faults import STALL_ENV
from fabric.messages.expert import ExpertResult, Ping, Pong
from fabric.transport import make_transport
from fabric.transport.base import Connection
from tests.conftest import running_fabric
from tests.helpers import wait_for, worker_by_pid
from tests.load import kill_mid_decode, run_streams

TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("ucxx") is None, reason="the [ucx] extra is part of the test install"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stuck_reader_never_blocks_its_sender(transport: str) -> None:
    """Over tcp the stuck reader's socket fills and the send deadline cuts the connection off;
    UCX buffers what its peer does not read on the peer's side, so no send waits there at all
    (the fabric finds such a peer by its missing results: see the next test)."""
    async def scenario() -> tuple[int, bool, bool]:
        t = make_transport(transport, send_timeout=0.3)
        stuck = asyncio.Event()

        async def handler(conn: Connection) -> None:
            first = await conn.recv()
            if isinstance(first, Ping) and first.nonce == 0:  # the stuck one: never reads again
                stuck.set()
                await asyncio.Event().wait()
            while True:  # the healthy one: answers every ping
                msg = await conn.recv()
                assert isinstance(msg, Ping)
                await conn.send(Pong(msg.nonce))

        listener = await t.listen("127.0.0.1", 0, handler)
        data = await t.connect("127.0.0.1", listener.port)
        control = await t.connect("127.0.0.1", listener.port)
        await data.send(Ping(0))
        await control.send(Ping(1))
        await asyncio.wait_for(stuck.wait(), 10)
        big = ExpertResult(1, torch.zeros(256, 1024))  # 1 MiB
        sent, stalled = 0, False
        try:
            async with asyncio.timeout(60):  # a guard against a hang, not a measurement
                while sent < 64:
                    await data.send(big)
                    sent += 1
        except PeerStalledError:
            stalled = True
        await control.send(Ping(2))  # the same peer's other connection still serves
        pong = await asyncio.wait_for(control.recv(), 10)
        await control.close()
        await listener.close()
        return sent, stalled, isinstance(pong, Pong) and pong.nonce == 2

    sent, stalled, answered = asyncio.run(scenario())
    assert answered and sent >= 1
    assert stalled if transport == "tcp" else (stalled or sent == 64)


def test_an_expert_worker_that_stops_reading_is_declared_dead(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """EW 1 stops reading its expert calls mid-decode (the hook, on SIGUSR1), while its control
    channels keep answering the AWs' probes and its orchestrator link answers the orchestrator's:
    the AWs find no result within the send deadline, replay its calls on the shadows and report
    it, and the orchestrator declares it dead on that evidence and replaces it."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3,
                        env={"expert-worker-1": {STALL_ENV: "1"}}) as fabric:
        stuck = worker_by_pid(fabric.cluster(), fabric.pid("expert-worker-1"))["id"]
        reference, outputs, _ = kill_mid_decode(fabric, "expert-worker-1", signal.SIGUSR1)
        assert outputs == reference
        cluster = wait_for(fabric, "the stuck EW declared dead and replaced", lambda c: any(
            w["info"].get("replaces") == stuck and w["state"] == "alive" for w in c["workers"]))
        assert [w["state"] for w in cluster["workers"] if w["id"] == stuck] == ["dead"]
        assert run_streams(fabric) == reference  # serving goes on
    aw_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("attention-worker-*.log"))
    assert "no expert result for" in aw_logs
    orch = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert f"{stuck} died (reported by aw-" in orch and "but it answers" not in orch
