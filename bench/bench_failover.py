"""Failover figures: `moe-fabric experiment failover` several times per scenario on the `bench`
demo model, medians in one table (the README's), and a bar plot of the stalls.

Scenarios: an EW gets SIGINT (fabric), an AW gets SIGINT (fabric; with the checkpoint store, by
replay without one, and variants: the replacement started at once, the normal scheduling class,
over ucx), an EW gets SIGSTOP (a hung process: found by probes; the detection time is the
orchestrator's verdict), an EW gets SIGINT with every process restarted (restart-all, the
MegaScale-Infer-like baseline), and the control plane's processes die: the orchestrator (SIGKILL,
SIGINT, SIGSTOP: its supervisor's watchdog), a gateway (SIGKILL, SIGSTOP; the client resumes its
streams with Last-Event-ID) and the checkpoint store; a whole node of a three-node Ray cluster on
loopback (`--cluster ray --role node`) beside one AW's SIGKILL on one machine.

    python bench/bench_failover.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rounds import in_turn  # bench/ is on sys.path when run as a script

from fabric.model.demo import write_demo_model
from launch.experiments import timeline as tl

SCENARIOS: dict[str, list[str]] = {
    "EW SIGINT / fabric": ["--role", "expert", "--signal", "INT", "--mode", "fabric"],
    "AW SIGINT / fabric": ["--role", "attention", "--signal", "INT", "--mode", "fabric"],
    "AW SIGINT / replay": ["--role", "attention", "--signal", "INT", "--mode", "fabric", "--checkpoint-stores", "0"],
    "AW SIGINT / fabric (sched normal)": ["--role", "attention", "--signal", "INT", "--mode", "fabric", "--sched", "normal"],
    "AW SIGINT / fabric (replacement at once)": ["--role", "attention", "--signal", "INT", "--mode", "fabric",
                                                  "--replacement-delay-ms", "0"],
    "AW SIGINT / fabric over ucx": ["--role", "attention", "--signal", "INT", "--mode", "fabric", "--transport", "ucx"],
    "EW SIGINT / fabric (pinned)": ["--role", "expert", "--signal", "INT", "--mode", "fabric", "--pin-workers"],
    "AW SIGINT / fabric (pinned)": ["--role", "attention", "--signal", "INT", "--mode", "fabric", "--pin-workers"],
    "EW SIGINT / fabric over ucx": ["--role", "expert", "--signal", "INT", "--mode", "fabric", "--transport", "ucx"],
    "EW SIGSTOP / fabric": ["--role", "expert", "--signal", "STOP", "--mode", "fabric"],
    "AW SIGSTOP / fabric": ["--role", "attention", "--signal", "STOP", "--mode", "fabric"],
    "EW SIGINT / restart-all": ["--role", "expert", "--signal", "INT", "--mode", "restart-all"],
    "orchestrator SIGKILL / fabric": ["--role", "orchestrator", "--signal", "KILL", "--mode", "fabric"],
    "orchestrator SIGINT / fabric": ["--role", "orchestrator", "--signal", "INT", "--mode", "fabric"],
    "orchestrator SIGSTOP / fabric": ["--role", "orchestrator", "--signal", "STOP", "--mode", "fabric"],
    "gateway SIGKILL / fabric": ["--role", "gateway", "--signal", "KILL", "--mode", "fabric"],
    "gateway SIGSTOP / fabric": ["--role", "gateway", "--signal", "STOP", "--mode", "fabric"],
    "store SIGKILL / fabric": ["--role", "store", "--signal", "KILL", "--mode", "fabric"],
    # A whole node dies (its raylet and every process on it: an AW, an EW, a gateway) on a Ray
    # cluster of three nodes on loopback; side by side with the same fabric on one machine losing one AW.
    "node death / ray (3 nodes)": ["--role", "node", "--cluster", "ray", "--mode", "fabric"],
    # The node of the orchestrator (and whatever else Ray put there) dies.
    "orchestrator node death / ray (3 nodes)": ["--role", "node", "--node-of", "orchestrator", "--cluster", "ray",
                                                 "--mode", "fabric"],
    "AW SIGKILL / fabric": ["--role", "attention", "--signal", "KILL", "--mode", "fabric"],
    # How fast a dead worker's place is taken: a new process that reads the checkpoint (the fabric
    # before the weight store), one that maps its weights from the host's weight store (the
    # default), a warm standby woken at once that maps them.
    "EW SIGINT / fabric (no weight store)": ["--role", "expert", "--signal", "INT", "--mode", "fabric",
                                            "--no-weight-store"],
    "EW SIGINT / fabric + standby": ["--role", "expert", "--signal", "INT", "--mode", "fabric",
                                     "--standby-workers", "1"],
    "AW SIGINT / fabric (no weight store)": ["--role", "attention", "--signal", "INT", "--mode", "fabric",
                                            "--no-weight-store"],
    "AW SIGINT / fabric + standby": ["--role", "attention", "--signal", "INT", "--mode", "fabric",
                                     "--standby-workers", "1"],
}
FIELDS = ["stall_s", "stall_without_failure_s", "victim_gone_s", "time_to_first_success_s", "suspected_s", "detected_s", "replacement_ready_s", "time_to_90pct_throughput_s",
          "normal_gap_s", "degraded_gap_s"]


def stalls(res: dict[str, Any]) -> dict[str, float | None]:
    """The stall, and the same measure on the failure-free run, by this tree's definition
    (launch/experiments/timeline.stall) from the runs' token times, whatever tree made them: a
    baseline tree's own figure may follow an older definition. A results file without the
    reference run's times (an older tree) has no no-failure figure by it: none is shown."""
    kill = res["metrics"]["kill_at_s"]
    times = res.get("times")
    if times is None:  # an older tree: the failure run's streams from their gaps and first tokens
        after: dict[int, list[float]] = {}
        for t, _, i in sorted(res["gaps"]):  # (a gap's stream is its position among the requests)
            after.setdefault(i, []).append(t)
        times = [[r["first_token"], *after.get(pos, [])] for pos, r in enumerate(res["requests"])
                 if r["first_token"] is not None]
    ref = res.get("reference_times")
    return {"stall_s": tl.stall(times, kill), "stall_without_failure_s": tl.stall(ref, kill) if ref else None}


