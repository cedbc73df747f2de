"""Failover metrics from per-token arrival times, and the Fig. 9-style timeline plot.

All times are seconds since the start of the run. A stream is the list of arrival times of its
tokens. A chunk carrying several tokens gives them the same time.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path

WINDOW = 0.5  # seconds per throughput window
# Seconds before the kill whose windows make the pre-failure baseline.
BASELINE_SPAN = 3.0
RECOVERED = 0.9  # fraction of the baseline that counts as "back"


def token_gaps(streams: Sequence[Sequence[float]]) -> list[tuple[float, float, int]]:
    """(arrival time, time since the stream's previous token, stream index), for every token but the first."""
    return [(b, b - a, i) for i, times in enumerate(streams) for a, b in zip(times, times[1:])]


def stall(streams: Sequence[Sequence[float]], kill: float) -> float | None:
    """The longest a stream waited for a token because of the kill, or None if no such gap.

    It looks at each stream that was decoding at the kill, i.e. had its first token before it. It
    takes the larger of the stream's first two token gaps that end after the kill, and returns the
    largest over the streams.

    The first gap alone, the one spanning the kill, misses the real wait when the victim's last step
    was already on its way and reached the client just after the signal. A stream with no token yet
    at the kill has no gap the kill interrupted; what it waited shows in its time to first token,
    not here. One that began after the kill would add its first gaps, however late, as the kill's.
    A new stream's second token waits for the prefill of those that arrived with it."""
    waits = [g for times in streams if times and times[0] <= kill
             for g in [b - a for a, b in zip(times, times[1:]) if b > kill][:2]]
    return max(waits) if waits else None


def normal_gap(streams: Sequence[Sequence[float]], kill: float) -> float | None:
    """The median token gap before the kill, which a stall reads against."""
    gaps = [b - a for times in streams for a, b in zip(times, times[1:]) if b < kill]
    return statistics.median(gaps) if gaps else None


def first_success(streams: Sequence[Sequence[float]], kill: float) -> float | None:
    """Time from the kill to the first token any stream receives after it."""
    after = [t for times in streams for t in times if t > kill]
    return min(after) - kill if after else None


def throughput(streams: Sequence[Sequence[float]], anchor: float = 0.0) -> list[tuple[float, float]]:
    """(window start, output tokens/s) over WINDOW-long windows.

    A window edge is at `anchor`, the kill, so no window straddles it. The windows run from the first
    one holding t=0 to the last token."""
    times = [t for s in streams for t in s]
    if not times:
        return []
    first = anchor - WINDOW * math.floor(anchor / WINDOW)
    first = first - WINDOW if first > 0 else first
    n = int((max(times) - first) // WINDOW) + 1
    counts = [0] * n
    for t in times:
        counts[min(n - 1, max(0, int((t - first) // WINDOW)))] += 1
    return [(first + k * WINDOW, c / WINDOW) for k, c in enumerate(counts)]


def recovery(series: Sequence[tuple[float, float]], kill: float) -> tuple[float | None, float | None]:
    """(pre-failure baseline tok/s, time to recover).

    The time to recover runs from the kill to the end of the first later window that reaches
    RECOVERED x baseline. It is None if no window gets back. The baseline is the median of the
    windows in the BASELINE_SPAN seconds before the kill."""
    eps = 1e-9
    before = [v for t, v in series if t >= kill - BASELINE_SPAN - eps and t + WINDOW <= kill + eps]
    if not before:
        return None, None
    base = statistics.median(before)
    for t, v in series:
        if t >= kill - eps and v >= RECOVERED * base:
            return base, t + WINDOW - kill
    return base, None


def plot_timeline(path: Path, gaps: Sequence[tuple[float, float, int]], series: Sequence[tuple[float, float]],
                  kill: float, kill_label: str, title: str, ready: float | None = None,
                  reference: Sequence[tuple[float, float]] = ()) -> bool:
    """Plots the time between tokens of every token on top (scatter, log scale), output throughput below.

    A vertical line marks the kill. For a full restart, another marks when the new fabric was ready.
    The failure-free run of the same workload is drawn in grey for comparison. Returns False, with
    no plot, without matplotlib (`pip install 'moe-fabric[experiments]'`)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    pts = [(t, g) for t, g, _ in gaps if g > 0]
    top.scatter([t for t, _ in pts], [g for _, g in pts], s=4, alpha=0.5, color="tab:blue", linewidths=0)
    top.set_yscale("log")
    top.set_ylabel("time between tokens (s)")
    top.set_title(textwrap.fill(title, 100), fontsize=9)
    for data, color, label in ((reference, "tab:gray", "failure-free run"), (series, "tab:green", "this run")):
        if data:  # the last step runs to the end of its window
            xs, ys = [t for t, _ in data] + [data[-1][0] + WINDOW], [v for _, v in data] + [data[-1][1]]
            bottom.step(xs, ys, where="post", color=color, label=label, alpha=0.6 if data is reference else 1.0)
    bottom.set_ylabel(f"output tokens/s ({WINDOW:g} s windows)")
    bottom.set_xlabel("time since the start of the run (s)")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.axvline(kill, color="tab:red", linestyle="--", linewidth=1, label=kill_label)
        if ready is not None:
            ax.axvline(ready, color="tab:gray", linestyle=":", linewidth=1, label="new fabric ready")
        ax.grid(alpha=0.3)
    top.legend(loc="upper left", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
