"""Frozen per-role configs. CLI flags map 1:1 onto these fields (see fabric/cli.py); the launcher
gives each spawned process its own copy via `dataclasses.replace`."""

from __future__ import annotations

from dataclasses import dataclass

from fabric.errors import ConfigError


def parse_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _check_probes(interval_ms: float, misses: int) -> None:
    if interval_ms < 0 or misses < 1:
        raise ConfigError("probe_interval_ms must be >= 0 (0 turns probing off) and probe_misses >= 1")


def _check_boot_nice(nice: int, name: str) -> None:
    if not 0 <= nice <= 20:
        raise ConfigError(f"{name} must be in 0..20 (20: the idle class), got {nice}")


SCHED_POLICIES = ("auto", "batch", "normal")


def _check_port(port: int, name: str) -> None:
    if not 0 <= port < 65536:
        raise ConfigError(f"{name} must be in 0..65535 (0 = any free port), got {port}")


def auto_sched(transport: str) -> str:
    """What `--sched auto` means for a transport: `batch` over tcp (a woken peer does not preempt
    the sender: an EW's send took 0.37 ms in the normal class, 0.13 ms in SCHED_BATCH) and
    `normal` otherwise, as `auto` transport picks ucx on RDMA hosts, whose cores are not shared
    like this VM's. Over ucx here the two classes were within noise of each other (16 streams,
    side by side: normal 0.89x and 0.96x transformers' tokens/s in two runs, batch 0.84x and 1.05x)."""
    return "batch" if transport == "tcp" else "normal"


@dataclass(frozen=True)
class RoleConfig:
    """Fields every role that registers with the orchestrator shares."""

    model: str
    orchestrator: str
    host: str = "127.0.0.1"
    port: int = 0
    transport: str = "tcp"
    parent_pid: int | None = None
    boot_nice: int = 0  # start-up work (imports, weight loading) runs this much nicer: replacements boot in the background
    sched: str = "auto"  # CPU scheduling policy: "batch" (a woken peer does not preempt it), "normal", or "auto" (see sched_policy)

    def __post_init__(self) -> None:
        parse_hostport(self.orchestrator)
        _check_port(self.port, "port")
        if self.transport not in ("tcp", "ucx", "auto"):
            raise ConfigError(f"unknown transport {self.transport!r}")
        _check_boot_nice(self.boot_nice, "boot_nice")
        if self.sched not in SCHED_POLICIES:
            raise ConfigError(f"unknown scheduling policy {self.sched!r}; choose auto, batch or normal")

    @property
    def orchestrator_addr(self) -> tuple[str, int]:
        return parse_hostport(self.orchestrator)

    @property
    def sched_policy(self) -> str:
        return auto_sched(self.transport) if self.sched == "auto" else self.sched


@dataclass(frozen=True)
class WorkerConfig(RoleConfig):
    """Fields the attention and expert workers share."""

    dtype: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads < 1:
            raise ConfigError("threads must be >= 1")


@dataclass(frozen=True)
class ExpertWorkerConfig(WorkerConfig):
    gather: str = "sync"  # "sync": wait for every active AW; "threshold": min batch or max wait
    min_batch_tokens: int = 1
    max_wait_ms: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gather not in ("sync", "threshold"):
            raise ConfigError(f"unknown gather policy {self.gather!r}; choose sync or threshold")
        if self.max_wait_ms < 0 or self.min_batch_tokens < 1:
            raise ConfigError("max_wait_ms must be >= 0 and min_batch_tokens >= 1")


@dataclass(frozen=True)
class AttentionWorkerConfig(WorkerConfig):
    block_size: int = 16
    kv_cache_mib: int = 256
    max_batch_tokens: int = 512  # token budget of one step (chunked prefill + decodes)
    max_running: int = 64
    probe_interval_ms: float = 10.0  # a silent EW link with calls in flight is probed this often (0: off)
    probe_misses: int = 3  # unanswered probes before the EW is declared dead
    expert_wait_s: float = 30.0  # how long a step waits for a replacement when every copy of an expert is gone
    checkpoint: str = "incremental"  # KV checkpoints to the store: "incremental", "pause" (baseline) or "off"
    checkpoint_pause_every: int = 8  # steps between full copies in "pause" mode
    restore_join_ms: float = 50.0  # a step waits this long at most for restores already under way

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1 or self.kv_cache_mib < 1 or self.max_batch_tokens < 1 or self.max_running < 1:
            raise ConfigError("block_size, kv_cache_mib, max_batch_tokens and max_running must be >= 1")
        _check_probes(self.probe_interval_ms, self.probe_misses)
        if self.expert_wait_s < 0 or self.restore_join_ms < 0:
            raise ConfigError("expert_wait_s and restore_join_ms must be >= 0")
        if self.checkpoint not in ("incremental", "pause", "off") or self.checkpoint_pause_every < 1:
            raise ConfigError("checkpoint must be incremental, pause or off, and checkpoint_pause_every >= 1")


