"""Logprobs as the API carries them, with non-finite values made finite.

JSON has neither NaN nor infinities. So a non-finite value (a model's NaN or -inf logit) becomes `FLOOR_LOGPROB`."""

from __future__ import annotations

FLOOR_LOGPROB = -9999.0


def finite(x: float) -> float:
    return x if x == x and abs(x) != float("inf") else FLOOR_LOGPROB
