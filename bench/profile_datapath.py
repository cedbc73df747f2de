"""Where the data path's time goes: a fabric (2 AWs + 2 EWs) under a closed loop of C streams;
CPU seconds per 1000 output tokens of every process (from /proc), and its user and system CPU per token and
layer (at one stream, per layer), each EW's batches (and how many
held calls for more than one layer, each layer's experts read apart), each AW's steps (and how many of its layers
spread their experts beyond their primaries, attention_worker/spread.py), and, with `--py-spy`, the
functions that take each attention and expert worker's CPU and gateway-0's (py-spy samples, by
own time and by total time). `--device cuda` runs the workers on a GPU.

    python bench/profile_datapath.py --concurrency 16 --seconds 20 --py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from fabrics import profiled_fabric
from machine import cpu_split
from rounds import fabric_round, make_prompts  # bench/ is on sys.path when run as a script

from fabric.model.config import ModelConfig
from launch.local import Fabric


def top_functions(raw: Path, n: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """py-spy's raw (collapsed) stacks -> (by own samples, by total samples, all samples)."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in stack.split(";")]
        samples += k
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return own.most_common(n), total.most_common(n), samples


def _ew_batches(fabric: Fabric) -> dict[str, tuple[int, int]]:
    """Each EW's batches so far, and those that held calls for more than one layer."""
    return {w["id"]: (w["stats"].get("batches", 0), w["stats"].get("mixed_batches", 0))
            for w in fabric.cluster()["workers"] if w["role"] == "expert" and "stats" in w}


def _aw_layers(fabric: Fabric) -> dict[str, tuple[int, int]]:
    """Each AW's steps so far, and its layers whose experts went over more EWs than their primaries (`spread_layers`:
    attention_worker/spread.py)."""
    return {w["id"]: (w["stats"].get("steps", 0), w["stats"].get("spread_layers", 0))
            for w in fabric.cluster()["workers"] if w["role"] == "attention" and "stats" in w}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/out/profile"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--py-spy", action="store_true", help="also sample every attention and expert worker, the checkpoint store and gateway-0")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sim", action="store_true", help="no compute at all (serve --compute sim, 0 ms a layer): the fabric's own cost")
    ap.add_argument("--pinned", action="store_true",
                    help="serve --pin-workers (default: serve's default, the workers float over the CPUs)")
    ap.add_argument("--device", default="cpu", help="where the workers compute (cpu, cuda)")
    args = ap.parse_args()
    cfg, vocab = profiled_fabric(args.model_dir, args.out, args.transport, args.sim, pin_workers=args.pinned,
                                 device=args.device)
    prompts = make_prompts(args.concurrency, 16, vocab, 0)
    url = f"http://127.0.0.1:{cfg.port}/v1/completions"
    with Fabric(cfg, log_dir=str(args.out / "logs")) as fabric:
        asyncio.run(fabric_round(url, prompts, 16))  # warm
        procs = dict(fabric.procs)
        spies = []
        if args.py_spy:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            for name in sorted(n for n in procs if n.startswith(("attention-worker", "expert-worker", "gateway-0", "checkpoint-store"))):
                out = args.out / f"{name}.txt"
                spies.append((name, out, subprocess.Popen(
                    [spy, "record", "--format", "raw", "--nonblocking", "--rate", "200", "-d", str(int(args.seconds)),
                     "-o", str(out), "-p", str(procs[name].pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        before = {n: cpu_split(p.pid) for n, p in procs.items()}
        tokens = [0]
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                tokens[0] += int(asyncio.run(fabric_round(url, prompts, 64))["tokens"])

        ews_before, aws_before = _ew_batches(fabric), _aw_layers(fabric)
        t = time.perf_counter()
        runner = threading.Thread(target=load)
        runner.start()
        time.sleep(args.seconds)
        stop.set()
        runner.join()
        wall = time.perf_counter() - t
        after = {n: cpu_split(p.pid) for n, p in procs.items()}
        ews_after, aws_after = _ew_batches(fabric), _aw_layers(fabric)
        for _, _, p in spies:
            p.wait(60)
    n = tokens[0]
    print(f"\n{n} tokens in {wall:.1f} s ({n / wall:.0f} tok/s) at C={args.concurrency}, {args.transport}\n")
    layers = n * ModelConfig.from_dir(args.model_dir).num_layers  # token-layers served
    print("| process | CPU s | CPU s / 1k tokens | share of the fabric's CPU | user / system µs a token-layer |")
    print("|---|---:|---:|---:|---:|")
    split = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in procs}
    used = {name: u + k for name, (u, k) in split.items()}
    total = sum(used.values())
    for name, s in sorted(used.items(), key=lambda kv: -kv[1]):
        u, k = split[name]
        print(f"| {name} | {s:.2f} | {s / n * 1000:.2f} | {s / total:.0%} | {u / layers * 1e6:.1f} / {k / layers * 1e6:.1f} |")
    print(f"| all | {total:.2f} | {total / n * 1000:.2f} | 100% | {total / layers * 1e6:.1f} |")
    for ew, (b, m) in sorted(ews_after.items()):
        b0, m0 = ews_before.get(ew, (0, 0))
        print(f"{ew}: {b - b0} batches, {m - m0} of them with calls for more than one layer")
    for aw, (steps, spread) in sorted(aws_after.items()):
        s0, p0 = aws_before.get(aw, (0, 0))
        print(f"{aw}: {steps - s0} steps, {spread - p0} layers with their experts spread beyond their primaries")
    for name, out, _ in spies:
        if not out.exists():
            print(f"\n(no py-spy samples for {name})")
            continue
        own, tot, samples = top_functions(out, args.top)
        print(f"\n{name}: {samples} samples; by own time / by total time")
        for (f1, c1), (f2, c2) in zip(own, tot):
            print(f"  {c1 / samples:6.1%} {f1[:70]:70s} | {c2 / samples:6.1%} {f2[:70]}")


if __name__ == "__main__":
    main()
