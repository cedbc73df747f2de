"""`moe-fabric serve`'s config, and the role configs it derives for every process it starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from fabric.config import (
    COLLAPSE_ONTO,
    AttentionWorkerConfig,
    CheckpointStoreConfig,
    ExpertWorkerConfig,
    GatewayConfig,
    OrchestratorConfig,
    RoleConfig,
    WeightStoreConfig,
    WorkerConfig,
)
from fabric.config_fields import (
    SCHED_POLICIES,
    check_cpu_latency,
    check_device,
    check_kernel,
    check_port,
    check_probes,
    like,
    opt,
)
from fabric.errors import ConfigError
from fabric.messages.control import Role

# a role -> the ServeConfig field with its Ray resources
RESOURCE_FIELDS = {Role.ORCHESTRATOR: "orchestrator_resources", Role.GATEWAY: "gateway_resources",
                   Role.ATTENTION: "aw_resources", Role.EXPERT: "ew_resources", Role.STORE: "store_resources"}


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = opt(None, "checkpoint directory (default: a cached demo model)")
    attention_workers: int = opt(2, "attention workers")
    expert_workers: int = opt(2, "expert workers")
    gateways: int = opt(2, "gateway processes sharing the HTTP port (a dead one costs only its connections)")
    checkpoint_stores: int = opt(1, "KV checkpoint stores (0: AW deaths replay)")
    weight_store: bool = opt(True, "read the checkpoint once into host memory (a weight-store process) and have every "
                                   "worker map its weights from there: replacements and standbys map theirs in "
                                   "milliseconds (--cluster local; on Ray every worker reads the checkpoint)")
    compute: str = like(WorkerConfig, "compute")
    sim_attention_ms: float = like(AttentionWorkerConfig, "sim_attention_ms")
    sim_expert_ms: float = like(ExpertWorkerConfig, "sim_expert_ms")
    standby_workers: int = opt(0, "warm standbys of each worker role (AW and EW; --cluster local): started, "
                                  "registered, weights mapped ahead from the weight store, serving nothing; a death wakes one and a new one "
                                  "boots behind it")
    transport: str = like(RoleConfig, "transport")
    host: str = opt("127.0.0.1", "address every process listens on")
    port: int = opt(8000, "the gateways' HTTP port")
    orchestrator_port: int = opt(0, "the orchestrator's port (0: a free one, kept across its restarts)")
    dtype: str | None = like(WorkerConfig, "dtype")
    device: str = like(WorkerConfig, "device")
    kernel: str = like(WorkerConfig, "kernel")
    gather: str = like(ExpertWorkerConfig, "gather")
    collapse_below_us: float | None = like(AttentionWorkerConfig, "collapse_below_us")
    collapse_onto: str = opt("auto", "where collapsed layers go when several EWs hold copies of every expert of them "
                                     "(as serve places two EWs): turns = each such EW every Nth layer; one = every "
                                     "layer to the first, so that fewer processes take turns on the CPUs; auto = one "
                                     "where this machine's CPUs (that this command may use) are fewer than the AWs and "
                                     "EWs serving (--cluster local), else turns",
                             choices=("auto", *COLLAPSE_ONTO))
    shadows_per_expert: int = like(OrchestratorConfig, "shadows_per_expert")
    balance_interval_s: float = like(OrchestratorConfig, "balance_interval_s")
    hot_expert_factor: float = like(OrchestratorConfig, "hot_expert_factor")
    served_model_name: str | None = like(GatewayConfig, "served_model_name")
    api_key: str | None = like(GatewayConfig, "api_key")
    max_waiting: int = opt(512, "requests waiting for their first token beyond this get 429 (per gateway)")
    drain_timeout: float = like(GatewayConfig, "drain_timeout")
    routing: str = like(GatewayConfig, "routing")
    resume: str = like(GatewayConfig, "resume")
    stream_resume_grace_s: float = like(GatewayConfig, "stream_resume_grace_s")
    public_metrics: bool = like(GatewayConfig, "public_metrics")
    provisioner: str = opt("auto", "replace every worker that dies with a new process, started by this command "
                                   "(local: on this machine; ray: on a healthy node with free resources); none: don't",
                           choices=("auto", "none"))
    cluster: str = opt("local", "where the processes run: local = children of this command on this machine; ray = "
                                "each its own process on a node of a Ray cluster, placed by failure domain (pip "
                                "install 'moe-fabric[ray]')", choices=("local", "ray"))
    ray_address: str | None = opt(None, "the Ray cluster to run on (default: $RAY_ADDRESS, else a Ray started on this "
                                        "machine for this run)", metavar="ADDR")
    orchestrator_resources: str = opt("{}", "Ray resources the orchestrator takes on its node (JSON)", metavar="JSON")
    gateway_resources: str = opt("{}", "Ray resources each gateway takes (JSON)", metavar="JSON")
    aw_resources: str = opt("{}", "Ray resources each attention worker takes (JSON; with --device cuda, GPU is 1 "
                                  "unless given)", metavar="JSON")
    ew_resources: str = opt("{}", "Ray resources each expert worker takes (JSON; with --device cuda, GPU is 1 "
                                  "unless given)", metavar="JSON")
    store_resources: str = opt("{}", "Ray resources each checkpoint store takes (JSON)", metavar="JSON")
    checkpoint: str = like(AttentionWorkerConfig, "checkpoint")
    checkpoint_steps_per_message: int = like(AttentionWorkerConfig, "checkpoint_steps_per_message")
    max_batch_tokens: int = like(AttentionWorkerConfig, "max_batch_tokens")
    cuda_graphs: int = like(AttentionWorkerConfig, "cuda_graphs")
    expert_cuda_graphs: int = like(ExpertWorkerConfig, "cuda_graphs")
    probe_interval_ms: float = like(AttentionWorkerConfig, "probe_interval_ms")
    probe_misses: int = like(AttentionWorkerConfig, "probe_misses")
    send_timeout_ms: float = like(RoleConfig, "send_timeout_ms")
    cpu_latency_us: int = like(RoleConfig, "cpu_latency_us")
    pin_workers: bool = opt(False, "pin attention worker i and expert worker i to CPU i (--cluster local; modulo the "
                                   "CPUs this command may use; a replacement takes a dead one's CPU, standbys float): "
                                   "where a step's attention and expert halves take turns on few cores, two AWs or "
                                   "two EWs then never wait for one core: on 2 cores 1.07x tok/s at 16 streams, but "
                                   "0.91x at 64, where a worker kept off the other core waits behind the gateways; "
                                   "run it on CPUs no other busy process shares, e.g. under taskset: a pinned worker "
                                   "that a neighbour keeps off its core past the lease is declared dead)")
    fork_server: bool = opt(True, "start the role processes forked from one that has imported torch (--cluster local, "
                                  "Linux): a process starts in a fraction of a second instead of importing torch "
                                  "itself (seconds of CPU each); off: each is a fresh `python -m launch.cli`")
    sched: str = opt("auto", "CPU scheduling policy of the serving processes (batch: a woken peer does not preempt "
                             "the sender; auto: batch over tcp)", choices=SCHED_POLICIES)
    restart_delay_s: float = opt(0.5, "a dead orchestrator or gateway is started again after this (doubling while it "
                                      "keeps dying young, up to 10 s)")
    watchdog_s: float = opt(2.0, "an orchestrator or gateway whose event loop is silent this long is hung: killed and "
                                 "started again (0: no watchdog)")
    recovery_grace_s: float = like(OrchestratorConfig, "recovery_grace_s")
    restart_boot_nice: int = opt(10, "a restarted orchestrator or gateway boots this much nicer (0..19; 20: the idle "
                                     "class), so its start-up takes little CPU from the serving workers")
    ready_timeout: float = opt(300.0, "seconds start-up may take")
    cluster_secret_file: str | None = opt(None, "the cluster secret every process proves on every internal connection "
                                                "and admin endpoint (a 0600 file, created if missing; default: a fresh "
                                                "one for this run, removed when it ends)", metavar="PATH")
    auth: bool = opt(True, "authenticate every internal connection with the cluster secret (--no-auth: nobody proves "
                           "anything; loopback only, for comparisons)")
    tls_cert: str | None = like(RoleConfig, "tls_cert")
    tls_key: str | None = like(RoleConfig, "tls_key")

    def __post_init__(self) -> None:
        if not self.auth and self.cluster_secret_file:
            raise ConfigError("--no-auth and --cluster-secret-file contradict each other")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.attention_workers < 1 or self.expert_workers < 1 or self.gateways < 1:
            raise ConfigError("serve needs at least one attention worker, one expert worker and one gateway")
        if self.provisioner not in ("none", "auto"):
            raise ConfigError(f"unknown provisioner {self.provisioner!r}; choose auto or none")
        if self.cluster not in ("local", "ray"):
            raise ConfigError(f"unknown cluster {self.cluster!r}; choose local or ray")
        if self.ray_address is not None and self.cluster != "ray":
            raise ConfigError("--ray-address is for --cluster ray")
        if self.collapse_onto not in ("auto", *COLLAPSE_ONTO):
            raise ConfigError(f"unknown collapse_onto {self.collapse_onto!r}; choose auto, {', '.join(COLLAPSE_ONTO)}")
        check_device(self.device)
        check_kernel(self.kernel)
        if self.pin_workers and self.cluster != "local":
            raise ConfigError("--pin-workers is for --cluster local")
        if self.standby_workers < 0 or (self.standby_workers and self.cluster != "local"):
            raise ConfigError("standby_workers must be >= 0, and standbys run with --cluster local only (for now)")
        for role in RESOURCE_FIELDS.values():
            self.resources(role)  # checks the JSON
        if self.cluster == "ray" and self.device != "cpu":
            if self.device != "cuda":
                raise ConfigError(f"--cluster ray --device {self.device}: Ray picks each worker's GPU (it is the worker's "
                                  "cuda:0, by CUDA_VISIBLE_DEVICES); say --device cuda")
            if any(self.resources(f)["GPU"] <= 0 for f in ("aw_resources", "ew_resources")):
                raise ConfigError("--cluster ray --device cuda: every worker needs a share of a GPU from Ray "
                                  "(--aw-resources / --ew-resources '{\"GPU\": ...}' > 0; 1 unless given)")
        check_probes(self.probe_interval_ms, self.probe_misses)
        if self.checkpoint_stores < 0 or self.checkpoint not in ("incremental", "pause", "off"):
            raise ConfigError("checkpoint_stores must be >= 0 and checkpoint incremental, pause or off")
        if self.max_batch_tokens < 1:
            raise ConfigError("max_batch_tokens must be >= 1")
        check_port(self.port, "port")
        check_port(self.orchestrator_port, "orchestrator_port")
        if self.sched not in SCHED_POLICIES:
            raise ConfigError(f"unknown scheduling policy {self.sched!r}; choose auto, batch or normal")
        check_cpu_latency(self.cpu_latency_us)
        if not 0 <= self.restart_boot_nice <= 20:
            raise ConfigError("restart_boot_nice must be in 0..20")
        if self.restart_delay_s < 0 or self.watchdog_s < 0 or self.recovery_grace_s < 0 or self.send_timeout_ms <= 0:
            raise ConfigError("restart_delay_s, watchdog_s and recovery_grace_s must be >= 0, send_timeout_ms > 0")

    def resources(self, field_name: str) -> dict[str, float]:
        """A role's Ray resources, checked. `field_name` is one of RESOURCE_FIELDS' values."""
        text = getattr(self, field_name)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--{field_name.replace('_', '-')}: not JSON ({exc.msg}): {text!r}") from None
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e9
                for k, v in value.items()):
            raise ConfigError(f"--{field_name.replace('_', '-')}: expected an object of resource name to amount >= 0, "
                              f"e.g. '{{\"GPU\": 1}}', got {text!r}")
        resources = {k: float(v) for k, v in value.items()}
        if self.cluster == "ray" and self.device != "cpu" and field_name in ("aw_resources", "ew_resources"):
            resources.setdefault("GPU", 1.0)  # Ray hands a GPU worker a GPU, 1 unless given
        return resources

    @property
    def resolved_collapse_onto(self) -> str:
        """`collapse_onto` with auto resolved: one where the AWs and EWs that serve here outnumber the CPUs this command
        may use (on 2 cores, 2 AW + 2 EW with no compute: 0.91x / 0.93x / 0.88x the time a layer at 1 / 16 / 64
        streams, docs/performance.md), else turns, which spread the layers where each worker has a core."""
        if self.collapse_onto != "auto":
            return self.collapse_onto
        local = self.cluster == "local"
        return "one" if local and self.attention_workers + self.expert_workers > _usable_cpus() else "turns"

    @property
    def store_kernel(self) -> str:
        """The layout the weight store publishes, which is the workers'.

        It is the CPU kernels' packing only where they run on the CPU."""
        return self.kernel if self.device == "cpu" or self.kernel != "auto" else "torch"

    def role_configs(self, model: str, transport: str, orchestrator_port: int, supervisor_pid: int,
                     secret_file: str | None, weight_store_dir: str | None = None) -> RoleConfigs:
        """Every role's config, as this `serve` runs them.

        `transport` is resolved, so all agree. Workers map their weights from `weight_store_dir`
        where given."""
        orch = f"{self.host}:{orchestrator_port}"
        common: dict[str, Any] = dict(model=model, orchestrator=orch, host=self.host, transport=transport, sched=self.sched,
                      send_timeout_ms=self.send_timeout_ms, cpu_latency_us=self.cpu_latency_us, watch_pid=supervisor_pid,
                      cluster_secret_file=secret_file, tls_cert=self.tls_cert, tls_key=self.tls_key)
        probes: dict[str, Any] = dict(probe_interval_ms=self.probe_interval_ms, probe_misses=self.probe_misses)
        workers: dict[str, Any] = dict(dtype=self.dtype, weight_store=weight_store_dir, compute=self.compute,
                                       device=self.device, kernel=self.kernel)
        return RoleConfigs(
            orchestrator=OrchestratorConfig(
                model=model, expert_workers=self.expert_workers, host=self.host, port=orchestrator_port,
                shadows_per_expert=self.shadows_per_expert, balance_interval_s=self.balance_interval_s,
                hot_expert_factor=self.hot_expert_factor,
                provisioner="supervisor" if self.provisioner == "auto" else "none",
                supervisor_fd=0 if self.provisioner == "auto" else None,  # the real fd is known at spawn time
                recovery_grace_s=self.recovery_grace_s, watch_pid=supervisor_pid, cluster_secret_file=secret_file,
                tls_cert=self.tls_cert, tls_key=self.tls_key),
            expert=ExpertWorkerConfig(**common, **workers, gather=self.gather, sim_expert_ms=self.sim_expert_ms,
                                      cuda_graphs=self.expert_cuda_graphs),
            attention=AttentionWorkerConfig(**common, **workers, checkpoint=self.checkpoint,
                                            checkpoint_steps_per_message=self.checkpoint_steps_per_message,
                                            max_batch_tokens=self.max_batch_tokens, cuda_graphs=self.cuda_graphs,
                                            sim_attention_ms=self.sim_attention_ms,
                                            collapse_below_us=self.collapse_below_us,
                                            collapse_onto=self.resolved_collapse_onto, **probes),
            store=CheckpointStoreConfig(**common),
            gateway=GatewayConfig(  # the API key travels in the environment: `ps` shows flags
                **common, port=self.port, reuse_port=self.gateways > 1,
                served_model_name=self.served_model_name, max_waiting=self.max_waiting,
                drain_timeout=self.drain_timeout, routing=self.routing, resume=self.resume,
                stream_resume_grace_s=self.stream_resume_grace_s, public_metrics=self.public_metrics, **probes),
            weight_store=WeightStoreConfig(model=model, dir=weight_store_dir, dtype=self.dtype, remove_on_exit=True,
                                           kernel=self.store_kernel, watch_pid=supervisor_pid)
            if weight_store_dir else None,
        )


@dataclass(frozen=True)
class RoleConfigs:
    orchestrator: OrchestratorConfig
    expert: ExpertWorkerConfig
    attention: AttentionWorkerConfig
    store: CheckpointStoreConfig
    gateway: GatewayConfig
    weight_store: WeightStoreConfig | None


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
