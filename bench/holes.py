"""Holes in the machine's scheduling: when a plain process could not run for a while, and what ran instead.

A process in the normal class sleeps 10 ms at a time. When it wakes `--hole-ms` or more late, it writes one line: how
late, the machine's CPU time over the hole by kind (user, system, softirq, steal: what the host took), the processes
that used the most CPU, and the kernel's memory counters that moved (compaction, reclaim, faults). The processes' CPU
is read every `--every-s` (~10 ms of CPU a read here), so their figures cover the hole and up to that much before it.

On the 2-core VM of docs/performance.md this found a 507 ms hole with no steal, as vLLM's 64-stream round ended and
the fabric's began, the moment at which a live gateway had been declared dead in an earlier run. `bench_datapath.py
--watch-holes` runs it beside its rounds and prints what it found:

    python bench/holes.py --out holes.log     # alone, until interrupted
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

TICK_S = 0.01
HZ = os.sysconf("SC_CLK_TCK")
KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
VMSTAT = ("compact_stall", "compact_migrate_scanned", "thp_fault_alloc", "thp_collapse_alloc", "pgmajfault",
          "allocstall", "pgscan_direct", "pgsteal_direct")


def cpu_ticks() -> list[int]:
    """The machine's CPU time by kind (`KINDS`), in clock ticks, summed over every CPU."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def processes() -> dict[int, tuple[str, int]]:
    """pid -> (name, user + system CPU ticks) for every process.

    One read of each /proc/<pid>/stat gives both; machine.cpu_split reads the same fields, but importing that module
    loads torch into this watcher, which must stay small."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
        except OSError:  # gone meanwhile
            continue
        r = s.rindex(")")
        fields = s[r + 2:].split()
        out[int(pid)] = (s[s.index("(") + 1:r], int(fields[11]) + int(fields[12]))
    return out


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f) if k.startswith(VMSTAT)}


def describe(late_s: float, cpu: tuple[list[int], list[int]], procs: tuple[dict, dict], vm: tuple[dict, dict],
             top: int = 6) -> str:
    """One hole's line: how late, the CPU time by kind, the busiest processes, the memory counters that moved."""
    ms = 1000 / HZ
    kinds = ", ".join(f"{k} {(b - a) * ms:.0f}" for k, a, b in zip(KINDS, *cpu) if b != a)
    (p0, p1) = procs
    used = sorted(((t - p0.get(pid, (n, t))[1], n, pid) for pid, (n, t) in p1.items()), reverse=True)[:top]
    busiest = ", ".join(f"{n}[{pid}] {t * ms:.0f}" for t, n, pid in used if t > 0)
    moved = {k: v - vm[0].get(k, 0) for k, v in vm[1].items() if v != vm[0].get(k, 0)}
    return (f"{time.strftime('%H:%M:%S')} a hole of {late_s * 1e3:.0f} ms; CPU ms by kind: {kinds or 'none'}; "
            f"busiest processes (CPU ms): {busiest or 'none'}; memory counters moved: {moved or 'none'}")


def watch(out: Path, hole_s: float, every_s: float) -> None:
    """Writes a line to `out` for every hole, until this process is ended or its parent goes."""
    parent = os.getppid()
    cpu, procs, vm = cpu_ticks(), processes(), vmstat()
    read_at = last = time.monotonic()
    with open(out, "a", buffering=1) as f:
        while os.getppid() == parent:
            time.sleep(TICK_S)
            now = time.monotonic()
            late = now - last - TICK_S
            if late >= hole_s:
                cpu2, procs2, vm2 = cpu_ticks(), processes(), vmstat()
                f.write(describe(late, (cpu, cpu2), (procs, procs2), (vm, vm2)) + "\n")
                cpu, procs, vm, read_at = cpu2, procs2, vm2, now
            elif now - read_at >= every_s:
                cpu, procs, vm, read_at = cpu_ticks(), processes(), vmstat(), now
            last = time.monotonic()


@contextlib.contextmanager
def watching(out: Path, hole_ms: float = 200.0) -> Iterator[Path]:
    """Runs the watcher in a process of its own for the duration of the block; yields the file it writes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch()
    proc = subprocess.Popen([sys.executable, __file__, "--out", str(out), "--hole-ms", str(hole_ms)])
    try:
        yield out
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the file the lines are appended to")
    ap.add_argument("--hole-ms", type=float, default=200.0, help="a wake-up this late is a hole")
    ap.add_argument("--every-s", type=float, default=1.0, help="how often the processes' CPU is read")
    args = ap.parse_args()
    if args.hole_ms <= 0 or args.every_s <= 0:
        ap.error("--hole-ms and --every-s must be positive")
    with contextlib.suppress(KeyboardInterrupt):
        watch(args.out, args.hole_ms / 1000, args.every_s)


if __name__ == "__main__":
    main()
