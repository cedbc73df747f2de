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

from fabric.kernels import skinny
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


def fresh_cache_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose cache is fresh (the demo model written anew) but for the kernels built at set-up."""
    kernels = skinny.build_dir()
    if kernels.exists():
        link = tmp_path / "cache" / "moe-fabric" / "kernels" / kernels.name
        link.parent.mkdir(parents=True)
        link.symlink_to(kernels)
    return dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, int, Path]]:
    port, oport = free_port(), free_port()
    env = fresh_cache_env(tmp_path)
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--attention-workers", "1", "--expert-workers", "2",
           "--transport", "tcp", "--port", str(port), "--orchestrator-port", str(oport),
           "--cluster-secret-file", str(tmp_path / "secret")]
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


def cluster(oport: int, tmp: Path) -> dict:
    return get_json(f"http://127.0.0.1:{oport}/cluster", secret_file=tmp / "secret")


def child_pids(oport: int, tmp: Path) -> list[int]:
    return [w["pid"] for w in cluster(oport, tmp)["workers"]]


def test_serve_demo_model_and_sigterm_stops_everything(launcher: tuple[subprocess.Popen[str], int, int, Path]) -> None:
    proc, port, oport, tmp = launcher
    assert (tmp / "cache" / "moe-fabric" / "demo-mixtral-tiny-seed0" / "tokenizer.json").exists()
    base = f"http://127.0.0.1:{port}/v1/completions"
    status, body = post_json(base, {"prompt": "Serving language models", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8 and isinstance(body["choices"][0]["text"], str)
    events = stream_completion(base, {"prompt": "Serving language models", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]
    assert (tmp / "secret").stat().st_mode & 0o777 == 0o600  # serve wrote the missing secret file, private
    pids = child_pids(oport, tmp)
    assert len(pids) == 7 and all(alive(p) for p in pids)  # orchestrator, 2 gateways, 1 AW, 2 EWs, checkpoint store
    if sys.platform.startswith("linux"):  # `--sched batch` by default: every serving role, not the orchestrator
        policies = {w["role"]: os.sched_getscheduler(w["pid"]) for w in cluster(oport, tmp)["workers"]}
        assert policies.pop("orchestrator") == os.SCHED_OTHER
        assert set(policies) == {"gateway", "attention", "expert", "checkpoint_store"}
        assert set(policies.values()) == {os.SCHED_BATCH}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert wait_gone(pids, 15) == []


def test_sigkilled_launcher_leaves_no_orphans(launcher: tuple[subprocess.Popen[str], int, int, Path]) -> None:
    proc, _, oport, tmp = launcher
    pids = child_pids(oport, tmp)
    proc.kill()
    proc.wait()
    assert wait_gone(pids, 10) == []


def test_bad_flags_exit_with_a_clear_message() -> None:
    r = subprocess.run([sys.executable, "-m", "launch.cli", "attention-worker", "--model", "/x", "--orchestrator", "nohost"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = subprocess.run([sys.executable, "-m", "launch.cli", "orchestrator", "--model", "/nonexistent", "--expert-workers", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "launch.cli", "expert-worker", "--model", "/x", "--orchestrator", "h:1",
                        "--sched", "fifo"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sched" in r.stderr and "batch" in r.stderr


def test_sigterm_drains_running_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    import json
    import threading
    import urllib.request

    port, oport = free_port(), free_port()
    env = fresh_cache_env(tmp_path)
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--attention-workers", "1", "--expert-workers", "1",
           "--transport", "tcp", "--port", str(port), "--orchestrator-port", str(oport), "--max-waiting", "1",
           "--cluster-secret-file", str(tmp_path / "secret")]
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            assert "moe-fabric ready" in (proc.stdout.readline() if proc.stdout else "")
            base = f"http://127.0.0.1:{port}/v1/completions"
            # n=2 on a queue limit of 1: 429 with Retry-After, deterministically
            status, body = post_json(base, {"prompt": "hi", "max_tokens": 2, "n": 2})
            assert status == 429 and body["error"]["type"] == "rate_limit_error"
            events: list[dict] = []
            first = threading.Event()

            def stream() -> None:
                req = urllib.request.Request(base, data=json.dumps({"prompt": "Serving", "max_tokens": 300, "ignore_eos": True,
                                                                    "stream": True}).encode(), headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    for raw in r:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                            first.set()

            t = threading.Thread(target=stream)
            t.start()
            assert first.wait(60)
            pids = child_pids(oport, tmp_path)
            proc.send_signal(signal.SIGTERM)
            refused = False
            for _ in range(50):  # draining gateways leave the port at once (or answer 503 meanwhile)
                try:
                    status, body = post_json(base, {"prompt": "hi", "max_tokens": 2})
                except OSError:
                    refused = True
                    break
                if status == 503:
                    refused = True
                    break
                time.sleep(0.05)
            t.join(120)
            assert refused
            assert events[-1] == {"done": True}
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(1 for e in events if "choices" in e) == 300  # the running request finished whole
            assert proc.wait(timeout=60) == 0  # every role exited 0
            assert wait_gone(pids, 10) == []
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
