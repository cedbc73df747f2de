"""Helpers the benchmark scripts share (run them as `python bench/NAME.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


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


def bench_parser(doc: str | None, out: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags they all have: the model and where results go."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap


def profiler_parser(doc: str | None, out: str, concurrency: str, seconds: float) -> argparse.ArgumentParser:
    """A profiler's parser (a fabric of 2 AWs + 2 EWs under a closed loop): `bench_parser`'s flags, the stream counts
    run one after another, the seconds measured at each, the transport and `--sim`."""
    ap = bench_parser(doc, out)
    ap.add_argument("--concurrency", default=concurrency, help="comma-separated stream counts, run one after another")
    ap.add_argument("--seconds", type=float, default=seconds, help="seconds measured at each concurrency")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--sim", action="store_true", help="no compute at all (serve --compute sim, 0 ms a layer)")
    return ap


def ensure_bench_model(model_dir: Path) -> int:
    """Writes the `bench` demo model if it is not there; returns its vocabulary size."""
    from fabric.model.config import ModelConfig
    from fabric.model.demo import write_demo_model

    if not (model_dir / "config.json").exists():
        print(f"writing the bench demo model to {model_dir} ...", flush=True)
        write_demo_model(model_dir, arch="mixtral", size="bench")
    return ModelConfig.from_dir(model_dir).vocab_size


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
