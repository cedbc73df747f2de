"""Idle CPUs kept quick to wake (fabric/cpu_latency.py): a PM QoS request lives exactly as long as the process
that holds it, every serving process of a fabric holds one by default, and `--cpu-latency-us -1` asks nothing.

Where this process may not write /dev/cpu_dma_latency (not root, no udev rule), the same tests check that nothing
is held and that a worker still serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric import cpu_latency
from fabric.errors import ConfigError
from launch.config import ServeConfig
from tests.conftest import running_fabric
from tests.helpers import post_json

WRITABLE = os.access(cpu_latency.DEVICE, os.W_OK)


def holders(pid: int) -> int:
    """How many of `pid`'s file descriptors are open on the PM QoS device."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == cpu_latency.DEVICE) if fds.exists() else 0


def test_nothing_is_asked_of_a_device_that_is_missing_or_for_a_negative_latency(tmp_path: Path) -> None:
    assert cpu_latency.request(0, str(tmp_path / "no-such-device")) is None
    assert cpu_latency.hold(-1) is False and cpu_latency.hold(None) is False
    with cpu_latency.held(0, str(tmp_path / "no-such-device")) as taken:
        assert taken is False


def test_the_idle_driver_is_read_and_a_missing_file_is_none(tmp_path: Path) -> None:
    """The log says a request changes nothing where the kernel runs no cpuidle driver; what it reads."""
    (tmp_path / "current_driver").write_text("none\n")
    assert cpu_latency.idle_driver(str(tmp_path / "current_driver")) == "none"
    (tmp_path / "current_driver").write_text("haltpoll\n")
    assert cpu_latency.idle_driver(str(tmp_path / "current_driver")) == "haltpoll"
    assert cpu_latency.idle_driver(str(tmp_path / "absent")) is None


def test_a_request_holds_while_its_process_lives_and_ends_with_it() -> None:
    before = cpu_latency.current()
    code = ("import sys; from fabric import cpu_latency as c; ok = c.hold(7); "
            "print(ok, c.current(), flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:  # (waited for on the way out, killed first where a check failed)
        try:
            assert child.stdout is not None and child.stdin is not None
            taken, now = child.stdout.readline().split()
            assert holders(child.pid) == (1 if WRITABLE else 0)
            if WRITABLE:
                assert before is not None and taken == "True" and int(now) == min(before, 7)
            else:
                assert taken == "False"
            child.stdin.close()
            assert child.wait(30) == 0
        except BaseException:
            child.kill()
            raise
    if WRITABLE:
        assert cpu_latency.current() != 7  # the kernel dropped it with the process


def test_serve_hands_its_latency_to_every_serving_role_and_refuses_nonsense() -> None:
    roles = ServeConfig(cpu_latency_us=-1).role_configs("/m", "tcp", 1, 1, None)
    assert {roles.attention.cpu_latency_us, roles.expert.cpu_latency_us, roles.store.cpu_latency_us,
            roles.gateway.cpu_latency_us} == {-1}
    assert ServeConfig().role_configs("/m", "tcp", 1, 1, None).attention.cpu_latency_us == 0  # the default
    with pytest.raises(ConfigError, match="cpu_latency_us"):
        ServeConfig(cpu_latency_us=-2)


@pytest.mark.parametrize("us", [0, -1], ids=["default", "off"])
def test_the_serving_processes_hold_the_request_while_they_serve(us: int, hf_models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    before = cpu_latency.current()
    with running_fabric(hf_models["mixtral"], tmp_path, aws=1, ews=1, cpu_latency_us=us) as fabric:
        status, body = post_json(f"http://127.0.0.1:{fabric.port}/v1/completions",
                                 {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
                                  "ignore_eos": True, "return_token_ids": True})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 4
        serving = {w["role"]: holders(w["pid"]) for w in fabric.cluster()["workers"] if w["role"] != "orchestrator"}
        assert set(serving) == {"attention", "expert", "checkpoint_store", "gateway"}
        assert set(serving.values()) == ({1} if WRITABLE and us == 0 else {0})
        if WRITABLE and us == 0:
            assert cpu_latency.current() == 0
    # Released once the fabric's processes are gone (each drops its own request as it exits).
    deadline = time.monotonic() + 10
    while cpu_latency.current() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cpu_latency.current() == before