def gap_context(res: dict[str, Any]) -> dict[str, float | None]:
    """What a stall reads against: the median token gap before the kill, and while the cluster is
    one worker short (from 1 s after the kill until the replacement is ready)."""
    m = res["metrics"]
    kill = m["kill_at_s"]
    end = kill + (m.get("replacement_ready_s") or 3.0)
    before = [g for t, g, *_ in res["gaps"] if t < kill]
    short = [g for t, g, *_ in res["gaps"] if kill + 1.0 < t < end]
    return {"normal_gap_s": med(before), "degraded_gap_s": med(short)}


def med(vals: list[float | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return statistics.median(xs) if xs else None


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["scenario"] for r in rows]
    stalls = [r["stall_s"] or 0.0 for r in rows]
    ax.bar(range(len(rows)), stalls, color=["tab:blue" if "fabric" in n else "tab:red" for n in names])
    for i, v in enumerate(stalls):
        ax.text(i, v, f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s", ha="center", va="bottom")
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("stall: largest token gap (s, median, log)")
    ax.set_title("what one worker failure costs the streams (bench demo model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/out/failover"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of the scenario names")
    ap.add_argument("--workload", default="--concurrency 8 --duration 14 --at 4 --tokens 64 --prompt-len 16",
                    help="flags passed to every experiment run")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run every scenario with the code of this checkout (e.g. `git worktree add /tmp/base "
                         "COMMIT`), alternating with this one: rows '... @ <its name>'")
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    if not (args.model_dir / "config.json").exists():
        print(f"writing the bench demo model to {args.model_dir} ...", flush=True)
        write_demo_model(args.model_dir, arch="mixtral", size="bench")
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.baseline_tree is not None:
        trees.append((f" @ {args.baseline_tree.name}", args.baseline_tree.resolve()))
    # (a baseline tree runs only the scenarios whose flags it has: --pin-workers is newer than most)
    def plan(rep: int) -> list[tuple[str, str, Path | None]]:  # each tree first in turn
        return [(name + suffix, name, tree) for name in chosen for suffix, tree in in_turn(trees, rep)
                if tree is None or "--pin-workers" not in SCENARIOS[name]]

    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in plan(0)}
    for rep in range(args.repeats):
        for label, name, tree in plan(rep):
            out = (args.out / f"{label.replace(' ', '').replace('/', '-').replace('@', '-')}-{rep}").resolve()
            cmd = [sys.executable, "-m", "launch.cli", "experiment", "failover", *SCENARIOS[name],
                   "--model", str(args.model_dir.resolve()), "--out", str(out), *shlex.split(args.workload)]
            # its packages first, and its own kernel build (bench_datapath.baseline_fabric says why)
            env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(tree / ".cache")} if tree is not None else None
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"[{rep + 1}/{args.repeats}] {label} ({time.perf_counter() - t:.0f} s, exit {proc.returncode}): "
                  f"{summary}", flush=True)
            if not (out / "results.json").exists():
                print(proc.stdout[-2000:] + proc.stderr[-2000:], flush=True)
                continue
            res = json.loads((out / "results.json").read_text())
            runs[label].append({**res["metrics"], **stalls(res), **gap_context(res)})
    rows = []
    for name in runs:
        ms = runs[name]
        row: dict[str, Any] = {"scenario": name, "runs": len(ms)}
        for f in FIELDS:
            row[f] = med([m.get(f) for m in ms])
        row["lost"] = sum(m["requests_lost"] for m in ms)
        row["client_resumes"] = sum(m.get("client_resumes", 0) for m in ms)
        row["requests"] = sum(m["requests"] for m in ms)
        row["all_equal"] = all(m["outputs_equal"] for m in ms) and bool(ms)
        rows.append(row)

    def ms(x: float | None) -> str:
        return "–" if x is None else (f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s")

    print(f"\n`{command}`\n")
    print("| scenario | runs | stall (median) | each run | the same without the failure | victim gone | first token after kill | found dead by a peer | "
          "declared dead (orchestrator) | replaced or restarted | back to 90% tok/s | token gap before / one worker short | "
          "client resumes | requests lost | outputs equal to failure-free run |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        each = ", ".join(f"{m['stall_s'] * 1e3:.0f}" for m in runs[r["scenario"]] if m.get("stall_s") is not None)
        print(f"| {r['scenario']} | {r['runs']} | {ms(r['stall_s'])} | {each} | {ms(r['stall_without_failure_s'])} | "
              f"{ms(r['victim_gone_s'])} | "
              f"{ms(r['time_to_first_success_s'])} | "
              f"{ms(r['suspected_s'])} | {ms(r['detected_s'])} | {ms(r['replacement_ready_s'])} | {ms(r['time_to_90pct_throughput_s'])} | "
              f"{ms(r['normal_gap_s'])} / {ms(r['degraded_gap_s'])} | {r['client_resumes']} | {r['lost']} of {r['requests']} | "
              f"{'yes' if r['all_equal'] else 'no'} |")
    fabric_ew = next((r["stall_s"] for r in rows if r["scenario"] == "EW SIGINT / fabric"), None)
    restart = next((r["stall_s"] for r in rows if r["scenario"] == "EW SIGINT / restart-all"), None)
    if fabric_ew and restart:
        print(f"\nrestart-all stall / fabric EW stall: {restart / fabric_ew:.0f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"command": command, "rows": rows, "runs": runs}, indent=2) + "\n")
    plot(rows, args.out / "failover_stalls.png")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'failover_stalls.png'}")


if __name__ == "__main__":
    main()
