"""`moe-fabric experiment failover` end to end: an expert worker is SIGINTed under Poisson load, the
fabric heals itself, and the command reports no lost requests, identical outputs and a stall."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.model.demo import write_demo_model


@pytest.mark.timeout(180)
def test_failover_experiment_expert_fabric(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "model", arch="mixtral", seed=0, size="tiny")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "launch.cli", "experiment", "failover", "--role", "expert", "--mode", "fabric",
           "--model", str(model), "--duration", "6", "--at", "2", "--rate", "4", "--tokens", "32", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failover role=expert signal=INT mode=fabric: stall" in proc.stdout
    result = json.loads((out / "results.json").read_text())
    metrics = result["metrics"]
    assert metrics["requests"] > 0 and metrics["requests_lost"] == 0
    assert metrics["outputs_equal"] is True
    assert metrics["stall_s"] is not None and metrics["stall_s"] > 0
    assert metrics["time_to_first_success_s"] is not None
    assert metrics["detected_s"] is not None and 0 <= metrics["detected_s"] < metrics["stall_s"] + 1.0
    assert result["config"]["victim"] == "expert-worker-1" and result["throughput"] and result["gaps"]
    assert (out / "timeline.png").stat().st_size > 0
