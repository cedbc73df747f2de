"""The fork server (launch/zygote.py, launch/forked.py): role processes forked from a process with
torch imported, handled by the supervisor as its own children; its death ends none of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.forked import ForkedProc, ForkServer
from launch.supervisor import Supervisor
from tests.conftest import running_fabric
from tests.helpers import replacement_of, wait_for, worker_by_pid
from tests.load import run_streams, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")

CLI = [sys.executable, "-m", "launch.cli"]
ROOT = Path(__file__).resolve().parents[2]


def test_a_forked_process_runs_its_command_with_its_env_and_output_and_is_waited_for(tmp_path: Path) -> None:
    server = ForkServer()
    try:
        assert server.usable and server.start(120)  # (its imports: seconds)
        secret = tmp_path / "secret"
        with open(tmp_path / "out.log", "wb") as out:
            proc = server.spawn([*CLI, "cluster-secret", str(secret)], {**os.environ, "MARK": "1"}, out)
        assert isinstance(proc, ForkedProc)
        assert proc.wait(60) == 0 and secret.exists() and (tmp_path / "out.log").read_text().strip() == str(secret)
        assert server.forked == 1
        # Its exit code and stderr, as a child's: the file exists, which is refused.
        with open(tmp_path / "err.log", "wb") as out:
            again = server.spawn([*CLI, "cluster-secret", str(secret)], dict(os.environ), out)
        assert again is not None and again.wait(60) == 2
        assert "is not overwritten" in (tmp_path / "err.log").read_text()
        # A process that needs another environment where a library reads it on import is not forked.
        assert server.spawn([*CLI, "cluster-secret", str(tmp_path / "x")], {**os.environ, "OMP_NUM_THREADS": "7"},
                            None) is None
        assert server.spawn([sys.executable, "-c", "pass"], dict(os.environ), None) is None  # only launch.cli
    finally:
        server.close()


def test_the_roles_modules_read_no_environment_and_start_nothing_on_import() -> None:
    """What the fork server imports ahead (launch/zygote.py `role_modules`) must leave no state a
    forked process would inherit wrongly: no variable set, no thread, no transport or grammar engine
    loaded (those read the environment of the process that uses them)."""
    code = ("import os, sys, threading; from launch import zygote; env = dict(os.environ); "
            "[__import__(m) for m in (*zygote.PRELOAD, *zygote.role_modules())]; "
            "print(os.environ == env, threading.active_count(), "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('ucxx', 'ucp', 'xgrammar', 'ray', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "True 1 []", out.stdout


def test_the_fabric_forks_its_processes_and_outlives_the_fork_server(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """Every process of a fabric is forked, `ps` shows its role's command line, and killing the fork
    server ends none of them: a worker that dies then is replaced the usual way while a new server
    starts, and the next one is forked again."""
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        assert isinstance(fabric.supervisor, Supervisor)
        server = fabric.supervisor.fork_server
        assert server is not None and server.forked == len(fabric.procs) and server.starts == 1
        argv = Path(f"/proc/{fabric.pid('expert-worker-1')}/cmdline").read_bytes().split(b"\0")
        assert argv[1:4] == [b"-m", b"launch.cli", b"expert-worker"]
        reference = run_streams(fabric)
        zygote = server.pid
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)
        wait_gone(zygote, 10)  # (the supervisor, its parent, reaps it when it next looks)
        pids = {p.pid for _, p in fabric.procs}
        assert all(p.poll() is None for _, p in fabric.procs)
        assert run_streams(fabric) == reference
        forked = server.forked
        victim = fabric.pid("expert-worker-2")
        for _ in (1, 2):  # the EW, then its replacement
            os.kill(victim, signal.SIGKILL)
            dead = worker_by_pid(wait_for(fabric, "the EW dead", lambda c, v=victim: worker_by_pid(c, v)["state"] == "dead"),
                                 victim)
            cluster = wait_for(fabric, "a replacement EW", lambda c, d=dead: replacement_of(c, d["id"]) is not None)
            new = replacement_of(cluster, dead["id"])
            assert new is not None
            assert run_streams(fabric) == reference
            pids.add(new["pid"])
            victim = new["pid"]
        assert server.starts == 2 and server.forked == forked + 1  # the second replacement, by the new server
        pids |= {p.pid for _, p in fabric.procs}
    for p in pids:
        wait_gone(p, 15)
