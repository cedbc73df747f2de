"""`moe-fabric serve` as a user runs it: demo model by default, text prompts, Ctrl-C/SIGTERM stops
every process, and a SIGKILLed launcher leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, get_json, post_json, stream_completion


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, int, Path]]:
    port, oport = free_port(), free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "fabric.cli", "serve", "--attention-workers", "1", "--expert-workers", "2",
           "--transport", "tcp", "--port", str(port), "--orchestrator-port", str(oport)]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "moe-fabric ready" in line, (tmp_path / "serve.log").read_text()[-3000:]
        yield proc, port, oport, tmp_path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def child_pids(oport: int) -> list[int]:
    return [w["pid"] for w in get_json(f"http://127.0.0.1:{oport}/cluster")["workers"]]


def test_serve_demo_model_and_sigterm_stops_everything(launcher: tuple[subprocess.Popen[str], int, int, Path]) -> None:
    proc, port, oport, tmp = launcher
    assert (tmp / "cache" / "moe-fabric" / "demo-mixtral-tiny-seed0" / "tokenizer.json").exists()
    base = f"http://127.0.0.1:{port}/v1/completions"
    status, body = post_json(base, {"prompt": "Serving language models", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8 and isinstance(body["choices"][0]["text"], str)
    events = stream_completion(base, {"prompt": "Serving language models", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]
    pids = child_pids(oport)
    assert len(pids) == 5 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert wait_gone(pids, 15) == []


def test_sigkilled_launcher_leaves_no_orphans(launcher: tuple[subprocess.Popen[str], int, int, Path]) -> None:
    proc, _, oport, _ = launcher
    pids = child_pids(oport)
    proc.kill()
    proc.wait()
    assert wait_gone(pids, 10) == []


def test_bad_flags_exit_with_a_clear_message() -> None:
    r = subprocess.run([sys.executable, "-m", "fabric.cli", "attention-worker", "--model", "/x", "--orchestrator", "nohost"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = subprocess.run([sys.executable, "-m", "fabric.cli", "orchestrator", "--model", "/nonexistent", "--expert-workers", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "config.json" in r.stderr
