"""`moe-fabric experiment scale`: the fabric's own machinery at deployment size, by simulation.

It runs for each model shape (Mixtral-8x7B, Qwen3-235B-A22B, DeepSeek-V3) and cluster size (A AWs
and as many EWs). A `--compute sim` fabric runs the real code: role runtime, orchestrator, routing
tables, TCP links with the cluster handshake, probes, checkpoints and a gateway. AWs and EWs are
hosted many per process (launch/experiments/sim_cluster.py). Under a closed-loop workload it kills
an EW, an AW and the orchestrator. The orchestrator is restarted at once, as `serve` would. It
reports:

    links           Sockets per AW and EW and per process. Memory per link: the workers' processes'
                    RSS over the AW-EW links, an upper bound.
    control         Orchestrator traffic (bytes/s in + out), idle and loaded. AW->EW probes/s.
    routing update  The death's update: bytes of the delta sent and of a whole view. Time from its
                    publication until the last AW applied it.
    EW death        From the death to the last AW rerouting around it, as it found the link dead or
                    applied the table without it. The orchestrator's CPU for the event.
    AW death        From the death to the next token of every stream running then. The dead AW's
                    streams resume from their KV checkpoints on other AWs. Shown beside the
                    streams' usual token gap (TBT) at that load.
    orchestrator    From the restart to every worker registered again with the new one. Also the
                    boot: process start to serving.

Each figure is plotted against cluster size, with its growth exponent. That is the slope of log
figure over log size, from the smallest to the largest size. It writes a JSON of every run and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from launch.experiments.sim_cluster import SimCluster
from launch.experiments.sim_shapes import SHAPES, write_shape
from launch.experiments.workload import Run, say

TARGETS = {"ew_reroute_ms": 100.0, "update_ms": 50.0, "orch_restart_s": 2.0, "idle_control_mb_s": 1.0}
TICK = os.sysconf("SC_CLK_TCK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"model shapes, comma-separated ({', '.join(SHAPES)})")
    p.add_argument("--sizes", default="8,32,128", help="AWs (and as many EWs) per run, comma-separated")
    p.add_argument("--per-process", type=int, default=32, help="simulated workers hosted by one process")
    p.add_argument("--streams", type=int, default=4, help="closed-loop streams of the workload (2 cores run every "
                                                           "simulated worker: more saturates them)")
    p.add_argument("--tokens", type=int, default=24, help="tokens per request")
    p.add_argument("--attention-ms", type=float, default=0.85, help="simulated attention per layer (Tarragon: 0.85)")
    p.add_argument("--expert-ms", type=float, default=0.85, help="simulated expert batch per layer")
    p.add_argument("--probe-interval-ms", type=float, default=50.0,
                   help="the AWs' probe interval (dozens of workers share an event loop here: the 10 ms default "
                        "would mistake its lag for hung EWs)")
    p.add_argument("--window-s", type=float, default=5.0, help="length of the idle and the loaded measurement")
    p.add_argument("--out", default="bench/out/scale", help="directory for scale.json and scale.png")
    p.add_argument("--logs", default=None, help="process logs (default: OUT/logs)")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Workload:
    """The closed loop, on an event loop of its own thread."""

    def __init__(self, url: str, streams: int, tokens: int) -> None:
        self.run = Run("scale", url, tokens, lambda i: [1 + (i * 7919 + j * 104729) % 30000 for j in range(8)],
                       duration=1e9, concurrency=streams, deadline=300.0, tag="scale")
        self.stopping = asyncio.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="workload", daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()

        async def until_stopped() -> None:
            await self.stopping.wait()
            raise _Stop

        try:
            await self.run.run(until_stopped())
        except _Stop:
            pass

    def start(self) -> None:
        self.thread.start()

    def median_gap(self) -> float:
        """The median gap between a stream's tokens so far, the step time streams see."""
        gaps = [b - a for s in list(self.run.streams) for a, b in zip(s.times, s.times[1:])]
        return statistics.median(gaps) if gaps else math.nan

    def tokens(self) -> int:
        return sum(len(s.tokens) for s in list(self.run.streams))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(30)

    def resumed_after(self, at: float, timeout: float) -> list[float]:
        """Seconds from wall time `at` to the next token of every stream that was running then."""
        t = self.run.now() - (time.time() - at)  # wall-clock `at` on the run's clock
        deadline = time.monotonic() + timeout
        while True:
            running = [s for s in list(self.run.streams) if s.times and s.times[0] < t and not (s.done and
                       s.finished_at is not None and s.finished_at < t)]
            after = [next((x for x in s.times if x >= t), None) for s in running]
            if all(a is not None for a in after) or time.monotonic() > deadline:
                return [a - t if a is not None else math.inf for a in after]
            time.sleep(0.2)


