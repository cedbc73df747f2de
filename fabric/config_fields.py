"""What the configs of fabric/config.py are made of: field constructors (`opt`, `req`, `like`),
parsers and checks of flag values, and the help texts several roles' flags share.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Any

from fabric.errors import ConfigError

TRANSPORTS = ("tcp", "ucx", "auto")
SCHED_POLICIES = ("auto", "batch", "normal")


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, metavar: str | None = None,
        hidden: bool = False) -> Any:
    """A config field with what its command-line flag needs. `hidden`: not in --help (a launcher's)."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar, "hidden": hidden})


def like(cls: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """The field `name` of config `cls` again (its default unless given, and its flag's help), for
    a config that passes it on: `serve`'s flags are its roles' flags."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=f.default if default is dataclasses.MISSING else default, metadata=f.metadata)


def req(help: str, *, metavar: str | None = None) -> Any:
    """A required config field (a required flag)."""
    return field(metadata={"help": help, "metavar": metavar})


KERNELS = ("auto", "torch", "triton")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ConfigError(f"unknown kernel {kernel!r}; choose {', '.join(KERNELS)}")


def check_device(spec: str) -> None:
    """`--device`: cpu, cuda or cuda:N (fabric/device.py resolves it when the worker starts)."""
    if not DEVICE.fullmatch(spec):
        raise ConfigError(f"unknown device {spec!r}; choose cpu, cuda or cuda:N")


def parse_cpus(value: str) -> set[int]:
    """A CPU list as `taskset -c` takes it ("0", "0,2", "0-3,6") -> the CPU numbers."""
    cpus: set[int] = set()
    for part in value.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ConfigError(f"expected a CPU list such as 0 or 0,2 or 0-3, got {value!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def check_probes(interval_ms: float, misses: int) -> None:
    if interval_ms < 0 or misses < 1:
        raise ConfigError("probe_interval_ms must be >= 0 (0 turns probing off) and probe_misses >= 1")


def check_boot_nice(nice: int, name: str) -> None:
    if not 0 <= nice <= 20:
        raise ConfigError(f"{name} must be in 0..20 (20: the idle class), got {nice}")


def check_cpu_latency(us: int) -> None:
    if us < -1:
        raise ConfigError(f"cpu_latency_us must be >= 0 (µs), or -1 to ask nothing, got {us}")


def check_port(port: int, name: str) -> None:
    if not 0 <= port < 65536:
        raise ConfigError(f"{name} must be in 0..65535 (0 = any free port), got {port}")


def auto_sched(transport: str) -> str:
    """What `--sched auto` means for a transport: `batch` over tcp (a woken peer does not preempt
    the sender: an EW's send took 0.37 ms in the normal class, 0.13 ms in SCHED_BATCH) and
    `normal` otherwise, as `auto` transport picks ucx on RDMA hosts, whose cores are not shared
    like this VM's. Over ucx here the two classes were within noise of each other (16 streams,
    side by side: normal 0.89x and 0.96x transformers' tokens/s in two runs, batch 0.84x and 1.05x)."""
    return "batch" if transport == "tcp" else "normal"


PROBE_INTERVAL_HELP = "probe a peer that is silent with work in flight this often (0: no probes)"
PROBE_MISSES_HELP = "unanswered probes before the peer is suspected and routed around (the orchestrator says who is dead)"
SECRET_HELP = ("file holding the cluster secret (mode 0600) that every internal connection proves; default: "
               "$MOE_FABRIC_CLUSTER_SECRET; with neither, nothing is authenticated and only loopback is allowed")
TLS_CERT_HELP = "the cluster's TLS certificate (PEM): TCP links and HTTP servers use TLS (not with --transport ucx)"
TLS_KEY_HELP = "the TLS certificate's private key (PEM)"
CPU_LATENCY_HELP = ("while serving, ask the kernel that idle CPUs wake within this many µs (PM QoS, "
                    "/dev/cpu_dma_latency: root, or a udev rule that lets this user write it): 0 keeps them polling, "
                    "the quickest to run a woken peer (docs/performance.md), at the cost of power (a VM's host sees "
                    "its vCPUs busy); -1 asks nothing")
SEND_TIMEOUT_HELP = ("a peer that does not drain what this process sends for this long loses that connection "
                     "and is routed around (a stuck reader answers probes but blocks its senders)")
