"""Steady-state cost of the failure machinery: the fabric with detection, probing, shadow experts
and a provisioner ("resilient", the default) against the same fabric with all of it off
("bare": no AW->EW or gateway->AW probes, no shadows, no provisioner), on the `bench` demo model.

Both fabrics run at the same time (idle between rounds) and take turns, round after round, so
the noise of this shared machine hits both alike; the table reports medians and their ratio.

    python bench/bench_resilience_cost.py --concurrency 16 --tokens 128 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import scan_logs
from rounds import fabric_round, make_prompts  # bench/ is on sys.path when run as a script

from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from launch.config import ServeConfig
from launch.local import Fabric, free_port

CONFIGS: dict[str, dict[str, Any]] = {
    "resilient": {"shadows_per_expert": 1, "probe_interval_ms": 10.0, "provisioner": "auto"},
    "bare": {"shadows_per_expert": 0, "probe_interval_ms": 0.0, "provisioner": "none"},
}


def plot(raw: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, vals in raw.items():
        ax.plot(range(1, len(vals) + 1), vals, marker="o", label=f"{name} (median {statistics.median(vals):.1f})")
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("steady-state throughput: failure machinery on vs off")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="rounds per configuration, alternating")
    ap.add_argument("--attention-workers", type=int, default=2)
    ap.add_argument("--expert-workers", type=int, default=2)
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    if not (args.model_dir / "config.json").exists():
        print(f"writing the bench demo model to {args.model_dir} ...", flush=True)
        write_demo_model(args.model_dir, arch="mixtral", size="bench")
    mcfg = ModelConfig.from_dir(args.model_dir)
    prompts = make_prompts(args.concurrency, args.prompt_len, mcfg.vocab_size, 0)
    log_root = tempfile.mkdtemp(prefix="bench-resilience-logs-")
    fabrics: dict[str, Fabric] = {}
    raw: dict[str, list[float]] = {name: [] for name in CONFIGS}
    try:
        for name, over in CONFIGS.items():
            cfg = ServeConfig(model=str(args.model_dir), attention_workers=args.attention_workers,
                              expert_workers=args.expert_workers, transport="tcp", port=free_port(), ready_timeout=300,
                              **over)
            log_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=log_root)
            fabrics[name] = fab = Fabric(cfg, log_dir=log_dir)
            t = time.perf_counter()
            fab.start()
            fab.wait_ready(cfg.ready_timeout)
            print(f"{name}: ready in {time.perf_counter() - t:.1f}s ({over}; logs in {log_dir})", flush=True)
            asyncio.run(fabric_round(f"http://127.0.0.1:{cfg.port}/v1/completions", prompts[:2], 16))  # warm-up
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                url = f"http://127.0.0.1:{fabrics[name].port}/v1/completions"
                stats = asyncio.run(fabric_round(url, prompts, args.tokens))
                raw[name].append(stats["tok_s"])
                print(f"round {r + 1}/{args.rounds} {name}: {stats['tok_s']:.1f} tok/s", flush=True)
        memory = {name: [w["stats"].get("expert_mib_read", 0) + w["stats"].get("expert_mib_mapped", 0) for w in fab.cluster()["workers"] if w["role"] == "expert"]
                  for name, fab in fabrics.items()}
    finally:
        for fab in fabrics.values():
            fab.stop()
    med = {name: statistics.median(v) for name, v in raw.items()}
    ratio = med["resilient"] / med["bare"]
    print(f"\n`{command}`\n")
    print("| configuration | output tok/s (median) | min | max | vs bare | expert MiB per EW |")
    print("|---|---:|---:|---:|---:|---|")
    for name, vals in raw.items():
        mib = ", ".join(f"{m:.0f}" for m in memory[name] if m is not None) or "–"
        print(f"| {name} | {med[name]:.1f} | {min(vals):.1f} | {max(vals):.1f} | {med[name] / med['bare']:.3f}x | {mib} |")
    print(f"\nsteady-state cost of detection + probing + shadows + provisioner: {(1 - ratio) * 100:+.1f}% throughput "
          f"(C={args.concurrency}, {args.tokens} tokens/stream, {args.rounds} alternating rounds, "
          f"load average {os.getloadavg()[0]:.2f})")
    for note in scan_logs(log_root):
        print(f"note: {note}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resilience_cost.json").write_text(json.dumps(
        {"command": command, "raw": raw, "median": med, "ratio": ratio, "expert_mib": memory}, indent=2) + "\n")
    plot(raw, args.out / "resilience_cost.png")
    print(f"wrote {args.out / 'resilience_cost.json'} and {args.out / 'resilience_cost.png'}")


if __name__ == "__main__":
    main()
