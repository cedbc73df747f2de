"""The failover timeline's measures, on hand-made token times."""

from __future__ import annotations

import pytest

from launch.experiments import timeline as tl


def test_stall_is_the_longest_of_the_first_two_waits_after_the_kill() -> None:
    steady = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    # The victim's last step reaches the client just after the signal (0.15); the stream's next
    # token comes at 0.6 from the AW it was restored onto. That wait is the stall, not the 0.1 s
    # gap that spans the signal.
    victim = [0.0, 0.1, 0.15, 0.6, 0.7]
    assert tl.stall([steady, victim], kill=0.12) == pytest.approx(0.45)
    assert tl.stall([steady], kill=0.12) == pytest.approx(0.1)
    # Later gaps are the slower steps of a cluster one worker short, not the pause.
    slow = [0.0, 0.1, 0.2, 0.35, 0.9]
    assert tl.stall([slow], kill=0.15) == pytest.approx(0.15)
    assert tl.stall([[0.0, 0.1]], kill=0.5) is None
    # A stream with no token yet at the kill (begun after it, or still in its prefill) had no gap
    # the kill interrupted, however long its first gaps.
    late = [0.5, 0.9, 1.0]
    assert tl.stall([steady, late], kill=0.12) == pytest.approx(0.1)
    assert tl.stall([late], kill=0.12) is None
    assert tl.first_success([steady, victim], kill=0.12) == pytest.approx(0.03)
