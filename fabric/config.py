"""Frozen per-role configs, written once: every field is a command-line flag of its role's
subcommand (`--field-name`, derived by `launch/flags.py` from the field's type, default and
`opt(...)` metadata), and a launcher passes a child its config as the flags that differ from the
defaults (`launch.flags.to_argv`). Validation lives in `__post_init__`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fabric.auth import load_secret
from fabric.config_fields import (
    CPU_LATENCY_HELP,
    KERNELS,
    PROBE_INTERVAL_HELP,
    PROBE_MISSES_HELP,
    SCHED_POLICIES,
    SECRET_HELP,
    SEND_TIMEOUT_HELP,
    TLS_CERT_HELP,
    TLS_KEY_HELP,
    TRANSPORTS,
    auto_sched,
    check_boot_nice,
    check_cpu_latency,
    check_device,
    check_kernel,
    check_port,
    check_probes,
    like,
    opt,
    parse_cpus,
    parse_hostport,
    req,
)
from fabric.errors import ConfigError
from fabric.tls import Tls

COLLAPSE_ONTO = ("turns", "one")  # an AW's collapsed layers: attention_worker/collapse.py, `layer_targets`


@dataclass(frozen=True)
class RoleConfig:
    """Fields every role that registers with the orchestrator shares."""

    model: str = req("Hugging Face checkpoint directory")
    orchestrator: str = req("the orchestrator's address", metavar="HOST:PORT")
    orchestrator_file: str | None = opt(None, "a file holding the orchestrator's HOST:PORT, read again before every "
                                              "connection to it (a cluster manager rewrites it when the orchestrator "
                                              "moves to another machine); --orchestrator until it exists",
                                        metavar="PATH")
    host: str = opt("127.0.0.1", "address to listen on and to advertise")
    port: int = opt(0, "port to listen on (0: any free port)")
    advertise_port: int = opt(0, "the port peers dial to reach this worker, where it is not the one it listens on "
                                 "(a port forward, a proxy in front of it; 0: that one)")
    control_port: int = opt(0, "the port of this worker's control channel: peers' probes and the like, served apart "
                               "from its compute (0: any free port)")
    advertise_control_port: int = opt(0, "the control port peers dial, where it is not the one bound (0: that one)")
    transport: str = opt("auto", "the AW/EW/store/gateway transport (auto: ucx where UCX finds RDMA, else tcp)",
                         choices=TRANSPORTS)
    boot_nice: int = opt(0, "run start-up (imports, weight loading) this much nicer, 0..19, or 20: in the idle class "
                            "(replacements boot with 20)")
    sched: str = opt("auto", "CPU scheduling policy (Linux): batch = a peer this process wakes does not preempt it "
                             "mid-send; normal = the kernel's default; auto = batch with --transport tcp, else normal",
                     choices=SCHED_POLICIES)
    cpu_latency_us: int = opt(0, CPU_LATENCY_HELP)
    send_timeout_ms: float = opt(1000.0, SEND_TIMEOUT_HELP)
    cluster_secret_file: str | None = opt(None, SECRET_HELP, metavar="PATH")
    tls_cert: str | None = opt(None, TLS_CERT_HELP, metavar="PATH")
    tls_key: str | None = opt(None, TLS_KEY_HELP, metavar="PATH")
    watch_pid: int | None = opt(None, "exit as soon as this process (the supervisor) is gone", hidden=True)

    def __post_init__(self) -> None:
        parse_hostport(self.orchestrator)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        for name in ("port", "advertise_port", "control_port", "advertise_control_port"):
            check_port(getattr(self, name), name)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r}")
        check_boot_nice(self.boot_nice, "boot_nice")
        if self.sched not in SCHED_POLICIES:
            raise ConfigError(f"unknown scheduling policy {self.sched!r}; choose auto, batch or normal")
        if self.send_timeout_ms <= 0:
            raise ConfigError("send_timeout_ms must be > 0")
        check_cpu_latency(self.cpu_latency_us)

    @cached_property
    def secret(self) -> bytes | None:
        """The cluster secret (read once, on first use: a file is checked for its mode and length)."""
        return load_secret(self.cluster_secret_file)

    @cached_property
    def tls(self) -> Tls | None:
        """The cluster certificate (loaded once, on first use), or None: no TLS."""
        return Tls.of(self.tls_cert, self.tls_key)

    @property
    def orchestrator_addr(self) -> tuple[str, int]:
        """Where the orchestrator is now: the `orchestrator_file`'s address, else `orchestrator`."""
        if self.orchestrator_file is not None:
            try:
                text = Path(self.orchestrator_file).read_text().strip()
            except OSError:
                text = ""
            with contextlib.suppress(ConfigError):  # (half written: the next read has it)
                return parse_hostport(text)
        return parse_hostport(self.orchestrator)

    @property
    def sched_policy(self) -> str:
        return auto_sched(self.transport) if self.sched == "auto" else self.sched


