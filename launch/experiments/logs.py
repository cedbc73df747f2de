"""What the processes' logs say after an experiment: an expected failover leaves no error."""

from __future__ import annotations

from pathlib import Path


def scan_logs(out: Path) -> list[str]:
    """One note per log file with error-level lines or tracebacks."""
    notes = []
    for p in sorted(out.glob("logs*/*.log")):
        bad = [ln for ln in p.read_text(errors="replace").splitlines() if "Traceback" in ln or " ERROR " in ln]
        if bad:
            notes.append(f"{p}: {len(bad)} traceback/error line(s), first: {bad[0].strip()[:160]}")
    return notes
