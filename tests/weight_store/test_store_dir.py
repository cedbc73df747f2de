"""A `serve` run's weight store in /dev/shm outlives a launcher killed by SIGKILL; the next launcher removes
the stores whose launcher is gone, and only those."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fabric.model.store_dir import SERVE_TAG, default_dir, sweep_stale


def test_stale_stores_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # its pid names a launcher that is gone
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stores = {name: default_dir(f"{SERVE_TAG}{pid}", tmp_path)
                  for name, pid in [("gone", done.pid), ("running", running.pid), ("mine", os.getpid())]}
        stores["other tag"] = default_dir(f"test-{done.pid}", tmp_path)  # not a serve run's
        stores["not a pid"] = default_dir(f"{SERVE_TAG}x1", tmp_path)
        for d in stores.values():
            d.mkdir()
            (d / "manifest.json").write_text("{}")
        assert sweep_stale(tmp_path) == [stores["gone"]]
        assert [name for name, d in stores.items() if not d.exists()] == ["gone"]
    finally:
        running.kill()
        running.wait()