@dataclass(frozen=True)
class WorkerConfig(RoleConfig):
    """Fields the attention and expert workers share."""

    dtype: str | None = opt(None, "compute dtype (default: the checkpoint's)", choices=("float32", "bfloat16"))
    threads: int = opt(1, "torch intra-op threads")
    kernel: str = opt("auto", "matmuls on the few rows of a decode step (expert FFNs; attention projections and "
                      "lm_head) and the AW's decode attention over its paged KV cache: auto (on the CPU the fabric's "
                      "kernels for fp32 where the CPU has AVX2 or AVX-512 and they build, else torch; on a GPU "
                      "Triton's for the EW's fp32 experts and, with CUDA graphs, the AW's decode attention), torch, or "
                      "triton (the EW's fused MoE and the AW's paged decode attention in Triton: on a CUDA device, "
                      "or on the CPU under TRITON_INTERPRET=1, for tests)", choices=KERNELS)
    weight_store: str | None = opt(None, "map weights from this host's weight store (`moe-fabric weight-store --dir`) "
                                         "instead of reading the checkpoint; read it where the store has another "
                                         "model or layout", metavar="DIR")
    weight_store_wait_s: float = opt(300.0, "at start-up, wait this long for a weight store still being built")
    compute: str = opt("model", "model: the checkpoint's math; sim: a cost model instead of the tensor math (no weights "
                                "read; a config.json is enough), everything else as in production", choices=("model", "sim"))
    standby: bool = opt(False, "start as a warm standby: imported, registered, weights mapped ahead, serving nothing until the "
                               "orchestrator wakes it to replace a dead worker")
    step_timeout_s: float = opt(60.0, "a compute call (an AW's step, an EW's batch), or anything else, that blocks the worker's "
                                      "data loop longer than this is a wedged device or a bug: the worker stops and the fabric replaces it (0: never); a slow "
                                      "step below it is not a failure, whatever it costs")
    device: str = opt("cpu", "where weights, the KV cache and the compute live: cpu, cuda or cuda:N (the wire and the "
                             "checkpoint store stay in host memory; serve --device cuda hands worker i GPU i modulo "
                             "the GPUs visible)")
    cpus: str | None = opt(None, "run this worker (all its threads) on these CPUs only: a list as taskset -c takes it, "
                                 "e.g. 0 or 0-3 (serve --pin-workers sets it)", metavar="LIST")
    sim_workers: int = opt(1, "--compute sim: host this many workers in this one process, each with its own identity, "
                              "sockets and tasks (a deployment-scale simulation on a few cores)")
    sim_control: bool = opt(False, "read `kill WORKER_ID` lines on stdin: that worker dies as on SIGKILL (its sockets "
                                   "close, it says nothing); the scale experiment's fault injection", hidden=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads < 1:
            raise ConfigError("threads must be >= 1")
        if self.sim_workers < 1:
            raise ConfigError("sim_workers must be >= 1")
        if self.cpus is not None:
            parse_cpus(self.cpus)
        if self.sim_workers > 1 and (self.compute != "sim" or self.port != 0 or self.standby):
            raise ConfigError("--sim-workers > 1 needs --compute sim and --port 0 (each worker listens on a port of "
                              "its own), and no --standby")
        if self.weight_store_wait_s < 0 or self.step_timeout_s < 0:
            raise ConfigError("weight_store_wait_s and step_timeout_s must be >= 0")
        if self.compute not in ("model", "sim"):
            raise ConfigError(f"unknown compute {self.compute!r}; choose model or sim")
        check_kernel(self.kernel)
        check_device(self.device)
        if self.compute == "sim" and self.device != "cpu":
            raise ConfigError("--compute sim runs on the CPU: --device cpu")


@dataclass(frozen=True)
class ExpertWorkerConfig(WorkerConfig):
    gather: str = opt("sync", "sync: run when every active AW has delivered, unless the waits measured cost more "
                              "than the batches they save; threshold: a minimum batch or the wait",
                      choices=("sync", "threshold"))
    min_batch_tokens: int = opt(1, "threshold gather: rows a layer needs before it runs")
    max_wait_ms: float = opt(20.0, "the longest a call waits for the others of its batch")
    sim_expert_ms: float = opt(0.85, "--compute sim: what one layer's batch of experts costs (Tarragon: 0.85 ms)")
    sim_expert_row_us: float = opt(0.0, "--compute sim: and per row of that batch")
    cuda_graphs: int = opt(512, "on a GPU with --kernel triton, run one layer's batch of at most this many rows as a "
                                "CUDA graph (the fused kernel's launches as one, captured per layer and bucket of "
                                "rows on first use); 0: op by op")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gather not in ("sync", "threshold"):
            raise ConfigError(f"unknown gather policy {self.gather!r}; choose sync or threshold")
        if self.max_wait_ms < 0 or self.min_batch_tokens < 1:
            raise ConfigError("max_wait_ms must be >= 0 and min_batch_tokens >= 1")
        if self.sim_expert_ms < 0 or self.sim_expert_row_us < 0 or self.cuda_graphs < 0:
            raise ConfigError("sim_expert_ms, sim_expert_row_us and cuda_graphs must be >= 0")


@dataclass(frozen=True)
class AttentionWorkerConfig(WorkerConfig):
    block_size: int = opt(16, "tokens per KV-cache block")
    kv_cache_mib: int = opt(256, "KV cache size")
    max_batch_tokens: int = opt(512, "token budget of one step (chunked prefill + decodes)")
    max_running: int = opt(64, "requests decoding at once")
    probe_interval_ms: float = opt(10.0, PROBE_INTERVAL_HELP)
    probe_misses: int = opt(3, PROBE_MISSES_HELP)
    expert_wait_s: float = opt(30.0, "how long a step waits for a replacement when every copy of an expert is gone")
    collapse_below_us: float | None = opt(None, "send all of a layer's rows to one EW (the one holding copies of the "
                                                "most of its experts) while a layer's experts take less than this on "
                                                "the EWs (default: less than a call's own time, measured as it serves: "
                                                "its round trip less the EW's batch; 0: always spread them)",
                                          metavar="US")
    collapse_onto: str = opt("turns", "where collapsed layers go when several EWs hold copies of every expert of "
                                      "them: turns = each such EW every Nth layer; one = every layer to the first, so "
                                      "that fewer processes take turns on the CPUs (where the workers outnumber them)",
                             choices=COLLAPSE_ONTO)
    checkpoint: str = opt("incremental", "KV checkpoints to the checkpoint store (pause: the stop-copy-resume baseline)",
                          choices=("incremental", "pause", "off"))
    checkpoint_pause_every: int = opt(8, "steps between full copies with --checkpoint pause")
    checkpoint_steps_per_message: int = opt(4, "with --checkpoint incremental, send the KV of this many steps as one "
                                               "message (the checkpointed frontier then trails the live one by up "
                                               "to this many tokens, which a restore recomputes)")
    cuda_graphs: int = opt(64, "on a GPU, run a pure decode step of at most this many sequences as CUDA graphs (the "
                               "layers between two expert calls as one launch, captured on first use); they need a "
                               "paged decode attention: with --kernel auto it is then Triton's (--kernel torch: no "
                               "graphs); 0: op by op")
    restore_join_ms: float = opt(50.0, "a step waits at most this long for restores already under way (0: never)")
    sim_attention_ms: float = opt(0.85, "--compute sim: what one layer's attention costs a step")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1 or self.kv_cache_mib < 1 or self.max_batch_tokens < 1 or self.max_running < 1:
            raise ConfigError("block_size, kv_cache_mib, max_batch_tokens and max_running must be >= 1")
        check_probes(self.probe_interval_ms, self.probe_misses)
        if self.expert_wait_s < 0 or self.restore_join_ms < 0 or self.sim_attention_ms < 0 or self.cuda_graphs < 0:
            raise ConfigError("expert_wait_s, restore_join_ms, sim_attention_ms and cuda_graphs must be >= 0")
        if self.collapse_below_us is not None and not self.collapse_below_us >= 0:  # (not >=: NaN too)
            raise ConfigError(f"collapse_below_us must be >= 0, not {self.collapse_below_us}")
        if self.collapse_onto not in COLLAPSE_ONTO:
            raise ConfigError(f"collapse_onto must be one of {', '.join(COLLAPSE_ONTO)}, not {self.collapse_onto!r}")
        if self.checkpoint not in ("incremental", "pause", "off") or self.checkpoint_pause_every < 1 \
                or self.checkpoint_steps_per_message < 1:
            raise ConfigError("checkpoint must be incremental, pause or off, and checkpoint_pause_every and "
                              "checkpoint_steps_per_message >= 1")


@dataclass(frozen=True)
class WeightStoreConfig:
    model: str = req("Hugging Face checkpoint directory")
    dir: str = req("where to publish (a directory on /dev/shm: host memory)", metavar="DIR")
    dtype: str | None = like(WorkerConfig, "dtype")
    kernel: str = like(WorkerConfig, "kernel")
    remove_on_exit: bool = opt(False, "remove the store when this process stops (a `serve` run's own store)")
    boot_nice: int = opt(0, "read and publish this much nicer, 0..19, or 20: in the idle class")
    watch_pid: int | None = opt(None, "exit as soon as this process (the supervisor) is gone", hidden=True)

    def __post_init__(self) -> None:
        check_kernel(self.kernel)
        check_boot_nice(self.boot_nice, "boot_nice")


@dataclass(frozen=True)
class CheckpointStoreConfig(RoleConfig):
    bucket_mib: int = opt(1024, "host memory per attention worker")
    orphan_ttl_s: float = opt(60.0, "keep a dead AW's checkpoints this long")
    max_aws: int = opt(1024, "attention workers whose checkpoints the store keeps at most (a bucket each)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_mib < 1 or self.orphan_ttl_s < 0 or self.max_aws < 1:
            raise ConfigError("bucket_mib and max_aws must be >= 1 and orphan_ttl_s >= 0")


@dataclass(frozen=True)
class GatewayConfig(RoleConfig):
    port: int = opt(8000, "HTTP port")
    reuse_port: bool = opt(False, "share the HTTP port with other gateways (SO_REUSEPORT): a dead gateway costs only "
                                  "its own connections")
    served_model_name: str | None = opt(None, "the model's name in the API (default: the directory's name)")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1 (default: $MOE_FABRIC_API_KEY)")
    max_body_bytes: int = opt(8 << 20, "larger request bodies get 413")
    max_waiting: int = opt(512, "requests waiting for their first token beyond this get 429")
    drain_timeout: float = opt(30.0, "seconds SIGTERM waits for running requests")
    routing: str = opt("least-work", "how the gateway picks an attention worker", choices=("least-work", "round-robin"))
    resume: str = opt("restore", "how a dead AW's requests resume: from the checkpoint store, or by replay (baselines)",
                      choices=("restore", "parallel", "sequential"))
    stream_resume_grace_s: float = opt(10.0, "a stream whose client (or gateway) went away keeps running this long for "
                                             "a resume with Last-Event-ID, then is aborted")
    resume_wait_s: float = opt(30.0, "a request whose AW died waits this long for a live one")
    probe_interval_ms: float = opt(10.0, PROBE_INTERVAL_HELP)
    probe_misses: int = opt(3, PROBE_MISSES_HELP)
    public_metrics: bool = opt(False, "serve /metrics and /health's details without the cluster secret "
                                      "(/health's status is always public)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probes(self.probe_interval_ms, self.probe_misses)
        if self.resume not in ("restore", "parallel", "sequential"):
            raise ConfigError(f"unknown resume mode {self.resume!r}; choose restore, parallel or sequential")
        if self.max_body_bytes < 1024 or self.max_waiting < 1 or self.drain_timeout < 0:
            raise ConfigError("max_body_bytes must be >= 1024, max_waiting >= 1 and drain_timeout >= 0")
        if self.routing not in ("least-work", "round-robin"):
            raise ConfigError(f"unknown routing policy {self.routing!r}; choose least-work or round-robin")
        if self.api_key == "":
            raise ConfigError("an empty API key would accept any request; omit it instead")
        if self.stream_resume_grace_s < 0 or self.resume_wait_s < 0:
            raise ConfigError("stream_resume_grace_s and resume_wait_s must be >= 0")


@dataclass(frozen=True)
class OrchestratorConfig:
    model: str = req("Hugging Face checkpoint directory")
    expert_workers: int = req("EWs to wait for before placing experts")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(0, "port to listen on (0: any free port; a supervisor that restarts it passes a fixed one)")
    shadows_per_expert: int = opt(1, "inactive copies of each expert on other EWs")
    provisioner: str = opt("none", "who starts replacements: local = subprocesses on this host; supervisor = the "
                                   "process that started this one (moe-fabric serve)",
                           choices=("none", "local", "supervisor"))
    spawn_attention_args: str = opt("", "flags of `moe-fabric attention-worker` for local replacements (shell words)",
                                    metavar="ARGS")
    spawn_expert_args: str = opt("", "flags of `moe-fabric expert-worker` for local replacements (shell words)",
                                 metavar="ARGS")
    spawn_store_args: str = opt("", "flags of `moe-fabric checkpoint-store` for local replacements (shell words)",
                                metavar="ARGS")
    spawn_log_dir: str | None = opt(None, "local replacements' logs go here (default: stderr)")
    max_replacements: int = opt(16, "replacements started over this orchestrator's life (a crash-loop guard)")
    replacement_boot_nice: int = opt(20, "replacements boot this much nicer than the serving workers "
                                         "(0..19; 20: the idle class)")
    replacement_delay_ms: float = opt(500.0, "start a replacement this long after the death, once the survivors have "
                                             "taken over its work")
    lease_ms: float = opt(700.0, "a worker silent on its link to the orchestrator this long, a probe sent at half of "
                                 "it unanswered, is dead: a hung process, or a machine gone without closing its "
                                 "sockets; a pause shorter than the lease less a heartbeat is not a death (a worker "
                                 "not serving yet has 10 s)")
    heartbeat_ms: float = opt(150.0, "workers send a heartbeat to the orchestrator this often (from their event loop, "
                                     "which never waits on compute)")
    rejoin_grace_ms: float = opt(1000.0, "a worker whose link dropped is declared dead unless it registers again "
                                         "within this (a peer's report or a clean exit declares it at once)")
    recovery_grace_s: float = opt(3.0, "a (re)started orchestrator waits this long for workers of an earlier one to "
                                       "register again before it rebuilds the cluster from their reports")
    generation: int = opt(0, "this orchestrator's fencing token; workers follow no older one "
                             "(0: microseconds since the epoch, so a later start is newer)")
    boot_nice: int = opt(0, "run start-up (imports) this much nicer, 0..19, or 20: in the idle class "
                            "(a restarted orchestrator boots beside the serving workers)")
    balance_interval_s: float = opt(0.0, "expert load balancing: every this many seconds, while an EW serves more "
                                         "than --hot-expert-factor times the mean EW's rows, its hottest expert gets "
                                         "another of its copies serving at once, the rows spread over them (0: off)")
    hot_expert_factor: float = opt(1.5, "an EW is overloaded above this multiple of the mean EW load")
    cluster_secret_file: str | None = opt(None, SECRET_HELP, metavar="PATH")
    tls_cert: str | None = opt(None, TLS_CERT_HELP, metavar="PATH")
    tls_key: str | None = opt(None, TLS_KEY_HELP, metavar="PATH")
    supervisor_fd: int | None = opt(None, "socket to the supervisor that starts replacements", hidden=True)
    watch_pid: int | None = opt(None, "exit as soon as this process (the supervisor) is gone", hidden=True)

    def __post_init__(self) -> None:
        if self.balance_interval_s < 0 or self.hot_expert_factor < 1:
            raise ConfigError("balance_interval_s must be >= 0 and hot_expert_factor >= 1")
        check_port(self.port, "port")
        if self.expert_workers < 1:
            raise ConfigError("the cluster needs at least one expert worker")
        if self.shadows_per_expert < 0:
            raise ConfigError("shadows_per_expert must be >= 0")
        if self.provisioner not in ("none", "local", "supervisor"):
            raise ConfigError(f"unknown provisioner {self.provisioner!r}; choose none, local or supervisor")
        if self.provisioner == "supervisor" and self.supervisor_fd is None:
            raise ConfigError("--provisioner supervisor is for a supervisor that passes --supervisor-fd")
        if self.max_replacements < 0 or self.replacement_delay_ms < 0:
            raise ConfigError("max_replacements and replacement_delay_ms must be >= 0")
        if self.heartbeat_ms <= 0 or self.lease_ms < 3 * self.heartbeat_ms:
            raise ConfigError("heartbeat_ms must be > 0 and lease_ms at least 3 heartbeats")
        if self.rejoin_grace_ms < 0 or self.recovery_grace_s < 0 or self.generation < 0:
            raise ConfigError("rejoin_grace_ms, recovery_grace_s and generation must be >= 0")
        check_boot_nice(self.replacement_boot_nice, "replacement_boot_nice")
        check_boot_nice(self.boot_nice, "boot_nice")

    @cached_property
    def secret(self) -> bytes | None:
        return load_secret(self.cluster_secret_file)

    @cached_property
    def tls(self) -> Tls | None:
        return Tls.of(self.tls_cert, self.tls_key)

    @property
    def sched_policy(self) -> str:
        return "normal"  # the control plane is not on the datapath's wake-up chain
