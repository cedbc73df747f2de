"""The failover experiment's flags (`moe-fabric experiment failover --help`) and their checks."""

from __future__ import annotations

import argparse

from fabric.errors import ConfigError

VICTIMS = {"expert": "expert-worker-1", "attention": "attention-worker-0", "store": "checkpoint-store-0",
           "orchestrator": "orchestrator", "gateway": "gateway-0",
           "node": "attention-worker-0"}  # --cluster ray: the node of this one dies, with all it hosts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=list(VICTIMS), default="expert",
                   help="which process dies (node, with --cluster ray: the whole node of attention-worker-0)")
    p.add_argument("--cluster", choices=["local", "ray"], default="local",
                   help="ray: the fabric on a Ray cluster (--ray-address; default: three nodes on loopback)")
    p.add_argument("--ray-address", default=None, help="a Ray cluster to run on (default: a loopback one of 3 nodes)")
    p.add_argument("--node-of", default="attention-worker-0",
                   help="--role node: the process whose node dies (e.g. orchestrator, gateway-1)")
    p.add_argument("--at", type=float, default=5.0,
                   help="seconds into the failure run to send the signal (or, if no stream is decoding then, as soon "
                        "as one is)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds during which requests are issued")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default 4)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: C streams always in flight")
    p.add_argument("--signal", choices=["INT", "KILL", "STOP"], default="INT",
                   help="what the victim gets: SIGINT (the paper's), SIGKILL, or SIGSTOP (a hung process)")
    p.add_argument("--mode", choices=["fabric", "restart-all"], default="fabric")
    p.add_argument("--out", default=None, help="default: results/failover-<role>-<mode>")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the cached demo model)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--attention-workers", type=int, default=2)
    p.add_argument("--expert-workers", type=int, default=3)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--checkpoint-stores", type=int, default=1,
                   help="0: no KV checkpoints, a dead AW's streams resume by replay")
    p.add_argument("--transport", choices=["tcp", "ucx"], default="tcp", help="the fabric's transport")
    p.add_argument("--sched", choices=["auto", "batch", "normal"], default="auto", help="the workers' CPU scheduling class")
    p.add_argument("--replacement-delay-ms", type=float, default=None,
                   help="the orchestrator's delay before it starts a replacement (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--standby-workers", type=int, default=0, help="warm standbys of each worker role (serve's flag)")
    p.add_argument("--no-weight-store", action="store_true",
                   help="every worker reads the checkpoint (the baseline of the host-memory weight store)")
    p.add_argument("--pin-workers", action="store_true", help="AW i and EW i on CPU i (serve's flag; --cluster local)")
    p.add_argument("--device", default="cpu", help="the workers' device (serve's flag): cpu or cuda")
    p.add_argument("--kernel", default="auto", help="the workers' kernels (serve's flag): auto, torch or triton")


def check(args: argparse.Namespace) -> None:
    if args.concurrency is None and args.rate is None:
        args.rate = 4.0
    if (args.rate is not None and args.rate <= 0) or (args.concurrency is not None and args.concurrency < 1):
        raise ConfigError("--rate must be > 0 and --concurrency >= 1")
    if not 0 < args.at < args.duration:
        raise ConfigError("--at must be inside (0, --duration)")
    if args.tokens < 1 or args.prompt_len < 1:
        raise ConfigError("--tokens and --prompt-len must be >= 1")
    if args.role == "node" and args.cluster != "ray":
        raise ConfigError("--role node is for --cluster ray (a whole machine: on one machine, kill a process)")
    if args.ray_address is not None and args.cluster != "ray":
        raise ConfigError("--ray-address is for --cluster ray")
    if args.cluster == "ray" and (args.mode != "fabric" or args.signal == "STOP"):
        raise ConfigError("--cluster ray runs --mode fabric with --signal INT or KILL")
    if args.role == "node":
        args.signal = "KILL"  # what a node's death is to its processes
    need = {"node": 2, "expert": args.expert_workers, "attention": args.attention_workers, "gateway": args.gateways,
            "store": 2 if args.checkpoint_stores else 0, "orchestrator": 2}[args.role]
    if need < 2 and args.mode == "fabric" and args.role != "store":
        raise ConfigError(f"--mode fabric needs at least 2 {args.role} processes to survive losing one")
    if args.role == "store" and not args.checkpoint_stores:
        raise ConfigError("--role store needs --checkpoint-stores >= 1")
