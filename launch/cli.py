"""The `moe-fabric` command line.

It has one subcommand per role, `serve` for all of them, `demo-model`, `cluster-secret` and
`experiment`.

Each role's flags are derived from the fields of its config dataclass (fabric/config.py,
launch/config.py) by launch/flags.py, so a flag is written once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from fabric.config import (
    AttentionWorkerConfig,
    CheckpointStoreConfig,
    ExpertWorkerConfig,
    GatewayConfig,
    OrchestratorConfig,
    WeightStoreConfig,
)
from fabric.errors import ConfigError, FabricError
from launch.config import ServeConfig
from launch.flags import add_flags, from_args

API_KEY_ENV = "MOE_FABRIC_API_KEY"

# subcommand -> (config class, the module whose `serve(cfg, stop)` runs it, help)
ROLES: dict[str, tuple[type, str, str]] = {
    "orchestrator": (OrchestratorConfig, "orchestrator.server", "run the orchestrator"),
    "gateway": (GatewayConfig, "gateway.main", "run one HTTP gateway"),
    "attention-worker": (AttentionWorkerConfig, "attention_worker.main", "run one attention worker"),
    "expert-worker": (ExpertWorkerConfig, "expert_worker.main", "run one expert worker"),
    "checkpoint-store": (CheckpointStoreConfig, "checkpoint_store.main", "run one KV checkpoint store"),
    "weight-store": (WeightStoreConfig, "weight_store.main", "read a checkpoint once and publish its tensors in this "
                                                             "host's memory for its workers to map"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-fabric", description="Resilient serving fabric for MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_flags(sub.add_parser("serve", help="start every role on this machine, supervised, and serve the OpenAI API"),
              ServeConfig)
    for name, (cls, _, help_) in ROLES.items():
        add_flags(sub.add_parser(name, help=help_), cls)

    d = sub.add_parser("demo-model", help="write a deterministic random-weight demo checkpoint")
    d.add_argument("out")
    d.add_argument("--arch", choices=["mixtral", "qwen3_moe"], default="mixtral")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")

    from launch.scale import ScaleConfig

    add_flags(sub.add_parser("scale", help="add or drain workers of a running fabric (its orchestrator's "
                                           "POST /cluster/scale)"), ScaleConfig)

    c = sub.add_parser("cluster-secret", help="write a new random cluster secret (mode 0600) for a multi-host cluster")
    c.add_argument("out", help="the file to create (an existing one is never overwritten)")

    x = sub.add_parser("experiment", help="failure-injection experiments against a local fabric")
    xs = x.add_subparsers(dest="experiment", required=True)
    from launch.experiments import chaos, failover_args, scale

    scale.add_arguments(xs.add_parser("scale", help="a simulated fabric of 8 to 128 AWs x EWs: control traffic, "
                                                    "failover decisions, routing updates, orchestrator restarts"))
    failover_args.add_arguments(xs.add_parser("failover", help="kill one process under load; stall, recovery, lost requests"))
    chaos.add_arguments(xs.add_parser("chaos", help="kill random processes of every role under load, for a while"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"moe-fabric: {exc}", file=sys.stderr)
        return 2
    except FabricError as exc:
        print(f"moe-fabric: {exc}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd in ("serve", "gateway") and args.api_key is None and API_KEY_ENV in os.environ:
        args.api_key = os.environ[API_KEY_ENV]
    if cmd == "demo-model":
        from fabric.model.demo import write_demo_model

        print(write_demo_model(args.out, arch=args.arch, seed=args.seed, size=args.size, dtype=args.dtype))
        return 0
    if cmd == "cluster-secret":
        from fabric.auth import create_secret_file

        if not create_secret_file(args.out):
            raise ConfigError(f"{args.out} exists; it is not overwritten (remove it first to rotate the secret)")
        print(args.out)
        return 0
    if cmd == "experiment":
        from launch.experiments import chaos, failover, scale

        return {"failover": failover.run, "chaos": chaos.run, "scale": scale.run}[args.experiment](args)
    if cmd == "scale":
        from launch.scale import ScaleConfig, run

        return run(from_args(ScaleConfig, args))
    if cmd == "serve":
        from launch.local import serve

        return serve(from_args(ServeConfig, args))
    cls, module, _ = ROLES[cmd]
    cfg: Any = from_args(cls, args)
    _run_role(cmd, cfg, module)
    return 0  # not reached: the role process exits from run_role


def _run_role(role: str, cfg: Any, module: str) -> None:
    """Runs one role's process.

    Importing a worker role (torch and the rest) is most of its start-up. It runs `boot_nice`
    nicer, so a replacement takes CPU from the serving workers only when they leave it idle."""
    from fabric.process import run_niced, run_role

    # OpenMP threads that spin between parallel regions take the CPU from the other processes a
    # fabric runs on the same cores. Set it before torch is first imported, and leave it to the user.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def load() -> Any:
        return run_niced(lambda: importlib.import_module(module), getattr(cfg, "boot_nice", 0)).serve

    run_role(role, cfg, load)


if __name__ == "__main__":
    sys.exit(main())
