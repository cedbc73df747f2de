"""The fabrics a benchmark runs side by side: this checkout's, in any of its configurations
(`FabricSpec`), and another checkout's (`baseline_fabric`), each up, warmed and stopped with the run.
(`python bench/<script>.py`: bench/ is on sys.path.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from rounds import fabric_round

from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from fabric.tls import Tls, write_self_signed
from launch.config import ServeConfig
from launch.local import Fabric, free_port


def profiled_fabric(model_dir: Path, out: Path, transport: str, sim: bool, **over: object) -> tuple[ServeConfig, int]:
    """The fabric the data-path profilers run (2 AWs + 2 EWs; `sim`: no compute at all), its demo model written
    first where it is missing, its logs under `out`; and the model's vocabulary size."""
    if not (model_dir / "config.json").exists():
        write_demo_model(model_dir, arch="mixtral", size="bench")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    sim_flags = {"compute": "sim", "sim_attention_ms": 0.0, "sim_expert_ms": 0.0} if sim else {}
    cfg = ServeConfig(model=str(model_dir), attention_workers=2, expert_workers=2, transport=transport,
                      port=free_port(), ready_timeout=300, **sim_flags, **over)
    return cfg, ModelConfig.from_dir(model_dir).vocab_size


class FabricSpec(NamedTuple):
    """One fabric of the run (2 AWs + 2 EWs)."""

    transport: str
    gateways: int
    sched: str = "auto"
    security: str = "secret"  # secret = authenticated, the default; none = `--no-auth`; tls = authenticated inside TLS
    kernel: str = "auto"  # the workers' --kernel
    pin: bool = False  # serve --pin-workers (off by default, as in serve)
    max_batch_tokens: int = 0  # serve --max-batch-tokens (0: its default)
    device: str = "cpu"  # serve --device


@contextlib.contextmanager
def running_fabric(model: Path, spec: FabricSpec, log_root: str,
                   warm: list[list[list[int]]] | None = None) -> Iterator[tuple[str, Tls | None, Fabric]]:
    """A fabric up and warmed (a short round with each batch of prompts in `warm`: a fabric's first
    round at a new concurrency ran up to 2x slower); yields its completions URL and TLS."""
    log_dir = tempfile.mkdtemp(prefix=f"fabric-{'-'.join(map(str, spec))}-", dir=log_root)
    tls = write_self_signed(Path(log_dir), days=2) if spec.security == "tls" else None
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=2, gateways=spec.gateways,
                      transport=spec.transport, port=free_port(), ready_timeout=300, sched=spec.sched,
                      auth=spec.security != "none", tls_cert=tls.cert if tls else None, tls_key=tls.key if tls else None,
                      pin_workers=spec.pin, kernel=spec.kernel, device=spec.device,
                      **({"max_batch_tokens": spec.max_batch_tokens} if spec.max_batch_tokens else {}))
    url = f"{'https' if tls else 'http'}://{cfg.host}:{cfg.port}/v1/completions"
    t = time.perf_counter()
    with Fabric(cfg, log_dir=log_dir) as fabric:
        print(f"  fabric {spec}: ready in {time.perf_counter() - t:.1f}s (logs in {log_dir})", flush=True)
        for batch in warm or [[[1] * 8]]:
            asyncio.run(fabric_round(url, batch, 16, tls))
        yield url, tls, fabric


@contextlib.contextmanager
def baseline_fabric(tree: Path, model: Path, transport: str, log_root: str,
                    warm: list[list[list[int]]] | None = None, flags: list[str] | None = None,
                    serve_pid: list[int] | None = None) -> Iterator[str]:
    """The fabric of another checkout (`tree`, e.g. a `git worktree` of an earlier commit) started
    with its own `serve`, 2 AWs + 2 EWs, on the same weights; yields its completions URL. Its `serve` process's pid
    goes into `serve_pid` where given."""
    port = free_port()
    log = open(Path(log_root) / f"baseline-{transport}.log", "wb")  # noqa: SIM115
    # Its packages, not this checkout's, and its own kernel build (the build directory is keyed
    # by the environment, which both share; one source replacing the other's build would rebuild).
    # Other PYTHONPATH entries stay (packages installed beside the image's, as on a GPU machine), but no checkout.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "launch" / "cli.py").exists()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *kept]), "XDG_CACHE_HOME": str(tree / ".cache")}
    module = "launch.cli" if (tree / "launch" / "cli.py").exists() else "fabric.cli"
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", "--model", str(model), "--attention-workers", "2",
                             "--expert-workers", "2", "--transport", transport, "--port", str(port), *(flags or [])],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=log)
    if serve_pid is not None:
        serve_pid.append(proc.pid)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if "moe-fabric ready" not in line:
            raise RuntimeError(f"the baseline fabric did not start: {line!r} (log: {log.name})")
        print(f"  baseline fabric {transport} from {tree}: ready (log {log.name})", flush=True)
        for batch in warm or [[[1] * 8]]:
            asyncio.run(fabric_round(url, batch, 16))
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
