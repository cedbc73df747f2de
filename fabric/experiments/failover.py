"""`moe-fabric experiment failover`: SIGINT one worker under load and measure what the clients see.

The paper's §7.2 experiment (Fig. 9). A seeded workload (token-id prompts of random ids, greedy,
`ignore_eos`, fixed output length; Poisson arrivals, or a closed loop of C streams) runs once
without failure for reference outputs, then again while one worker of the chosen role gets
SIGINT `--at` seconds in. `--mode fabric` lets the fabric heal itself; `--mode restart-all` is the
MegaScale-Infer-like baseline: stop every process, start a fresh fabric (weights reloaded) and
resubmit each unfinished request as prompt + tokens received, for the tokens that remain.
Metrics: the stall (per stream the longer of its first two token gaps after the kill, the
largest over the streams), time to first success, when the victim's process was gone, time back
to 90 % of the pre-failure throughput, requests lost, and whether every output equals the
reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.config import ServeConfig
from fabric.errors import ConfigError, FabricError
from fabric.experiments import timeline as tl
from fabric.experiments.workload import VICTIMS, Run, say

if TYPE_CHECKING:
    from fabric.launcher import Fabric


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=["expert", "attention"], default="expert", help="which kind of worker dies")
    p.add_argument("--at", type=float, default=5.0, help="seconds into the failure run to send SIGINT")
    p.add_argument("--duration", type=float, default=15.0, help="seconds during which requests are issued")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default 4)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: C streams always in flight")
    p.add_argument("--signal", choices=["INT", "KILL", "STOP"], default="INT",
                   help="what the victim gets: SIGINT (the paper's), SIGKILL, or SIGSTOP (a hung process, found by probes)")
    p.add_argument("--mode", choices=["fabric", "restart-all"], default="fabric")
    p.add_argument("--out", default=None, help="default: results/failover-<role>-<mode>")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the cached demo model)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--attention-workers", type=int, default=2)
    p.add_argument("--expert-workers", type=int, default=3)
    p.add_argument("--checkpoint-stores", type=int, default=1,
                   help="0: no KV checkpoints, a dead AW's streams resume by replay")
    p.add_argument("--transport", choices=["tcp", "ucx"], default="tcp", help="the fabric's transport")
    p.add_argument("--sched", choices=["auto", "batch", "normal"], default="auto", help="the workers' CPU scheduling class")
    p.add_argument("--replacement-delay-ms", type=float, default=None,
                   help="the orchestrator's delay before it starts a replacement (default: its own)")
    p.add_argument("--seed", type=int, default=0)


class Experiment:
    def __init__(self, args: argparse.Namespace) -> None:
        from fabric.launcher import ensure_demo_model, free_port
        from fabric.model.config import ModelConfig

        self.args = args
        self.model = args.model or str(ensure_demo_model())
        self.vocab = ModelConfig.from_dir(self.model).vocab_size
        self.out = Path(args.out or f"results/failover-{args.role}-{args.mode}")
        port = free_port()
        # drain_timeout 0: a full restart does not wait for running requests.
        self.cfg = ServeConfig(model=self.model, attention_workers=args.attention_workers, transport=args.transport,
                               expert_workers=args.expert_workers, port=port, drain_timeout=0.0, ready_timeout=180,
                               checkpoint_stores=args.checkpoint_stores,
                               checkpoint="incremental" if args.checkpoint_stores else "off", sched=args.sched,
                               provisioner="none" if args.mode == "restart-all" else "local")
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.fabrics: list[Fabric] = []
        # The fresh fabric of restart-all is spawned from this thread, which lives as long as the
        # experiment: children get PDEATHSIG when the *thread* that spawned them exits. Not the
        # default executor either: asyncio.run would wait for a fabric start before a Ctrl-C.
        self.spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-spawner")
        self.aborted = False
        self.fabric = self._new_fabric("logs")

    def _new_fabric(self, logs: str) -> Fabric:
        from fabric.launcher import Fabric

        (self.out / logs).mkdir(parents=True, exist_ok=True)
        delay = self.args.replacement_delay_ms
        extra = {"orchestrator": ["--replacement-delay-ms", str(delay)]} if delay is not None else None
        fabric = Fabric(self.cfg, extra_args=extra, log_dir=str(self.out / logs))
        self.fabrics.append(fabric)  # registered before start: cleanup stops it whatever happens
        return fabric

    def start(self) -> None:
        t = time.monotonic()
        self.fabric.start()
        while True:  # in short slices, so an aborted experiment does not wait for a restart
            try:
                self.fabric.wait_ready(1.0)
                break
            except FabricError:
                if self.aborted or time.monotonic() - t > self.cfg.ready_timeout or any(
                        p.poll() is not None for _, p in self.fabric.procs):
                    raise
        say(f"fabric ready in {time.monotonic() - t:.1f} s ({self.cfg.attention_workers} AW + "
            f"{self.cfg.expert_workers} EW over {self.cfg.transport}, logs in {self.fabric.log_dir})")

    def restart(self) -> None:
        t = time.monotonic()
        self.fabric.stop(grace=5.0)
        say(f"restart-all: every process stopped in {time.monotonic() - t:.2f} s; starting a fresh fabric")
        if self.aborted:
            return
        self.fabric = self._new_fabric("logs-restart")
        self.start()

    def stop_all(self) -> None:
        for fabric in list(self.fabrics):
            fabric.stop(grace=5.0)

    def prompt(self, i: int) -> list[int]:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        return [rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len)]  # ids 0-2 are special

    def arrivals(self) -> list[float]:
        rng, t, out = random.Random(self.args.seed), 0.0, list[float]()
        while True:
            t += rng.expovariate(self.args.rate)
            if t >= self.args.duration:
                return out
            out.append(t)


def lost(run: Run, tokens: int) -> list[int]:
    return [s.index for s in run.streams if s.error or len(s.tokens) != tokens]


def scan_logs(out: Path) -> list[str]:
    notes = []
    for p in sorted(out.glob("logs*/*.log")):
        bad = [ln for ln in p.read_text(errors="replace").splitlines() if "Traceback" in ln or " ERROR " in ln]
        if bad:
            notes.append(f"{p}: {len(bad)} traceback/error line(s), first: {bad[0].strip()[:160]}")
    return notes


def detection(exp: Experiment, fail: Run, cluster: dict[str, Any] | None) -> dict[str, float | None]:
    """From the orchestrator's authoritative view: when the victim was declared dead and when its
    replacement was ready, in seconds after the kill (wall clocks of one host)."""
    out: dict[str, float | None] = {"suspected_s": None, "detected_s": None, "replacement_ready_s": None}
    if cluster is None or fail.kill_wall is None:
        return out
    victim = next((w for w in cluster["workers"] if w["pid"] == fail.victim_pid), None)
    if victim is None or victim["state"] != "dead":
        return out
    out["detected_s"] = victim["state_since"] - fail.kill_wall
    # The first peer that found it dead and started rerouting (an AW, for an EW victim).
    found = [w["stats"].get("suspected_at", {}).get(victim["id"]) for w in cluster["workers"]]
    found = [t for t in found if t is not None]
    out["suspected_s"] = min(found) - fail.kill_wall if found else None
    new = next((w for w in cluster["workers"] if w["info"].get("replaces") == victim["id"] and w["state"] == "alive"), None)
    if new is None and victim["role"] == "attention":  # AWs take no slot; the AW that registered after the kill
        new = next((w for w in cluster["workers"] if w["role"] == "attention" and w["state"] == "alive"
                    and w["registered_at"] > fail.kill_wall), None)
    if new is not None:
        out["replacement_ready_s"] = new["state_since"] - fail.kill_wall
    return out


def report(exp: Experiment, ref: Run, fail: Run, cluster: dict[str, Any] | None = None) -> int:
    args, kill = exp.args, fail.kill
    assert kill is not None
    times = [s.times for s in fail.streams]
    series = tl.throughput(times, anchor=kill)
    ref_series = tl.throughput([s.times for s in ref.streams], anchor=kill)  # same workload, no failure
    baseline, ttp = tl.recovery(series, kill)
    gaps = tl.token_gaps(times)
    stall, tfs = tl.stall(times, kill), tl.first_success(times, kill)
    reference = {s.index: s.tokens for s in ref.streams}
    differ = [s.index for s in fail.streams if reference.get(s.index) != s.tokens]
    gone = lost(fail, args.tokens)
    found = detection(exp, fail, cluster)
    metrics = {"kill_at_s": kill, "victim_gone_s": None if fail.gone is None else fail.gone - kill,
               "new_fabric_ready_s": fail.ready, "stall_s": stall,
               "time_to_first_success_s": tfs, "baseline_tok_s": baseline,
               "time_to_90pct_throughput_s": ttp, "requests": len(fail.streams), "requests_lost": len(gone),
               "lost": gone, "outputs_equal": not differ, "differing": differ,
               "resubmitted": sum(1 for s in fail.streams if s.attempts > 1),
               "output_tokens": sum(len(t) for t in times), "reference_requests": len(ref.streams),
               **found}
    notes = scan_logs(exp.out)
    config = {**vars(args), "model": exp.model, "out": str(exp.out), "victim": VICTIMS[args.role],
              "victim_pid": fail.victim_pid, "load": f"closed loop C={args.concurrency}" if args.concurrency
              else f"Poisson {args.rate} req/s", "transport": args.transport, "window_s": tl.WINDOW}
    result = {"config": config, "metrics": metrics, "throughput": [[round(t, 3), v] for t, v in series],
              "reference_throughput": [[round(t, 3), v] for t, v in ref_series],
              "gaps": [[round(t, 4), round(g, 5), i] for t, g, i in gaps], "log_notes": notes,
              "requests": [{k: v for k, v in asdict(s).items() if k not in ("prompt", "tokens", "times")}
                           | {"first_token": s.times[0] if s.times else None, "n_tokens": len(s.tokens)}
                           for s in fail.streams]}
    (exp.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")

    def f(x: float | None, unit: str = " s", sign: str = "") -> str:
        return "never" if x is None else f"{sign}{x:.2f}{unit}"

    detected = found["detected_s"]
    summary = (f"failover role={args.role} signal={args.signal} mode={args.mode}: stall {f(stall)}, first success "
               f"{f(tfs, sign='+')}, back to 90% throughput {f(ttp, sign='+')}, "
               + (f"found dead by a peer {f(found['suspected_s'], sign='+')}, declared dead {f(detected, sign='+')}, "
                  if args.mode == "fabric" else "")
               + f"lost {len(gone)}, outputs equal to failure-free run: {'yes' if not differ else 'no'}")
    tl.plot_timeline(exp.out / "timeline.png", gaps, series, kill, f"SIG{args.signal} {VICTIMS[args.role]}",
                     summary.replace(": ", ":\n", 1), ready=fail.ready, reference=ref_series)
    for note in notes:
        say(f"log: {note}")
    say(f"wrote {exp.out / 'results.json'} and {exp.out / 'timeline.png'}")
    print(summary, flush=True)
    return 1 if gone or differ else 0


def check(args: argparse.Namespace) -> None:
    if args.concurrency is None and args.rate is None:
        args.rate = 4.0
    if (args.rate is not None and args.rate <= 0) or (args.concurrency is not None and args.concurrency < 1):
        raise ConfigError("--rate must be > 0 and --concurrency >= 1")
    if not 0 < args.at < args.duration:
        raise ConfigError("--at must be inside (0, --duration)")
    if args.tokens < 1 or args.prompt_len < 1:
        raise ConfigError("--tokens and --prompt-len must be >= 1")
    need = args.expert_workers if args.role == "expert" else args.attention_workers
    if need < 2 and args.mode == "fabric":
        raise ConfigError(f"--mode fabric needs at least 2 {args.role} workers to survive losing one")


def run(args: argparse.Namespace) -> int:
    check(args)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    exp = Experiment(args)
    try:
        say(f"role={args.role} mode={args.mode} model={exp.model} out={exp.out}")
        exp.start()
        ref = Run(exp, "reference run")
        say("reference run (no failure) ...")
        asyncio.run(ref.run())
        if lost(ref, args.tokens):
            raise FabricError(f"the reference run lost requests {lost(ref, args.tokens)}; see {exp.out}/logs")
        say(f"reference run: {len(ref.streams)} requests complete")
        fail = Run(exp, "failure run", limit=len(ref.streams) if args.concurrency else None, kill_at=args.at)
        asyncio.run(fail.run())
        cluster = None
        if args.mode == "fabric":
            cluster = exp.fabric.cluster()
            if args.signal == "STOP" and fail.victim_pid:
                os.kill(fail.victim_pid, signal.SIGCONT)  # fenced: it exits once woken
        say(f"failure run: {len(fail.streams)} requests; stopping the fabric")
        exp.stop_all()
        return report(exp, ref, fail, cluster)
    except KeyboardInterrupt:
        print("[failover] interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        exp.aborted = True
        exp.stop_all()
        exp.spawner.shutdown(wait=True, cancel_futures=True)  # a restart in progress gives up within ~1 s
        exp.stop_all()  # whatever it spawned meanwhile
        signal.signal(signal.SIGTERM, previous)