@dataclass(frozen=True)
class CheckpointStoreConfig(RoleConfig):
    bucket_mib: int = 1024  # host memory per AW bucket
    orphan_ttl_s: float = 60.0  # a dead AW's bucket is dropped this long after its death

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_mib < 1 or self.orphan_ttl_s < 0:
            raise ConfigError("bucket_mib must be >= 1 and orphan_ttl_s >= 0")


@dataclass(frozen=True)
class GatewayConfig(RoleConfig):
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    max_waiting: int = 512  # requests waiting for their first token before new ones get 429
    drain_timeout: float = 30.0
    routing: str = "least-work"  # or "round-robin"
    resume: str = "restore"  # a dead AW's requests: "restore" from the store, or replay ("parallel", "sequential")
    probe_interval_ms: float = 10.0  # an AW with requests in flight and a silent link is probed this often (0: off)
    probe_misses: int = 3  # unanswered probes before the AW is declared dead

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_probes(self.probe_interval_ms, self.probe_misses)
        if self.resume not in ("restore", "parallel", "sequential"):
            raise ConfigError(f"unknown resume mode {self.resume!r}; choose restore, parallel or sequential")
        if self.max_body_bytes < 1024 or self.max_waiting < 1 or self.drain_timeout < 0:
            raise ConfigError("max_body_bytes must be >= 1024, max_waiting >= 1 and drain_timeout >= 0")
        if self.routing not in ("least-work", "round-robin"):
            raise ConfigError(f"unknown routing policy {self.routing!r}; choose least-work or round-robin")
        if self.api_key == "":
            raise ConfigError("an empty API key would accept any request; omit it instead")


@dataclass(frozen=True)
class OrchestratorConfig:
    model: str
    expert_workers: int
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    shadows_per_expert: int = 1  # inactive copies of each expert on other EWs
    provisioner: str = "none"  # "local": start a replacement subprocess for every dead worker
    spawn_attention_args: str = ""  # `moe-fabric attention-worker` flags for replacements (shell words)
    spawn_expert_args: str = ""  # `moe-fabric expert-worker` flags for replacements (shell words)
    spawn_store_args: str = ""  # `moe-fabric checkpoint-store` flags for replacements (shell words)
    spawn_log_dir: str | None = None  # where replacements write their logs (default: inherit stderr)
    max_replacements: int = 16  # replacements started over the cluster's life (a crash-loop guard)
    replacement_boot_nice: int = 20  # replacements boot (imports, weights) nicer than the serving workers; 20: idle class
    replacement_delay_ms: float = 500.0  # a replacement starts this long after the death: recovery gets the CPU first
    confirm_timeout_ms: float = 250.0  # a worker reported dead is declared dead if it does not answer within this
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        _check_port(self.port, "port")
        if self.expert_workers < 1:
            raise ConfigError("the cluster needs at least one expert worker")
        if self.shadows_per_expert < 0:
            raise ConfigError("shadows_per_expert must be >= 0")
        if self.provisioner not in ("none", "local"):
            raise ConfigError(f"unknown provisioner {self.provisioner!r}; choose none or local")
        if self.max_replacements < 0 or self.confirm_timeout_ms <= 0 or self.replacement_delay_ms < 0:
            raise ConfigError("max_replacements and replacement_delay_ms must be >= 0, confirm_timeout_ms > 0")
        _check_boot_nice(self.replacement_boot_nice, "replacement_boot_nice")


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    attention_workers: int = 2
    expert_workers: int = 2
    transport: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    orchestrator_port: int = 0
    dtype: str | None = None
    gather: str = "sync"
    shadows_per_expert: int = 1
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting: int = 512
    drain_timeout: float = 30.0
    routing: str = "least-work"
    ready_timeout: float = 300.0
    provisioner: str = "local"  # replace dead workers ("none": don't)
    checkpoint_stores: int = 1  # KV checkpoint stores (0: none; AW deaths then replay)
    checkpoint: str = "incremental"  # the AWs' checkpointing: incremental, pause (baseline) or off
    resume: str = "restore"  # how a dead AW's requests resume: restore, or replay (parallel, sequential)
    probe_interval_ms: float = 10.0  # AW->EW and gateway->AW liveness probes (0: off)
    probe_misses: int = 3
    sched: str = "auto"  # CPU scheduling policy of the workers, the store and the gateway (not the orchestrator)

    def __post_init__(self) -> None:
        if self.attention_workers < 1 or self.expert_workers < 1:
            raise ConfigError("serve needs at least one attention worker and one expert worker")
        if self.provisioner not in ("none", "local"):
            raise ConfigError(f"unknown provisioner {self.provisioner!r}; choose none or local")
        _check_probes(self.probe_interval_ms, self.probe_misses)
        if self.checkpoint_stores < 0 or self.checkpoint not in ("incremental", "pause", "off"):
            raise ConfigError("checkpoint_stores must be >= 0 and checkpoint incremental, pause or off")
        _check_port(self.port, "port")
        _check_port(self.orchestrator_port, "orchestrator_port")
        if self.sched not in SCHED_POLICIES:
            raise ConfigError(f"unknown scheduling policy {self.sched!r}; choose auto, batch or normal")
