"""The driver's side of a fabric process on Ray (`serve --cluster ray`, launch/ray_cluster.py).

It holds the process's record (`Host`) and the `Proc` tests and experiments hold for it. It says
what its `RoleHost` actor is told to run, and with which secrets. It also joins the Ray cluster and
kills a whole node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from fabric.errors import ConfigError, FabricError
from fabric.messages.control import Role
from launch.config import ServeConfig
from launch.flags import to_argv
from launch.launcher import COMMAND, Launcher
from launch.sealing import seal


@dataclass
class Host:
    """One fabric process and the actor that hosts it."""

    name: str
    role: Role
    restart: bool
    resources: dict[str, float]
    actor: Any
    node_id: str = ""
    node_ip: str = ""
    public_key: bytes = b""
    pid: int = 0
    replaces: str = ""
    boot_nice: int = 0  # a replacement boots this much nicer
    ready: bool = False
    # One of the processes `serve` starts. Readiness waits for these.
    initial: bool = True
    exit_ref: Any = None
    ready_ref: Any = None
    gone: bool = False
    code: int | None = None


class RemoteProc:
    """`Proc` over a host actor: signals go to the process wherever it runs."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.pid = host.pid
        self.node_id = host.node_id

    def send_signal(self, sig: int) -> None:
        import ray

        ray.get(self.host.actor.signal.remote(int(sig)), timeout=10)

    def poll(self) -> int | None:
        return (self.host.code if self.host.code is not None else -9) if self.host.gone else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.host.name} still runs")
            time.sleep(0.05)
        return code


def host_spec(launcher: Launcher, host: Host) -> dict[str, Any]:
    """What the host actor runs: the role's command line, the one it restarts with, env and log dir."""
    c, cfg = launcher.configs, launcher.cfg
    role_cfg: Any = {Role.ORCHESTRATOR: c.orchestrator, Role.GATEWAY: c.gateway, Role.ATTENTION: c.attention,
                     Role.EXPERT: c.expert, Role.STORE: c.store}[host.role]
    command = COMMAND[host.role]
    extra = launcher.extra.get(command, [])
    again = replace(role_cfg, boot_nice=cfg.restart_boot_nice) if host.restart else role_cfg
    if host.role is Role.ORCHESTRATOR:
        # The first orchestrator has no one to wait for; a restarted one waits for the workers.
        role_cfg = replace(role_cfg, recovery_grace_s=0.0)
    if host.boot_nice:
        role_cfg = replace(role_cfg, boot_nice=host.boot_nice)
    return {"name": host.name, "role": host.role.value, "command": command, "restart": host.restart,
            "argv": [*to_argv(role_cfg), *extra], "argv_again": [*to_argv(again), *extra],
            "env": launcher.extra_env.get(host.name, {}), "watchdog_s": cfg.watchdog_s,
            "restart_delay_s": cfg.restart_delay_s, "log_dir": launcher.log_dir,
            "provision": host.role is Role.ORCHESTRATOR and cfg.provisioner == "auto"}


def sealed_secrets(launcher: Launcher, host: Host) -> bytes | None:
    """The secrets the host's process needs, sealed to the host's key (launch/sealing.py)."""
    secrets = {}
    if launcher.secret is not None:
        secrets["cluster_secret"] = launcher.secret.decode()
    if host.role is Role.GATEWAY and launcher.cfg.api_key:
        secrets["api_key"] = launcher.cfg.api_key
    return seal(host.public_key, json.dumps(secrets).encode()) if secrets else None


def join_ray(cfg: ServeConfig) -> tuple[Any, bool]:
    """Connects this driver to Ray: `--ray-address`, $RAY_ADDRESS, or a new local cluster.

    Returns the `ray` module and whether this process started Ray, and so must shut it down."""
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    loopback = address.startswith("127.") if address else cfg.host.startswith("127.")
    # Every node is on loopback, so Ray must not advertise this machine's other addresses.
    if loopback:
        from launch.loopback_ray import keep_ray_on_loopback

        keep_ray_on_loopback()
    try:
        import ray
    except ImportError:
        raise ConfigError("--cluster ray needs Ray: pip install 'moe-fabric[ray]'") from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {} if address else {"include_dashboard": False}
        if loopback:
            kwargs["_node_ip_address"] = "127.0.0.1"
        ray.init(address=address, namespace=f"moe-fabric-{uuid.uuid4().hex[:8]}", log_to_driver=False,
                 logging_level=logging.WARNING, **kwargs)
    return ray, started


def kill_node(node_id: str) -> None:
    """Kills a whole node of a Ray cluster.

    Its raylet gets SIGKILL, and with it go every worker process there and every fabric process
    they host. On a loopback cluster the test or the experiment removes the node through
    `LoopbackRay` instead."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ref = ray.remote(_kill_own_raylet).options(
        num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(ref, timeout=30)


def _kill_own_raylet() -> None:
    """A Ray task that kills its worker process's parent, the node's raylet."""
    import signal

    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        if b"raylet" not in f.read():
            raise FabricError(f"the parent of this Ray worker (pid {parent}) is not a raylet")
    os.kill(parent, signal.SIGKILL)


def node_is_alive(node_id: str) -> bool:
    """Whether Ray still counts `node_id` alive. It may not know yet of a node that just died."""
    import ray

    try:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
    except Exception:
        # The GCS itself may be unreachable for a moment. That is no evidence either way.
        return True
