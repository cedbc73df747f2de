"""Helpers the benchmark scripts share (run them as `python bench/NAME.py`)."""

from __future__ import annotations

from pathlib import Path


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile; NaN for no samples."""
    s = sorted(xs) or [float("nan")]
    pos = q / 100 * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def scan_logs(log_root: str) -> list[str]:
    """One line per worker log under `log_root` that contains errors or warnings."""
    notes = []
    for p in sorted(Path(log_root).rglob("*.log")):
        bad = [ln for ln in p.read_text(errors="replace").splitlines()
               if any(w in ln for w in ("Traceback", "ERROR", "Error", "WARNING", "Exception"))]
        if bad:
            notes.append(f"{p}: {len(bad)} suspicious line(s), first: {bad[0].strip()[:200]}")
    return notes