class _Stop(Exception):
    pass


def _traffic(c: dict[str, Any]) -> int:
    ctl = c["control"]
    return int(ctl["bytes_in"] + ctl["bytes_out"])


def _aws(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in c["workers"] if w["role"] == "attention" and w["state"] == "alive"]


def _probes(c: dict[str, Any]) -> int:
    return sum(int(w["stats"].get("probes_sent", 0)) for w in _aws(c))


def _window(cl: SimCluster, orch_pid: int, seconds: float) -> dict[str, float]:
    a, cpu0, t0 = cl.cluster(), _cpu_s(orch_pid), time.monotonic()
    time.sleep(seconds)
    b, cpu1, dt = cl.cluster(), _cpu_s(orch_pid), time.monotonic() - t0
    return {"control_mb_s": (_traffic(b) - _traffic(a)) / dt / 1e6, "probes_s": (_probes(b) - _probes(a)) / dt,
            "orch_cpu": (cpu1 - cpu0) / dt}


def measure(shape: str, n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = write_shape(shape, root / "models")
    logs = Path(args.logs or root / "logs") / f"{shape}-{n}"
    out: dict[str, Any] = {"shape": shape, "aws": n, "ews": n}
    with SimCluster(model, n, n, args.per_process, logs, args.attention_ms, args.expert_ms,
                    probe_interval_ms=args.probe_interval_ms) as cl:
        cl.start()
        out["ready_s"] = cl.wait_ready(600, say=lambda m: say("scale", f"{shape} x{n}: {m}"))
        time.sleep(2.0)  # the last links settle
        c = cl.cluster()
        orch_pid = cl.orchestrator.proc.pid if cl.orchestrator else 0
        per_host: dict[int, int] = {}
        for w in c["workers"]:
            if w["role"] in ("attention", "expert"):
                per_host[w["pid"]] = per_host.get(w["pid"], 0) + 1
        aw_pids = {w["pid"] for w in _aws(c)}
        ew_pids = {w["pid"] for w in c["workers"] if w["role"] == "expert"}
        socks = {pid: _sockets(pid) for pid in per_host}
        out["sockets_per_aw"] = sum(socks[p] for p in aw_pids) / n
        out["sockets_per_ew"] = sum(socks[p] for p in ew_pids) / n
        out["sockets_per_process_max"] = max(socks.values())
        links = 2 * n * n
        out["rss_mib_workers"] = sum(_rss_mib(p) for p in per_host)
        out["rss_bytes_per_link_max"] = out["rss_mib_workers"] * 2**20 / links
        last = c["control"]["broadcasts"][-1] if c["control"]["broadcasts"] else {}
        out["whole_view_bytes"] = last.get("whole_bytes", 0)
        say("scale", f"{shape} x{n}: ready in {out['ready_s']:.1f} s; {out['sockets_per_aw']:.0f} sockets per AW, "
                     f"{out['sockets_per_ew']:.0f} per EW; hosts {sorted(per_host.values())}")
        idle = _window(cl, orch_pid, args.window_s)
        out.update({f"idle_{k}": v for k, v in idle.items()})

        load = Workload(f"http://127.0.0.1:{cl.gateway_port}/v1/completions", args.streams, args.tokens)
        load.start()
        t0 = time.monotonic()
        while load.tokens() < args.streams and time.monotonic() - t0 < 300:
            time.sleep(0.5)
        loaded = _window(cl, orch_pid, args.window_s)
        out.update({f"loaded_{k}": v for k, v in loaded.items()})
        tok0, t0 = load.tokens(), time.monotonic()
        time.sleep(2.0)
        out["tok_s"] = (load.tokens() - tok0) / (time.monotonic() - t0)

        out["tbt_ms"] = 1e3 * load.median_gap()
        out.update(_ew_death(cl, orch_pid, loaded["orch_cpu"]))
        out.update(_aw_death(cl, load))
        out.update(_orchestrator_restart(cl))
        load.stop()
        streams = load.run.streams
        out["requests"] = len(streams)
        out["requests_failed"] = sum(1 for s in streams if s.error)
    return out


def _ew_death(cl: SimCluster, orch_pid: int, idle_cpu: float) -> dict[str, Any]:
    c = cl.cluster()
    epoch0 = c["epoch"]
    ew = next(w for w in c["workers"] if w["role"] == "expert" and w["state"] == "alive")
    cpu0 = _cpu_s(orch_pid)
    at = cl.kill_worker(ew["id"], ew["pid"])
    time.sleep(3.0)  # stats arrive every second
    cpu = _cpu_s(orch_pid) - cpu0 - 3.0 * idle_cpu
    c = cl.cluster()
    pub = next((b for b in c["control"]["broadcasts"] if b["epoch"] > epoch0 and b["at"] >= at), None)
    rerouted, applied = [], []
    for w in _aws(c):
        st = w["stats"]
        found = st.get("suspected_at", {}).get(ew["id"])
        app = st.get("epochs_applied", {}).get(str(pub["epoch"])) if pub else None
        seen = st.get("epochs_seen", {}).get(str(pub["epoch"])) if pub else None
        times = [t for t in (found, app) if t is not None]
        rerouted.append(min(times) - at if times else math.inf)
        if pub is not None:
            applied.append((min(t for t in (app, seen) if t is not None) if (app or seen) else math.inf) - pub["at"])
    found_by_link = sum(1 for w in _aws(c) if ew["id"] in w["stats"].get("suspected_at", {}))
    return {"ew_reroute_ms": 1e3 * max(rerouted), "ew_reroute_median_ms": 1e3 * statistics.median(rerouted),
            "ew_declared_ms": 1e3 * (pub["at"] - at) if pub else math.inf,
            "update_ms": 1e3 * max(applied) if applied else math.inf,
            "update_median_ms": 1e3 * statistics.median(applied) if applied else math.inf,
            "update_sent_ms": 1e3 * (pub["sent_at"] - pub["at"]) if pub and pub.get("sent_at") else math.inf,
            "update_delta_bytes": pub["delta_bytes"] if pub else 0,
            # A whole view's size is logged for the newest broadcast only, the view after the death.
            "update_whole_bytes": c["control"]["broadcasts"][-1].get("whole_bytes", 0) if pub else 0,
            "aws_that_found_it": found_by_link,
            # The orchestrator's own account: deciding and publishing, then writing to every link.
            "orch_cpu_ms_per_death": (pub.get("decide_cpu_ms", 0) + pub.get("send_cpu_ms", 0)) if pub else math.nan,
            "orch_cpu_ms_window": 1e3 * max(0.0, cpu)}


def _aw_death(cl: SimCluster, load: Workload) -> dict[str, Any]:
    c = cl.cluster()
    busy = sorted(_aws(c), key=lambda w: -int(w["stats"].get("running", 0)))
    victim = busy[0]
    at = cl.kill_worker(victim["id"], victim["pid"])
    gaps = load.resumed_after(at, 60.0)
    # Declared dead, by a peer's report or its link's rejoin grace.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(w["id"] == victim["id"] and w["state"] == "dead"
                                                  for w in cl.cluster()["workers"]):
        time.sleep(0.1)
    return {"aw_resume_ms": 1e3 * max(gaps) if gaps else math.nan,
            "aw_resume_median_ms": 1e3 * statistics.median(gaps) if gaps else math.nan,
            "aw_victim_running": int(victim["stats"].get("running", 0))}


