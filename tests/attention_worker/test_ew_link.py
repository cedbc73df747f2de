"""An AW's stall verdict on an EW (`EwLink.check`): no result past the send deadline from an EW that holds none of
its calls. A result whose bytes are still arriving is not a stall (the EW's answer to a probe can overtake it, on
the other connection); bytes that stopped coming part-way are."""

from __future__ import annotations

import asyncio
import time

import torch

from attention_worker.ew_link import EwLink
from fabric.errors import PeerStalledError
from fabric.messages import fast
from fabric.messages.expert import ExpertResult
from fabric.routing import EwAddress
from fabric.transport import make_transport
from tests.fabric.test_transport import finish, listening

DEADLINE = 1.0


def test_a_result_arriving_is_not_a_stall_and_one_that_stopped_part_way_is() -> None:
    async def main() -> None:
        transport = make_transport("tcp")
        listener, accepted = await listening(transport)
        control = await transport.connect("127.0.0.1", listener.port)
        await asyncio.wait_for(accepted.get(), 10)
        data = await transport.connect("127.0.0.1", listener.port)
        ew_side = await asyncio.wait_for(accepted.get(), 10)
        try:
            link = EwLink(EwAddress("expert-worker-1", "127.0.0.1", listener.port), control, data)
            link.start_reading()
            result: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
            link.pending[5], link.sent_at[5] = result, time.monotonic()

            def past_deadline(nonce: int) -> PeerStalledError | None:
                now = time.monotonic()
                link.last_data = now - 2 * DEADLINE  # no result for twice the deadline; its last answer: none held
                error = link.check(now, 0.0, 3, DEADLINE, nonce)  # (probes off: only the stall verdict)
                assert error is None or isinstance(error, PeerStalledError)
                return error

            assert past_deadline(1) is not None  # nothing on its way: stalled
            y = torch.randn(64, 512)
            wire = memoryview(fast.encode(ExpertResult(5, y, False, 0.0)))  # type: ignore[arg-type]
            third = len(wire) // 3

            async def send_and_wait(part: memoryview) -> None:
                before = data.unread()
                ew_side._transport.write(bytes(part))  # type: ignore[attr-defined]  # raw bytes, part of a message
                for _ in range(500):  # (until they have crossed loopback)
                    if data.unread() != before:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the bytes did not arrive")

            await send_and_wait(wire[:third])
            assert past_deadline(2) is None  # a result is arriving
            await send_and_wait(wire[third : 2 * third])
            assert past_deadline(3) is None  # and still is
            assert past_deadline(4) is not None  # its bytes stopped coming: stalled
            ew_side._transport.write(bytes(wire[2 * third :]))  # type: ignore[attr-defined]
            assert torch.equal(await asyncio.wait_for(result, 10), y)
            assert link.check(time.monotonic(), 0.0, 3, DEADLINE, 5) is None  # the result came

            # The next wait past the deadline looks at its own bytes: as many as the last look of the one before
            # (results of one size) still move from none.
            again: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
            link.pending[6], link.sent_at[6] = again, time.monotonic()
            wire = memoryview(fast.encode(ExpertResult(6, y, False, 0.0)))  # type: ignore[arg-type]
            await send_and_wait(wire[: 2 * third])
            assert past_deadline(6) is None
            ew_side._transport.write(bytes(wire[2 * third :]))  # type: ignore[attr-defined]
            assert torch.equal(await asyncio.wait_for(again, 10), y)
        finally:
            await control.close()
            await finish(data, listener)

    asyncio.run(main())
