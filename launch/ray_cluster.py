"""`moe-fabric serve --cluster ray`: the fabric on a Ray cluster, placed by failure domain.

The driver (this module, in the `serve` process) is the Ray counterpart of the local supervisor.
Every fabric process runs as the child of a `RoleHost` actor (launch/ray_host.py) on a Ray node,
with the role's Ray resources (`--aw-resources '{"GPU": 1}'`, ...). The driver owns every actor,
so they all end with it. Placement (launch/ray_placement.py) keeps attention workers apart and the
checkpoint store away from them, and spreads expert workers and gateways; `serve` says which does
not hold on a cluster too small.

The main loop (one thread) does `ray.wait` on every host's exit, readiness and the orchestrator's
requests for replacement workers. A worker whose process exits, or whose actor dies, is reported
to the orchestrator, which asks for a replacement; the driver starts it on a healthy node with free
resources: never one that lost a process, and if possible none that holds a copy of the dead EW's
experts. An actor only unavailable for a while (Ray's transient error) is watched again. The
orchestrator and the gateways are restarted by their host when their process dies, and by Ray on
another node when their node dies; the driver tells every host where the orchestrator is now.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fabric.errors import FabricError
from fabric.messages.base import decode_message, encode_message
from fabric.messages.control import Role
from fabric.messages.supervisor import StartWorker, WorkerExited, WorkerStarted
from fabric.wire import decode_bytes, encode_bytes
from launch.config import RESOURCE_FIELDS, ServeConfig
from launch.launcher import COMMAND, STOP_ORDER, Launcher, Proc, say
from launch.ray_host import RoleHost, node_label
from launch.ray_hosts import Host, RemoteProc, host_spec, join_ray, kill_node, node_is_alive, sealed_secrets
from launch.ray_placement import NodeState, choose_node, spread_notes

log = logging.getLogger("moe-fabric")

# Seconds for a host actor to come up. Ray starts a worker process for it.
START_TIMEOUT = 120.0


class RaySupervisor(Launcher):
    def __init__(self, cfg: ServeConfig, model: str, log_dir: str | None = None,
                 extra_args: dict[str, list[str]] | None = None, extra_env: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__(cfg, model, log_dir, extra_args, extra_env)
        # Here, in the caller's thread: Ray wants the main one.
        ray, self._started_ray = join_ray(cfg)
        self.resources = {role: cfg.resources(f) for role, f in RESOURCE_FIELDS.items()}
        self.remote_host = ray.remote(RoleHost)
        self.hosts: list[Host] = []
        # Every actor this driver made. They are killed at the end, whatever happened.
        self.actors: list[Any] = []
        self.lock = threading.Lock()  # guards hosts, actors, nodes
        self.nodes: dict[str, NodeState] = {}
        self.lost_nodes: set[str] = set()  # nodes where an actor died: never chosen again
        self.orchestrator_ip = cfg.host
        # From helper threads, run by the main loop.
        self.events: queue.Queue[Callable[[], None]] = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ray-driver")
        self.req_ref: Any = None
        self._replacements = 0

    @property
    def orchestrator_host(self) -> str:
        return self.orchestrator_ip

    def where(self) -> str:
        return f"{len(self.nodes)} Ray nodes"

    # -- nodes and placement ------------------------------------------------------------------
    def _refresh_nodes(self) -> list[NodeState]:
        """The alive nodes, minus the lost ones. It keeps what the fabric placed on each."""
        import ray

        alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        with self.lock:
            for node_id in list(self.nodes):
                if node_id not in alive:
                    del self.nodes[node_id]
            for node_id, n in alive.items():
                if node_id not in self.nodes:
                    self.nodes[node_id] = NodeState(node_id, dict(n.get("Resources", {})))
            return [s for i, s in self.nodes.items() if i not in self.lost_nodes]

    def _new_host(self, name: str, role: Role, avoid: set[str] = frozenset(), replaces: str = "",  # type: ignore[assignment]
                  initial: bool = True) -> Host:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        res = self.resources[role]
        nodes = self._refresh_nodes()
        with self.lock:
            node = choose_node(role, res, nodes, avoid)
            if node is None:
                raise FabricError(f"no Ray node has the resources {json.dumps(res)} free for {name} (nodes: "
                                  f"{', '.join(f'{node_label(n.node_id)} {n.total}' for n in nodes) or 'none'}); "
                                  f"see --{RESOURCE_FIELDS[role].replace('_', '-')}")
            node.take(role, res)
            restart = role in (Role.ORCHESTRATOR, Role.GATEWAY)
            # A restartable process's host follows it to another node when its node dies (soft
            # affinity). A worker's stays put, as a new worker replaces it.
            rest = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
            actor = self.remote_host.options(
                name=None, num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0), resources=rest,
                max_restarts=-1 if restart else 0, max_concurrency=16,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=restart)).remote()
            self.actors.append(actor)
        return Host(name, role, restart, res, actor, node_id=node.node_id, replaces=replaces, initial=initial)

    def _release(self, host: Host) -> None:
        with self.lock:
            node = self.nodes.get(host.node_id)
            if node is not None:
                node.take(host.role, host.resources, -1)

    def _hello(self, host: Host, timeout: float) -> None:
        import ray

        info = ray.get(host.actor.hello.remote(), timeout=timeout)
        node = info["node_id"]
        if node != host.node_id:  # Ray restarted it elsewhere
            self._release(host)
            with self.lock:
                if node not in self.nodes:
                    self.nodes[node] = NodeState(node, {})
                self.nodes[node].take(host.role, host.resources)
        host.node_id, host.node_ip, host.public_key = node, info["node_ip"], info["public_key"]

    def _start(self, host: Host) -> None:
        import ray

        orchestrator = f"{self.orchestrator_ip}:{self.orchestrator_port}"
        info = ray.get(host.actor.start.remote(host_spec(self, host), sealed_secrets(self, host), orchestrator),
                       timeout=60)
        host.pid = info["pid"]

    def _arm(self, host: Host) -> None:
        host.exit_ref = host.actor.exited.remote()
        host.ready_ref = None if host.ready else host.actor.until_ready.remote(5.0)
        if host.role is Role.ORCHESTRATOR:
            self.req_ref = host.actor.requests.remote(1.0)

    # -- the main loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start_all()
            while not self.stop_requested.is_set() and self.failure is None:
                self._step(0.1)
        except Exception as exc:  # the driver itself failed: stop what it started
            log.exception("the Ray driver failed")
            self.failure = self.failure or f"the Ray driver failed: {exc}"
        finally:
            self._shutdown()
            self.ready.set()

    def _start_all(self) -> None:
        import ray

        cfg = self.cfg
        plan = ([(f"attention-worker-{i}", Role.ATTENTION) for i in range(cfg.attention_workers)]
                + [(f"checkpoint-store-{i}", Role.STORE) for i in range(cfg.checkpoint_stores)]
                + [(f"expert-worker-{i}", Role.EXPERT) for i in range(cfg.expert_workers)]
                + [(f"gateway-{i}", Role.GATEWAY) for i in range(cfg.gateways)] + [("orchestrator", Role.ORCHESTRATOR)])
        hosts = [self._new_host(name, role) for name, role in plan]
        with self.lock:
            self.hosts = hosts
        for note in spread_notes(list(self.nodes.values()), cfg.expert_workers):
            say(f"placement: {note}")
        say("placement: " + "; ".join(f"{node_label(n)}: " + ", ".join(h.name for h in hosts if h.node_id == n)
                                      for n in dict.fromkeys(h.node_id for h in hosts)))
        infos = ray.get([h.actor.hello.remote() for h in hosts], timeout=START_TIMEOUT)
        for h, info in zip(hosts, infos):
            h.node_ip, h.public_key = info["node_ip"], info["public_key"]
        orch = next(h for h in hosts if h.role is Role.ORCHESTRATOR)
        self.orchestrator_ip = orch.node_ip
        self._start(orch)
        refs = [h.actor.start.remote(host_spec(self, h), sealed_secrets(self, h), f"{orch.node_ip}:{self.orchestrator_port}")
                for h in hosts if h is not orch]
        for h, info in zip([h for h in hosts if h is not orch], ray.get(refs, timeout=START_TIMEOUT)):
            h.pid = info["pid"]
        for h in hosts:
            self._arm(h)

    def _step(self, timeout: float) -> None:
        import ray

        refs: dict[Any, tuple[str, Host | None]] = {}
        for h in self.hosts:
            if h.exit_ref is not None:
                refs[h.exit_ref] = ("exit", h)
            if h.ready_ref is not None:
                refs[h.ready_ref] = ("ready", h)
        if self.req_ref is not None:
            refs[self.req_ref] = ("requests", None)
        done = ray.wait(list(refs), num_returns=1, timeout=timeout, fetch_local=True)[0] if refs else []
        if not refs:
            time.sleep(timeout)
        for ref in done:
            what, host = refs[ref]
            if what == "requests":
                self._requests(ref)
            elif host is not None and what == "ready":
                self._readied(host, ref)
            elif host is not None:
                self._exited(host, ref)
        while True:
            try:
                self.events.get_nowait()()
            except queue.Empty:
                break
        if not self.was_ready and all(h.ready for h in self.hosts if h.initial):
            self.was_ready = True
            self.ready.set()

    def _readied(self, host: Host, ref: Any) -> None:
        import ray

        host.ready_ref = None
        try:
            host.ready = bool(ray.get(ref))
        except ray.exceptions.RayError:
            return  # its exit says what happened
        if not host.ready and not host.gone:
            host.ready_ref = host.actor.until_ready.remote(5.0)

    def _exited(self, host: Host, ref: Any) -> None:
        import ray

        host.exit_ref = None
        try:
            code: int | None = ray.get(ref)
            why = f"exited with code {code}"
        except ray.exceptions.RayError as exc:
            alive = node_is_alive(host.node_id)
            if isinstance(exc, ray.exceptions.ActorUnavailableError) and alive:
                # Transient, as Ray documents it: its owner or a node near it hiccuped. The process
                # most likely serves on. Its exit is watched again a moment later.
                log.info("%s: its actor is unavailable for now (%s); watching it again", host.name, exc)
                threading.Timer(0.5, self.events.put, (lambda: self._rearm(host),)).start()
                return
            code, why = None, f"is gone {'' if alive else 'with its node '}({type(exc).__name__})"
            with self.lock:
                self.lost_nodes |= set() if alive else {host.node_id}
        if self.stop_requested.is_set():
            return
        if not self.was_ready and host.initial:
            self.failure = f"{host.name} {why} during start-up"
            return
        if host.restart and code is None:
            say(f"{host.name} (pid {host.pid}) {why}; Ray starts it again on another node")
            host.ready = False
            if host.role is Role.ORCHESTRATOR:
                self.req_ref = None
            self.pool.submit(self._revive, host)
            return
        say(f"{host.name} (pid {host.pid}) {why}; the fabric takes over its work")
        host.gone, host.code = True, code
        self._release(host)
        with self.lock:
            self.hosts.remove(host)
        with contextlib.suppress(Exception):
            ray.kill(host.actor, no_restart=True)
        self._tell_orchestrator(encode_bytes(*encode_message(WorkerExited(host.pid, -9 if code is None else code))))

    def _rearm(self, host: Host) -> None:
        if not host.gone and host.exit_ref is None and not self.stop_requested.is_set():
            host.exit_ref = host.actor.exited.remote()

    def _revive(self, host: Host) -> None:
        """Waits for Ray to restart `host`'s actor, then starts its process. Runs in a helper thread."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self.stop_requested.is_set():
            try:
                self._hello(host, 5.0)
                if not self.stop_requested.is_set():
                    self._start(host)
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    say(f"cannot start {host.name} again: {exc}")
                    return
                time.sleep(0.2)
        self.events.put(lambda: self._revived(host))

    def _revived(self, host: Host) -> None:
        if self.stop_requested.is_set():
            return
        say(f"{host.name} started again on {node_label(host.node_id)} (pid {host.pid})")
        self._arm(host)
        if host.role is Role.ORCHESTRATOR:
            self.orchestrator_ip = host.node_ip
            address = f"{host.node_ip}:{self.orchestrator_port}"
            for h in self.hosts:
                if h is not host:
                    h.actor.set_orchestrator.remote(address)

    def _requests(self, ref: Any) -> None:
        import ray

        self.req_ref = None
        orch = next((h for h in self.hosts if h.role is Role.ORCHESTRATOR), None)
        try:
            data = ray.get(ref)
        except ray.exceptions.RayError:
            # The orchestrator's exit says what happened, and its revival asks again.
            return
        if orch is not None and orch.exit_ref is not None:
            self.req_ref = orch.actor.requests.remote(1.0)
        for raw in data:
            msg = decode_message(*decode_bytes(raw))
            if not isinstance(msg, StartWorker) or msg.role not in (Role.ATTENTION, Role.EXPERT, Role.STORE):
                log.error("moe-fabric: the orchestrator asked for something unexpected: %s", msg)
                continue
            self._replacements += 1
            self.pool.submit(self._replace, msg, f"{COMMAND[msg.role]}-r{self._replacements}")

    def _replace(self, msg: StartWorker, name: str) -> None:
        """Starts a replacement on a healthy node with free resources. Runs in a helper thread."""
        if self.stop_requested.is_set():
            return
        with self.lock:
            labels = {node_label(n): n for n in self.nodes}
        avoid = {labels[a] for a in msg.avoid if a in labels}
        # A node may be dead before Ray says so. The next try is on another one.
        for _ in range(4):
            if self.stop_requested.is_set():
                return
            try:
                host = self._new_host(name, msg.role, avoid, replaces=msg.key, initial=False)
            except FabricError as exc:
                say(f"cannot start a worker for {msg.key}: {exc}")
                return
            host.boot_nice = msg.boot_nice
            try:
                self._hello(host, START_TIMEOUT)
                self._start(host)
                break
            except Exception as exc:
                say(f"{name} did not start on {node_label(host.node_id)} ({type(exc).__name__}); trying another node")
                self._release(host)
                with self.lock:
                    self.lost_nodes.add(host.node_id)
        else:
            say(f"cannot start a worker for {msg.key}: no node started {name}")
            return

        def started() -> None:
            with self.lock:
                self.hosts.append(host)
            self._arm(host)
            say(f"started {name} (pid {host.pid}) on {node_label(host.node_id)} for {msg.key}")
            self._tell_orchestrator(encode_bytes(*encode_message(WorkerStarted(msg.key, host.pid))))

        self.events.put(started)

    def _tell_orchestrator(self, data: bytes) -> None:
        orch = next((h for h in self.hosts if h.role is Role.ORCHESTRATOR), None)
        if orch is not None:
            orch.actor.tell.remote(data)

    # -- stopping -----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        import ray

        self.stop_requested.set()
        if any(h.role is Role.ORCHESTRATOR and h.pid for h in self.hosts):
            self.announce_shutdown()
        for roles in STOP_ORDER:
            group = [h for h in self.hosts if h.role in roles and h.pid]
            grace = self.cfg.drain_timeout + 10.0 if roles == [Role.GATEWAY] else 10.0
            refs = [h.actor.stop.remote(grace) for h in group]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace + 5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            actors = list(self.actors)
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()
        shutil.rmtree(self._sockdir, ignore_errors=True)

    # -- for callers in other threads -----------------------------------------------------------
    def snapshot(self) -> list[tuple[str, Proc]]:
        with self.lock:
            return [(h.name, RemoteProc(h)) for h in self.hosts if h.pid]

    kill_node = staticmethod(kill_node)

    def node_of(self, name: str) -> str:
        """The Ray node id where the process `name` runs now."""
        with self.lock:
            return next(h.node_id for h in self.hosts if h.name == name)
