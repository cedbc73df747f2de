"""fabric/spin.py: a wait that is usually short polls the loop, within its bounds."""

from __future__ import annotations

import asyncio

import pytest

from fabric.spin import Spin


def test_a_usually_short_wait_polls_until_done() -> None:
    async def main() -> None:
        spin = Spin(0.5)
        for _ in range(40):
            spin.observe(0.0001)  # waits of 100 µs: well under half the cap
        assert spin.typical < 0.25
        loop = asyncio.get_running_loop()
        turns = [0]

        def turn() -> None:  # done on the 5th turn of the loop: it polls through the first four
            turns[0] += 1
            if turns[0] < 5:
                loop.call_soon(turn)

        loop.call_soon(turn)
        await spin.wait(lambda: turns[0] >= 5)
        assert turns[0] == 5 and (spin.spins, spin.caught) == (1, 1)
        await spin.wait(lambda: True)  # done already: nothing to poll
        assert spin.spins == 1
        await Spin(0.5, cpus=2).wait(lambda: False, peers=2)  # two EWs woken and this AW: three CPUs of two
        narrow = Spin(0.5, cpus=2)
        narrow.typical = 0.0001
        await narrow.wait(lambda: False, peers=2)
        assert narrow.spins == 0  # returned at once, to sleep: polling would keep a woken peer off a CPU

    asyncio.run(main())


def test_long_waits_never_poll_and_a_poll_ends_at_its_cap() -> None:
    async def main() -> None:
        spin = Spin(0.002)
        spin.observe(10.0)  # a wait for real compute, or a failure: counted as the cap at most
        assert spin.typical == pytest.approx(0.002)
        await spin.wait(lambda: False)  # usually long: returns at once
        assert spin.spins == 0
        for _ in range(60):
            spin.observe(0.0)
        await spin.wait(lambda: False)  # never done: polls up to the cap, then returns to sleep as before
        assert (spin.spins, spin.caught) == (1, 0)
        assert spin.stats() == {"spins": 1, "spins_caught": 0, "spin_typical_us": round(spin.typical * 1e6)}

    asyncio.run(main())
