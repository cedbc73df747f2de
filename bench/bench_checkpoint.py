"""Checkpointing benchmarks on the `bench` demo model (Tarragon Fig. 12 and §7.4).

A. Recovery vs failure point. One greedy stream runs; once it has N output tokens its AW gets
   SIGKILL and the stream resumes on the other AW by (a) per-request restoration from the
   checkpoint store, (b) parallel replay (re-prefill prompt + N tokens in one go) or (c)
   sequential replay (re-decode the N tokens one per step). Reported: the stall the client sees
   (largest token gap), tokens recomputed, bytes moved from the store.
B. Steady-state throughput, side by side in one run (fabrics up together, alternating rounds):
   no checkpointing, incremental checkpointing, and pause-checkpoint-resume every 8 steps; plus
   the share of checkpoint bytes sent in the idle gaps of the AW-EW link and how far the
   checkpointed frontier trails the live one.

    python bench/bench_checkpoint.py --points 16,64,256,1024 --repeats 3 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import scan_logs
from rounds import fabric_round, make_prompts  # bench/ is on sys.path when run as a script

from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from launch.config import ServeConfig
from launch.local import Fabric, free_port

RECOVERY = {
    "restore (store)": {"resume": "restore", "checkpoint_stores": 1},
    "parallel replay": {"resume": "parallel", "checkpoint_stores": 0, "checkpoint": "off"},
    "sequential replay": {"resume": "sequential", "checkpoint_stores": 0, "checkpoint": "off"},
}
STEADY = {
    "no checkpointing": {"checkpoint": "off", "checkpoint_stores": 0},
    "incremental": {"checkpoint": "incremental", "checkpoint_stores": 1},
    "pause-checkpoint-resume /8": {"checkpoint": "pause", "checkpoint_stores": 1},
}


def start(model: Path, log_root: str, name: str, **over: Any) -> Fabric:
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=2, gateways=1, transport="tcp",
                      port=free_port(), ready_timeout=300, routing="round-robin", **over)
    fab = Fabric(cfg, log_dir=tempfile.mkdtemp(prefix=f"{name.split()[0]}-", dir=log_root))
    try:
        fab.start()
        fab.wait_ready(cfg.ready_timeout)
    except BaseException:
        fab.stop()
        raise
    return fab


async def kill_at(fab: Fabric, prompt: list[int], point: int, tail: int) -> dict[str, Any]:
    """Streams one request; SIGKILLs its AW once `point` tokens arrived. Round-robin routing sends
    a fresh gateway's first request to the second AW it connected to (its log says which)."""
    assert fab.log_dir is not None
    deadline = time.monotonic() + 30
    while len(order := re.findall(r"connected to (aw-\d+)", (Path(fab.log_dir) / "gateway-0.log").read_text())) < 2:
        if time.monotonic() > deadline:  # the gateway may still be connecting when /v1/models answers
            raise RuntimeError(f"the gateway connected to {order} only")
        await asyncio.sleep(0.1)
    victim = order[1]
    aw = next(w for w in fab.cluster()["workers"] if w["id"] == victim)
    url = f"http://127.0.0.1:{fab.port}/v1/completions"
    body = {"prompt": prompt, "max_tokens": point + tail, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    times: list[float] = []
    killed = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session, \
            session.post(url, json=body) as resp:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            times.extend(now for _ in chunk["choices"][0].get("token_ids") or [])
            if killed is None and len(times) >= point:
                os.kill(aw["pid"], signal.SIGKILL)
                killed = now
    assert killed is not None and len(times) == point + tail, (killed, len(times))
    assert "resuming after" in (Path(fab.log_dir) / "gateway-0.log").read_text(), "the request was not on the victim"
    stall = max(b - a for a, b in zip(times, times[1:]) if b > killed)
    normal = statistics.median(b - a for a, b in zip(times[:point], times[1:point]))
    # The restoring AW logs how long its fetch and cache writes took (Tarragon's restoration time).
    logs = "".join(p.read_text() for p in Path(fab.log_dir).glob("attention-worker*.log"))
    restore = [float(ms) / 1e3 for ms in re.findall(r"checkpoint in ([0-9.]+) ms", logs)]
    return {"stall_s": stall, "tbt_s": normal, "restore_s": restore[0] if restore else None}


def aw_stats(fab: Fabric) -> dict[str, float]:
    deadline = time.monotonic() + 5
    time.sleep(1.2)  # one stats period
    while True:
        workers = fab.cluster()["workers"]
        stores = [w["stats"] for w in workers if w["role"] == "checkpoint_store" and w["state"] == "alive"]
        aws = [w["stats"] for w in workers if w["role"] == "attention" and w["state"] == "alive"]
        if aws or time.monotonic() > deadline:
            return {"restored_tokens": sum(a.get("restored_tokens", 0) for a in aws),
                    "restored_bytes": sum(s.get("restored_bytes", 0) for s in stores)}
        time.sleep(0.3)


def recovery(model: Path, log_root: str, points: list[int], repeats: int, vocab: int,
             partial: Path, modes: list[str]) -> list[dict[str, Any]]:
    """Rows so far are rewritten to `partial` after each failure point (a long run that breaks
    keeps what it measured)."""
    rows = []
    prompt = make_prompts(1, 16, vocab, 1)[0]
    for name in modes:
        over = RECOVERY[name]
        for point in points:
            runs = []
            for rep in range(repeats):
                fab = start(model, log_root, name, **over)
                try:
                    r = asyncio.run(kill_at(fab, prompt, point, 16))
                    r.update(aw_stats(fab))
                finally:
                    fab.stop()
                runs.append(r)
                print(f"  {name} N={point} [{rep + 1}/{repeats}]: stall {r['stall_s'] * 1e3:.1f} ms "
                      f"(normal gap {r['tbt_s'] * 1e3:.1f} ms), restored {r['restored_tokens']} tokens", flush=True)
            restored = statistics.median(r["restored_tokens"] for r in runs)
            rows.append({"mode": name, "point": point, "stall_s": statistics.median(r["stall_s"] for r in runs),
                         "tbt_s": statistics.median(r["tbt_s"] for r in runs), "restored_tokens": restored,
                         "recomputed_tokens": 16 + point - restored,
                         "bytes_moved": statistics.median(r["restored_bytes"] for r in runs),
                         "stall_runs_s": [r["stall_s"] for r in runs],
                         "restore_s": statistics.median(x) if (x := [r["restore_s"] for r in runs if r["restore_s"]]) else None})
            partial.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def cpu_seconds(fab: Fabric) -> float | None:
    """User + system CPU time of every process of a fabric so far (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for _, proc in fab.procs:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def steady(model: Path, log_root: str, rounds: int, conc: int, tokens: int, vocab: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    prompts = make_prompts(conc, 32, vocab, 0)
    fabs: dict[str, Fabric] = {}
    raw: dict[str, list[float]] = {name: [] for name in STEADY}
    try:
        for name, over in STEADY.items():
            fabs[name] = start(model, log_root, name, **over)
            asyncio.run(fabric_round(f"http://127.0.0.1:{fabs[name].port}/v1/completions", prompts, 16))  # warm-up at full concurrency
        cpu0 = {name: cpu_seconds(fab) for name, fab in fabs.items()}
        for r in range(rounds):
            order = list(STEADY) if r % 2 == 0 else list(reversed(STEADY))
            for name in order:
                st = asyncio.run(fabric_round(f"http://127.0.0.1:{fabs[name].port}/v1/completions", prompts, tokens))
                raw[name].append(st["tok_s"])
                print(f"  round {r + 1}/{rounds} {name}: {st['tok_s']:.1f} tok/s", flush=True)
        cpu1 = {name: cpu_seconds(fab) for name, fab in fabs.items()}
        tokens_out = rounds * conc * tokens
        cpu_per_ktok = {name: (cpu1[name] - c0) / tokens_out * 1000 if c0 is not None and cpu1[name] is not None
                        else None for name, c0 in cpu0.items()}
        time.sleep(1.2)
        aws = [w["stats"] for w in fabs["incremental"].cluster()["workers"] if w["role"] == "attention"]
        sent = sum(a.get("ckpt_bytes_sent", 0) for a in aws)
        gaps = sum(a.get("ckpt_bytes_in_gaps", 0) for a in aws)
        lag = [a.get("ckpt_lag_tokens_p50") for a in aws if a.get("ckpt_lag_tokens_p50") is not None]
        lag_max = [a.get("ckpt_lag_tokens_max") for a in aws if a.get("ckpt_lag_tokens_max") is not None]
        paused = [w["stats"] for w in fabs["pause-checkpoint-resume /8"].cluster()["workers"] if w["role"] == "attention"]
        info = {"ckpt_bytes_sent": sent, "gap_share": gaps / sent if sent else None,
                "lag_tokens_p50": max(lag) if lag else None, "lag_tokens_max": max(lag_max) if lag_max else None,
                "dropped_bytes": sum(a.get("ckpt_dropped_bytes", 0) for a in aws),
                "pause_s": sum(a.get("ckpt_pause_s", 0.0) for a in paused), "cpu_s_per_1000_tokens": cpu_per_ktok}
    finally:
        for fab in fabs.values():
            fab.stop()
    return raw, info


def plot(rec: list[dict[str, Any]], raw: dict[str, list[float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rec:
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode in dict.fromkeys(r["mode"] for r in rec):
            pts = [r for r in rec if r["mode"] == mode]
            ax.plot([r["point"] for r in pts], [r["stall_s"] * 1e3 for r in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("failure point: output tokens already decoded")
        ax.set_ylabel("stall seen by the client (ms, median)")
        ax.set_title("AW SIGKILL: restoration vs replay (bench demo model)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "checkpoint_recovery.png", dpi=120)
        plt.close(fig)
    if raw:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(raw)
        ax.bar(range(len(names)), [statistics.median(raw[n]) for n in names])
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("output tokens/s (median)")
        ax.set_title("steady-state throughput by checkpointing mode")
        fig.tight_layout()
        fig.savefig(out / "checkpoint_throughput.png", dpi=120)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--points", default="16,64,256,1024", help="failure points (output tokens decoded before the kill)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--skip", choices=["recovery", "steady"], default=None)
    ap.add_argument("--modes", default=",".join(RECOVERY), help="comma-separated recovery modes to measure")
    ap.add_argument("--recovery-json", type=Path, default=None,
                    help="report the recovery rows an earlier run wrote (checkpoint_recovery.partial.json) instead of measuring them")
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    if not (args.model_dir / "config.json").exists():
        print(f"writing the bench demo model to {args.model_dir} ...", flush=True)
        write_demo_model(args.model_dir, arch="mixtral", size="bench")
    vocab = ModelConfig.from_dir(args.model_dir).vocab_size
    log_root = tempfile.mkdtemp(prefix="bench-checkpoint-logs-")
    points = [int(p) for p in args.points.split(",") if p.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.recovery_json:  # rows measured by an earlier run
        rec = json.loads(args.recovery_json.read_text())
    elif args.skip == "recovery":
        rec = []
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if unknown := [m for m in modes if m not in RECOVERY]:
            sys.exit(f"unknown recovery modes {unknown}; choose from {list(RECOVERY)}")
        rec = recovery(args.model_dir, log_root, points, args.repeats, vocab,
                       args.out / "checkpoint_recovery.partial.json", modes)
    raw, info = ({}, {}) if args.skip == "steady" else steady(args.model_dir, log_root, args.rounds, args.concurrency,
                                                               args.tokens, vocab)
    print(f"\n`{command}`\n")
    if rec:
        print("| resume by | failure point (tokens) | stall (median) | normal token gap | restore on the AW (fetch + "
              "writes) | recomputed tokens | KV bytes from the store |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rec:
            restore = f"{r['restore_s'] * 1e3:.1f} ms" if r.get("restore_s") else "–"
            print(f"| {r['mode']} | {r['point']} | {r['stall_s'] * 1e3:.1f} ms | {r['tbt_s'] * 1e3:.1f} ms | {restore} | "
                  f"{r['recomputed_tokens']:.0f} | {r['bytes_moved'] / 2**20:.2f} MiB |")
        for p in points:
            by = {r["mode"]: r["stall_s"] for r in rec if r["point"] == p}
            if "restore (store)" in by and "sequential replay" in by:
                print(f"N={p}: sequential replay / restore = {by['sequential replay'] / by['restore (store)']:.1f}x, "
                      f"parallel replay / restore = {by['parallel replay'] / by['restore (store)']:.1f}x")
    if raw:
        base = raw["no checkpointing"]
        cpu = info.get("cpu_s_per_1000_tokens", {})
        print("\n| checkpointing | output tok/s (median) | min | max | vs none (medians) | vs none (median of "
              "per-round ratios) | CPU s per 1000 tokens (all processes) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, vals in raw.items():
            paired = statistics.median(x / b for x, b in zip(vals, base, strict=True))  # same round: same noise
            c = cpu.get(name)
            print(f"| {name} | {statistics.median(vals):.1f} | {min(vals):.1f} | {max(vals):.1f} | "
                  f"{statistics.median(vals) / statistics.median(base):.3f}x | {paired:.3f}x | "
                  f"{'–' if c is None else f'{c:.2f}'} |")
        gap = info["gap_share"]
        print(f"\nincremental: {info['ckpt_bytes_sent'] / 2**20:.1f} MiB sent, "
              f"{'–' if gap is None else f'{gap * 100:.1f}%'} of it while expert calls were in flight (link idle "
              f"gaps); checkpointed frontier behind the live one by {info['lag_tokens_p50']} tokens (median), "
              f"{info['lag_tokens_max']} at most; dropped {info['dropped_bytes']} bytes; "
              f"pause mode spent {info['pause_s']:.1f} s paused")
    for note in scan_logs(log_root):
        print(f"note: {note}")
    (args.out / "checkpoint.json").write_text(json.dumps({"command": command, "recovery": rec, "steady": raw,
                                                          "steady_info": info}, indent=2) + "\n")
    plot(rec, raw, args.out)
    print(f"wrote {args.out / 'checkpoint.json'} and PNGs in {args.out}")


if __name__ == "__main__":
    main()
