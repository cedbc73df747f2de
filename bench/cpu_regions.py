"""Where an attention worker's and an expert worker's CPU goes, region by region of their code: a fabric (2 AWs + 2
EWs; `--sim`: no compute at all) under a closed loop of C streams, each worker's loop thread timing its own CPU
clock around the regions of its step, its layers and its messages (fabric/cpu_regions.py, MOE_FABRIC_CPU_REGIONS).

A sampling profiler counts wall time, and on two cores shared by eight busy processes a worker's samples pile up
where it was preempted. These are CPU times: user and system (a region's syscalls count, its waits do not).

    python bench/cpu_regions.py --sim --concurrency 1,64 --seconds 8

Per AW: each region's µs a step and a token (the step's rows) and its share of the loop thread's CPU; the loop
thread's rest (the event loop: its polls and reads, timers, tasks' hops) and the process's other threads (the
control plane). Per EW the same a batch and a row. Medians over the workers of a role are not taken: each worker
is shown. Each worker's waits for a wake-up (voluntary context switches, `/proc`) a step or batch say how often
the processes on its core take its caches between two of its runs. `--checkpoint off` runs the fabric with no
checkpoints and no store, to set an AW's regions against the default's:

    python bench/cpu_regions.py --sim --concurrency 64 --checkpoint off
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from common import profiler_parser  # bench/ is on sys.path when run as a script
from fabrics import profiled_fabric
from rounds import closed_loop, make_prompts

from fabric import cpu_regions
from launch.local import Fabric

Snap = dict[str, dict]  # role -> its region file


def switches(pid: int) -> int:
    """How many times the process's threads have given up their CPU to wait (voluntary context switches)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            n += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return n


def snapshot(where: str, pids: dict[str, int]) -> Snap:
    out: Snap = {}
    for role, pid in pids.items():
        path = os.path.join(where, f"{pid}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[role] = {**json.load(f), "switches": switches(pid)}
    return out


def report(c: int, a: Snap, b: Snap) -> None:
    for role in sorted(b):
        if role not in a:
            continue
        x, y = a[role], b[role]
        unit, per = ("step", "steps") if "steps" in y["counts"] else ("batch", "batches")
        units = y["counts"].get(per, 0) - x["counts"].get(per, 0)
        rows = y["counts"].get("rows", 0) - x["counts"].get("rows", 0)
        if not units or not rows:
            continue
        loop_us = (y["thread_ns"] - x["thread_ns"]) / 1e3
        other_us = (y["process_ns"] - x["process_ns"]) / 1e3 - loop_us
        waits = (y["switches"] - x["switches"]) / units
        print(f"\n{role}, {c} streams: {units} {per}, {rows / units:.1f} rows a {unit}; loop thread "
              f"{loop_us / units:.0f} µs a {unit}, {loop_us / rows:.1f} a row; {waits:.1f} waits for a wake-up a {unit}")
        print(f"| region | µs a {unit} | µs a row{' (a token)' if unit == 'step' else ' (an expert row)'} | runs a {unit} "
              "| share of the loop thread |")
        print("|---|---:|---:|---:|---:|")
        rest = loop_us
        for region in sorted(y["ns"], key=lambda r: x["ns"].get(r, 0) - y["ns"][r]):
            us = (y["ns"][region] - x["ns"].get(region, 0)) / 1e3
            runs = y["calls"][region] - x["calls"].get(region, 0)
            rest -= us
            print(f"| {region} | {us / units:.1f} | {us / rows:.2f} | {runs / units:.1f} | {us / loop_us:.0%} |")
        print(f"| the rest of the loop thread (the event loop: polls, reads, timers, task hops) | {rest / units:.1f} | "
              f"{rest / rows:.2f} | | {rest / loop_us:.0%} |")
        print(f"| (the process's other threads: the control plane) | {other_us / units:.1f} | {other_us / rows:.2f} | | |")


def main() -> None:
    ap = profiler_parser(__doc__, "bench/out/cpu-regions", "1,64", 8.0)
    ap.add_argument("--checkpoint", default="incremental", choices=("incremental", "off"),
                    help="serve --checkpoint (off: no checkpoint store, to set against the default)")
    args = ap.parse_args()
    if args.seconds <= 0:
        ap.error("--seconds must be positive")
    over = {"checkpoint": "off", "checkpoint_stores": 0} if args.checkpoint == "off" else {}
    cfg, vocab = profiled_fabric(args.model_dir, args.out, args.transport, args.sim, **over)
    url = f"http://127.0.0.1:{cfg.port}/v1/completions"
    with tempfile.TemporaryDirectory(prefix="cpu-regions-") as where:
        os.environ[cpu_regions.ENV] = where  # the workers inherit it
        try:
            with Fabric(cfg, log_dir=str(args.out / "logs")) as fabric:
                pids = {role: p.pid for role, p in fabric.procs if "worker" in role}
                for c in (int(x) for x in args.concurrency.split(",")):
                    with closed_loop(url, make_prompts(c, 16, vocab, c), 128):
                        time.sleep(2.5)  # (the files are written every second)
                        a = snapshot(where, pids)
                        time.sleep(args.seconds)
                        b = snapshot(where, pids)
                    report(c, a, b)
        finally:
            os.environ.pop(cpu_regions.ENV, None)


if __name__ == "__main__":
    main()