def _orchestrator_restart(cl: SimCluster) -> dict[str, Any]:
    killed = cl.kill_orchestrator()
    cl.start_orchestrator(recovery_grace_s=10.0)
    spawned = cl.orchestrator_started
    deadline = time.monotonic() + 60
    rec: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            rec = cl.cluster(timeout=2).get("recovery") or {}
        except OSError:
            rec = {}
        if rec:
            break
        time.sleep(0.05)
    if not rec:
        return {"orch_restart_s": math.inf}
    back = rec["last_rejoin_at"] if rec["all_back"] else rec["done_at"]  # the last worker back, else the grace
    return {"orch_restart_s": back - spawned, "orch_boot_s": rec["started_at"] - spawned,
            "orch_reregister_s": back - rec["started_at"], "orch_all_back": rec["all_back"],
            "orch_workers_back": rec["workers_back"], "orch_down_s": spawned - killed}


def _exponent(rows: list[dict[str, Any]], key: str) -> float | None:
    pts = [(r["aws"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
           and r[key] > 0]
    if len(pts) < 2:
        return None
    (n0, y0), (n1, y1) = min(pts), max(pts)
    return math.log(y1 / y0) / math.log(n1 / n0) if n1 != n0 else None


COLUMNS = [("aws", "AWxEW", "{:d}"), ("ready_s", "ready s", "{:.1f}"), ("sockets_per_aw", "sock/AW", "{:.0f}"),
           ("rss_bytes_per_link_max", "RSS/link kB", "{:.0f}"), ("idle_control_mb_s", "idle MB/s", "{:.4f}"),
           ("loaded_control_mb_s", "load MB/s", "{:.3f}"), ("idle_probes_s", "idle probes/s", "{:.0f}"),
           ("update_delta_bytes", "delta B", "{:d}"), ("update_whole_bytes", "whole B", "{:d}"),
           ("update_sent_ms", "sent ms", "{:.1f}"), ("update_ms", "update ms", "{:.1f}"), ("ew_reroute_ms", "EW reroute ms", "{:.1f}"),
           ("orch_cpu_ms_per_death", "orch CPU ms", "{:.0f}"), ("tbt_ms", "TBT ms", "{:.0f}"), ("aw_resume_ms", "AW resume ms", "{:.0f}"),
           ("orch_restart_s", "orch restart s", "{:.2f}"), ("orch_reregister_s", "re-register s", "{:.2f}"),
           ("tok_s", "tok/s", "{:.0f}"), ("requests_failed", "failed", "{:d}")]


def table(rows: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r.get(key)
        if v is None:
            return "-"
        if key == "rss_bytes_per_link_max":
            v = v / 1e3
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)

    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        lines.append(f"\n{shape}")
        lines.append("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
        lines.append("|" + "---:|" * len(COLUMNS))
        for r in sub:
            lines.append("| " + " | ".join(cell(r, k, f) for k, _, f in COLUMNS) + " |")
        exps = {k: _exponent(sub, k) for k in ("idle_control_mb_s", "loaded_control_mb_s", "update_ms", "ew_reroute_ms",
                                               "orch_restart_s", "orch_reregister_s", "update_delta_bytes",
                                               "aw_resume_ms", "orch_cpu_ms_per_death")}
        lines.append("growth exponents: " + ", ".join(f"{k} {v:.2f}" for k, v in exps.items() if v is not None))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("ew_reroute_ms", "EW death -> every AW rerouted (ms)", TARGETS["ew_reroute_ms"]),
            ("update_ms", "routing update -> every AW applied (ms)", TARGETS["update_ms"]),
            ("orch_restart_s", "orchestrator restart, all re-registered (s)", TARGETS["orch_restart_s"]),
            ("idle_control_mb_s", "idle control traffic (MB/s)", TARGETS["idle_control_mb_s"]),
            ("loaded_control_mb_s", "loaded control traffic (MB/s)", None),
            ("update_delta_bytes", "death's routing update (bytes)", None),
            ("aw_resume_ms", "AW death -> every stream's next token (ms)", None),
            ("orch_cpu_ms_per_death", "orchestrator CPU per EW death (ms)", None),
            ("sockets_per_aw", "sockets per AW", None)]
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, (key, title, target) in zip(axes.flat, keys):
        for shape in dict.fromkeys(r["shape"] for r in rows):
            pts = [(r["aws"], r[key]) for r in rows if r["shape"] == shape and isinstance(r.get(key), (int, float))
                   and math.isfinite(r[key])]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=shape)
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label="target")
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("AWs = EWs")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        say("scale", f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
        return 2
    sizes = [int(x) for x in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for n in sizes:
            say("scale", f"--- {shape}: {n} AWs x {n} EWs")
            t0 = time.monotonic()
            rows.append(measure(shape, n, args, out))
            say("scale", f"{shape} x{n}: done in {time.monotonic() - t0:.0f} s: " + json.dumps(rows[-1], default=str))
            (out / "scale.json").write_text(json.dumps(rows, indent=1, default=str))
    print(table(rows))
    plot(rows, out / "scale.png")
    say("scale", f"wrote {out / 'scale.json'} and {out / 'scale.png'}")
    return 0
