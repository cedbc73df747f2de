"""`moe-fabric` command line: one subcommand per role, `serve` for all of them, `demo-model`, `experiment`.

Each subcommand's flags map 1:1 onto the fields of its config dataclass (fabric/config.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fabric.config import (
    SCHED_POLICIES,
    AttentionWorkerConfig,
    CheckpointStoreConfig,
    ExpertWorkerConfig,
    GatewayConfig,
    OrchestratorConfig,
    ServeConfig,
)
from fabric.errors import ConfigError, FabricError

API_KEY_ENV = "MOE_FABRIC_API_KEY"


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--orchestrator", required=True, metavar="HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and to advertise")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--transport", choices=["tcp", "ucx", "auto"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    _boot_nice_flag(p)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def _boot_nice_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--boot-nice", type=int, default=0,
                   help="run start-up (imports, weight loading) this much nicer, 0..19, or 20: in the idle class (replacements boot with 20)")
    _sched_flag(p)


def _sched_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sched", choices=SCHED_POLICIES, default="auto",
                   help="CPU scheduling policy (Linux): batch = a peer this process wakes does not preempt it "
                        "mid-send (fewer context switches where workers share cores); normal = the kernel's default; "
                        "auto = batch with --transport tcp, else normal")


def _gateway_policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-waiting", type=int, default=512, help="waiting requests beyond this get 429")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running requests")
    p.add_argument("--routing", choices=["least-work", "round-robin"], default="least-work",
                   help="how the gateway picks an attention worker")


def _probe_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--probe-interval-ms", type=float, default=10.0,
                   help=f"probe {what} that is silent with work in flight this often (0: no probes)")
    p.add_argument("--probe-misses", type=int, default=3, help="unanswered probes before the peer is declared dead")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-fabric", description="Resilient serving fabric for MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start every role on this machine and serve the OpenAI API")
    s.add_argument("--model", default=None, help="checkpoint directory (default: a cached demo model)")
    s.add_argument("--attention-workers", type=int, default=2)
    s.add_argument("--expert-workers", type=int, default=2)
    s.add_argument("--transport", choices=["tcp", "ucx", "auto"], default="auto")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--orchestrator-port", type=int, default=0)
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    s.add_argument("--gather", choices=["sync", "threshold"], default="sync")
    s.add_argument("--shadows-per-expert", type=int, default=1, help="inactive copies of each expert on other EWs")
    s.add_argument("--served-model-name", default=None)
    _gateway_policy_flags(s)
    s.add_argument("--ready-timeout", type=float, default=300.0)
    s.add_argument("--provisioner", choices=["local", "none"], default="local",
                   help="start a replacement process for every worker that dies (none: don't)")
    _probe_flags(s, "EW and AW links")
    s.add_argument("--checkpoint-stores", type=int, default=1, help="KV checkpoint stores (0: AW deaths replay)")
    s.add_argument("--checkpoint", choices=["incremental", "pause", "off"], default="incremental",
                   help="how AWs checkpoint KV (pause: the stop-copy-resume baseline)")
    s.add_argument("--resume", choices=["restore", "parallel", "sequential"], default="restore",
                   help="how a dead AW's requests resume: from the checkpoint store, or by replay (baselines)")
    _sched_flag(s)

    o = sub.add_parser("orchestrator", help="run the orchestrator")
    o.add_argument("--model", required=True)
    o.add_argument("--expert-workers", type=int, required=True, help="EWs to wait for before placing experts")
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, default=0)
    o.add_argument("--port-file", default=None, help="write the bound port here once listening")
    o.add_argument("--shadows-per-expert", type=int, default=1, help="inactive copies of each expert on other EWs")
    o.add_argument("--provisioner", choices=["none", "local"], default="none",
                   help="local: start a replacement subprocess on this host for every dead worker")
    o.add_argument("--spawn-attention-args", default="", metavar="ARGS",
                   help="flags of `moe-fabric attention-worker` for replacements (one shell-quoted string)")
    o.add_argument("--spawn-expert-args", default="", metavar="ARGS",
                   help="flags of `moe-fabric expert-worker` for replacements (one shell-quoted string)")
    o.add_argument("--spawn-store-args", default="", metavar="ARGS",
                   help="flags of `moe-fabric checkpoint-store` for replacements (one shell-quoted string)")
    o.add_argument("--spawn-log-dir", default=None, help="replacements' logs go here (default: stderr)")
    o.add_argument("--max-replacements", type=int, default=16, help="crash-loop guard over the cluster's life")
    o.add_argument("--replacement-delay-ms", type=float, default=500.0,
                   help="start a replacement this long after the death, once the survivors have taken over its work")
    o.add_argument("--replacement-boot-nice", type=int, default=20,
                   help="replacements boot this much nicer than the serving workers (0..19; 20: the idle class)")
    o.add_argument("--confirm-timeout-ms", type=float, default=250.0,
                   help="a worker a peer reports dead is declared dead unless it answers the orchestrator within this")
    o.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

    g = sub.add_parser("gateway", help="run the HTTP gateway")
    g.add_argument("--model", required=True)
    g.add_argument("--orchestrator", required=True, metavar="HOST:PORT")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--transport", choices=["tcp", "ucx", "auto"], default="auto")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    _gateway_policy_flags(g)
    _probe_flags(g, "an AW link")
    g.add_argument("--resume", choices=["restore", "parallel", "sequential"], default="restore",
                   help="how a dead AW's requests resume: from the checkpoint store, or by replay (baselines)")
    _sched_flag(g)
    g.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

    a = sub.add_parser("attention-worker", help="run one attention worker")
    _worker_flags(a)
    a.add_argument("--block-size", type=int, default=16)
    a.add_argument("--kv-cache-mib", type=int, default=256)
    a.add_argument("--max-batch-tokens", type=int, default=512)
    a.add_argument("--max-running", type=int, default=64)
    _probe_flags(a, "an EW link")
    a.add_argument("--expert-wait-s", type=float, default=30.0,
                   help="how long a step waits for a replacement when every copy of an expert is gone")
    a.add_argument("--checkpoint", choices=["incremental", "pause", "off"], default="incremental",
                   help="KV checkpoints to the checkpoint store (pause: the stop-copy-resume baseline)")
    a.add_argument("--checkpoint-pause-every", type=int, default=8, help="steps between full copies with --checkpoint pause")
    a.add_argument("--restore-join-ms", type=float, default=50.0,
                   help="a step waits at most this long for restores already under way, so they join it (0: never)")

    e = sub.add_parser("expert-worker", help="run one expert worker")
    _worker_flags(e)
    e.add_argument("--gather", choices=["sync", "threshold"], default="sync")
    e.add_argument("--min-batch-tokens", type=int, default=1)
    e.add_argument("--max-wait-ms", type=float, default=20.0)

    c = sub.add_parser("checkpoint-store", help="run one KV checkpoint store")
    c.add_argument("--model", required=True)
    c.add_argument("--orchestrator", required=True, metavar="HOST:PORT")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on and to advertise")
    c.add_argument("--port", type=int, default=0, help="0 = any free port")
    c.add_argument("--transport", choices=["tcp", "ucx", "auto"], default="auto")
    c.add_argument("--bucket-mib", type=int, default=1024, help="host memory per attention worker")
    c.add_argument("--orphan-ttl-s", type=float, default=60.0, help="keep a dead AW's checkpoints this long")
    _boot_nice_flag(c)
    c.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

    d = sub.add_parser("demo-model", help="write a deterministic random-weight demo checkpoint")
    d.add_argument("out")
    d.add_argument("--arch", choices=["mixtral", "qwen3_moe"], default="mixtral")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")

    x = sub.add_parser("experiment", help="failure-injection experiments against a local fabric")
    xs = x.add_subparsers(dest="experiment", required=True)
    from fabric.experiments.failover import add_arguments as failover_flags

    failover_flags(xs.add_parser("failover", help="SIGINT one worker under load; stall, recovery, lost requests"))
    return parser


def _fields(args: argparse.Namespace, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("command", *drop)}


ServeFn = Callable[[Any, asyncio.Event], Coroutine[Any, Any, None]]


def _role(role: str, cfg: Any, serve: Callable[[], ServeFn]) -> int:
    """Runs one role's process: scheduling policy first (every thread started later inherits it),
    then `serve()` (which may import the role's modules), on an event loop."""
    from fabric.process import run, set_sched, watch_parent

    set_sched(getattr(cfg, "sched_policy", "normal"))
    watch_parent(getattr(cfg, "parent_pid", None))
    coro = serve()
    code = run(lambda stop: coro(cfg, stop), role)
    # The role has closed its links and listeners; what is left is the interpreter tearing down
    # torch and every module, which took ~0.65 CPU s (1.2 s) on an AW here, CPU that a dying
    # worker takes from the survivors in the middle of their failover. Skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    if getattr(args, "api_key", None) is None and cmd in ("serve", "gateway") and API_KEY_ENV in os.environ:
        args.api_key = os.environ[API_KEY_ENV]
    if cmd == "demo-model":
        from fabric.model.demo import write_demo_model

        path = write_demo_model(args.out, arch=args.arch, seed=args.seed, size=args.size, dtype=args.dtype)
        print(path)
        return 0
    if cmd == "experiment":
        from fabric.experiments.failover import run as failover

        return failover(args)
    if cmd == "serve":
        from fabric.launcher import serve

        return serve(ServeConfig(**_fields(args)))
    if cmd == "orchestrator":
        from orchestrator.main import serve as orch

        return _role("orchestrator", OrchestratorConfig(**_fields(args)), lambda: orch)
    if cmd == "gateway":
        from gateway.main import serve as gw

        return _role("gateway", GatewayConfig(**_fields(args)), lambda: gw)
    if cmd == "checkpoint-store":
        cs_cfg = CheckpointStoreConfig(**_fields(args))
        return _role("checkpoint-store", cs_cfg, lambda: _serve_of("checkpoint_store.main", cs_cfg.boot_nice))
    if cmd == "attention-worker":
        aw_cfg = AttentionWorkerConfig(**_fields(args))
        return _role("attention-worker", aw_cfg, lambda: _serve_of("attention_worker.main", aw_cfg.boot_nice))
    ew_cfg = ExpertWorkerConfig(**_fields(args))
    return _role("expert-worker", ew_cfg, lambda: _serve_of("expert_worker.main", ew_cfg.boot_nice))


def _serve_of(module: str, boot_nice: int) -> ServeFn:
    """A worker role's `serve`. Importing it (torch and the rest) is most of a worker's start-up:
    it runs `boot_nice` nicer, so a replacement takes CPU from the serving workers only when idle."""
    from fabric.process import run_niced

    mod = run_niced(lambda: importlib.import_module(module), boot_nice)
    return mod.serve  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
