"""`moe-fabric experiment failover`: one process of one role dies under load; what do clients see?

This is the paper's §7.2 experiment (Fig. 9), for every role: an expert or attention worker, the
checkpoint store, the orchestrator or a gateway. A seeded workload runs once without failure for
reference outputs. Then it runs again while the victim gets a signal `--at` seconds in. The
workload has token-id prompts of random ids, greedy, `ignore_eos` and a fixed output length. Its
load is Poisson arrivals, or a closed loop of C streams. The client resumes a broken stream with
`Last-Event-ID` (workload.py).

`--mode fabric` lets the fabric heal itself. `--mode restart-all` is the MegaScale-Infer-like
baseline. It stops every process and starts a fresh fabric, with weights reloaded. Then it
resubmits each unfinished request as prompt + tokens received, for the tokens that remain.

Metrics:
- the stall: for each stream decoding at the kill, the longer of its first two token gaps after it;
  the largest over the streams;
- time to first success;
- when the victim's process was gone;
- time back to 90 % of the pre-failure throughput;
- when the orchestrator declared the victim dead, and when its replacement (or restarted self) was
  ready;
- requests lost, and whether every output equals the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.errors import FabricError
from launch.config import ServeConfig
from launch.experiments import timeline as tl
from launch.experiments.detection import detection
from launch.experiments.failover_args import VICTIMS, check
from launch.experiments.logs import scan_logs
from launch.experiments.workload import Run, say

if TYPE_CHECKING:
    from launch.launcher import Proc
    from launch.local import Fabric


class Experiment:
    def __init__(self, args: argparse.Namespace) -> None:
        from fabric.model.config import ModelConfig
        from launch.local import ensure_demo_model, free_port

        self.args = args
        self.model = args.model or str(ensure_demo_model())
        self.vocab = ModelConfig.from_dir(self.model).vocab_size
        self.out = Path(args.out or f"results/failover-{args.role}-{args.mode}")
        port = free_port()
        self.loopback = None
        ray: dict[str, Any] = {}
        if args.cluster == "ray":
            ray = {"cluster": "ray", "ray_address": args.ray_address}
            if args.ray_address is None:
                from launch.loopback_ray import LoopbackRay

                say("failover", "starting a Ray cluster of 3 nodes on loopback ...")
                self.loopback = LoopbackRay(3)
                ray |= {"ray_address": self.loopback.address,
                        **{f"{r}_resources": '{"fabric": 1}' for r in ("orchestrator", "gateway", "aw", "ew", "store")}}
        # drain_timeout 0: a full restart does not wait for running requests.
        self.cfg = ServeConfig(**ray, model=self.model, attention_workers=args.attention_workers, transport=args.transport,
                               expert_workers=args.expert_workers, gateways=args.gateways, port=port,
                               drain_timeout=0.0, ready_timeout=180, checkpoint_stores=args.checkpoint_stores,
                               checkpoint="incremental" if args.checkpoint_stores else "off", sched=args.sched,
                               provisioner="none" if args.mode == "restart-all" else "auto",
                               weight_store=not args.no_weight_store, standby_workers=args.standby_workers,
                               pin_workers=args.pin_workers, device=args.device, kernel=args.kernel)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.fabrics: list[Fabric] = []
        # Not the default executor: asyncio.run would wait for a fabric start before a Ctrl-C.
        self.spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-spawner")
        self.aborted = False
        self.fabric = self._new_fabric("logs")

    def _new_fabric(self, logs: str) -> Fabric:
        from launch.local import Fabric

        (self.out / logs).mkdir(parents=True, exist_ok=True)
        delay = self.args.replacement_delay_ms
        extra = {"orchestrator": ["--replacement-delay-ms", str(delay)]} if delay is not None else None
        fabric = Fabric(self.cfg, extra_args=extra, log_dir=str(self.out / logs))
        # Registered before start, so cleanup stops it whatever happens.
        self.fabrics.append(fabric)
        return fabric

    def start(self) -> None:
        t = time.monotonic()
        self.fabric.start()
        # In short slices, so an aborted experiment does not wait for a whole start.
        while True:
            try:
                self.fabric.wait_ready(1.0)
                break
            except FabricError:
                if self.aborted or self.fabric.supervisor.failure or time.monotonic() - t > self.cfg.ready_timeout:
                    raise
        say("failover", f"fabric ready in {time.monotonic() - t:.1f} s ({self.cfg.attention_workers} AW + "
                        f"{self.cfg.expert_workers} EW + {self.cfg.gateways} gateways over {self.cfg.transport}, "
                        f"logs in {self.fabric.log_dir})")

    def restart(self) -> None:
        t = time.monotonic()
        self.fabric.stop()
        say("failover", f"restart-all: every process stopped in {time.monotonic() - t:.2f} s; starting a fresh fabric")
        if self.aborted:
            return
        self.fabric = self._new_fabric("logs-restart")
        self.start()

    def stop_all(self) -> None:
        for fabric in list(self.fabrics):
            fabric.stop()

    def close(self) -> None:
        self.stop_all()
        if self.loopback is not None:
            self.loopback.shutdown()
            self.loopback = None

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

    def workload(self, name: str, limit: int | None = None) -> Run:
        a = self.args
        return Run(name, self.url, a.tokens, self.prompt, a.duration, a.concurrency,
                   None if a.concurrency else self.arrivals(), limit, resume=a.mode == "fabric", tag="failover")


class Injection:
    """The failure run's kill and, for restart-all, the restart."""

    def __init__(self, exp: Experiment, run: Run) -> None:
        self.exp, self.run = exp, run
        self.kill: float | None = None
        # time.time() of the kill, to compare with the orchestrator's clock.
        self.kill_wall: float | None = None
        self.victim_pid: int | None = None
        # When the victim's process had exited. After SIGSTOP it stays.
        self.gone: float | None = None
        # --role node: the processes of the other nodes -> their pid.
        self.survivors: dict[str, int] = {}
        self.ready: float | None = None  # restart-all: when the fresh fabric was ready

    async def inject(self, at: float) -> None:
        run, args = self.run, self.exp.args
        await asyncio.sleep(max(0.0, at - run.now()))
        # A kill with no stream decoding interrupts none, and measures no stall: the signal waits for one (up to the
        # run's end; an open loop's arrivals can leave gaps of a few hundred ms where nothing is in flight).
        while not any(s.times and not s.done for s in run.streams) and run.now() < args.duration:
            await asyncio.sleep(0.005)
        if run.now() - at > 0.01:
            say("failover", f"{run.name}: no stream was decoding at t={at:.2f} s; the signal waited "
                            f"{(run.now() - at) * 1e3:.0f} ms for one")
        name = args.node_of if args.role == "node" else VICTIMS[args.role]
        victim = next(p for n, p in self.exp.fabric.procs if n == name)
        sig = signal.Signals[f"SIG{args.signal}"]
        what = f"{sig.name} {name}"
        if args.role == "node":
            sig = signal.SIGKILL
            sup: Any = self.exp.fabric.supervisor
            node = sup.node_of(name)
            on_node = sorted(n for n, p in self.exp.fabric.procs if getattr(p, "node_id", None) == node)
            self.survivors = {n: p.pid for n, p in self.exp.fabric.procs if getattr(p, "node_id", None) != node}
            what = f"node {node[:8]} ({', '.join(on_node)})"
            if self.exp.loopback is not None:
                self.exp.loopback.remove_node(node)
            else:
                sup.kill_node(node)
        else:
            victim.send_signal(sig)
        self.kill, self.victim_pid, self.kill_wall = run.now(), victim.pid, time.time()
        say("failover", f"{run.name}: t={self.kill:.2f} s {what} (pid {victim.pid}), "
                        f"{sum(len(s.tokens) for s in run.streams)} tokens so far")
        watch = asyncio.create_task(self.watch_exit(victim)) if sig != signal.SIGSTOP else None
        if args.mode == "restart-all":
            run.up.clear()
            for task in list(run.attempts):
                task.cancel()
            await asyncio.get_running_loop().run_in_executor(self.exp.spawner, self.exp.restart)
            self.ready = run.now()
            say("failover", f"{run.name}: t={self.ready:.2f} s fresh fabric ready; resubmitting unfinished requests")
            run.up.set()
        if watch is not None:
            await watch

    async def watch_exit(self, victim: Proc) -> None:
        """Records when the victim's process is gone, waiting at most 10 s.

        The thread's own wait is bounded. Otherwise a victim that never exits, such as an
        orchestrator Ray restarts elsewhere, would hold asyncio.run's executor shutdown for ever."""
        try:
            await asyncio.to_thread(victim.wait, 10.0)
            self.gone = self.run.now()
        except (TimeoutError, subprocess.TimeoutExpired):
            pass


def report(exp: Experiment, ref: Run, fail: Run, inj: Injection, cluster: dict[str, Any] | None = None) -> int:
    args, kill = exp.args, inj.kill
    assert kill is not None
    times = [s.times for s in fail.streams]
    series = tl.throughput(times, anchor=kill)
    ref_series = tl.throughput([s.times for s in ref.streams], anchor=kill)  # same workload, no failure
    baseline, ttp = tl.recovery(series, kill)
    gaps = tl.token_gaps(times)
    stall, tfs = tl.stall(times, kill), tl.first_success(times, kill)
    # The same measure on the failure-free run at the same moment, which a stall reads against.
    stall_ref = tl.stall([s.times for s in ref.streams], kill)
    reference = {s.index: s.tokens for s in ref.streams}
    differ = [s.index for s in fail.streams if reference.get(s.index) != s.tokens]
    gone = fail.lost(args.tokens)
    found = detection(inj, cluster)
    now = dict((n, p.pid) for n, p in exp.fabric.procs) if inj.survivors else {}
    # A survivor with a new pid, or gone.
    restarted = sorted(n for n, pid in inj.survivors.items() if now.get(n) != pid)
    metrics = {"kill_at_s": kill, "victim_gone_s": None if inj.gone is None else inj.gone - kill,
               "new_fabric_ready_s": inj.ready, "stall_s": stall, "stall_without_failure_s": stall_ref,
               "normal_gap_s": tl.normal_gap(times, kill),
               "time_to_first_success_s": tfs, "baseline_tok_s": baseline,
               "time_to_90pct_throughput_s": ttp, "requests": len(fail.streams), "requests_lost": len(gone),
               "lost": gone, "outputs_equal": not differ, "differing": differ,
               "client_resumes": sum(s.resumes for s in fail.streams),
               "resubmitted": sum(1 for s in fail.streams if s.attempts > 1),
               "survivors_restarted": restarted,
               "output_tokens": sum(len(t) for t in times), "reference_requests": len(ref.streams),
               **found}
    notes = scan_logs(exp.out)
    config = {**vars(args), "model": exp.model, "out": str(exp.out), "victim": VICTIMS[args.role],
              "victim_pid": inj.victim_pid, "survivors": inj.survivors, "load": f"closed loop C={args.concurrency}" if args.concurrency
              else f"Poisson {args.rate} req/s", "transport": args.transport, "window_s": tl.WINDOW}
    result = {"config": config, "metrics": metrics, "throughput": [[round(t, 3), v] for t, v in series],
              "reference_throughput": [[round(t, 3), v] for t, v in ref_series],
              "gaps": [[round(t, 4), round(g, 5), i] for t, g, i in gaps], "log_notes": notes,
              # Every stream's token times, of both runs, for a later definition of a measure to read.
              "times": [[round(t, 4) for t in ts] for ts in times],
              "reference_times": [[round(t, 4) for t in s.times] for s in ref.streams],
              "requests": [{k: v for k, v in asdict(s).items() if k not in ("prompt", "tokens", "times")}
                           | {"first_token": s.times[0] if s.times else None, "n_tokens": len(s.tokens)}
                           for s in fail.streams]}
    (exp.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")

    def f(x: float | None, unit: str = " s", sign: str = "") -> str:
        return "never" if x is None else f"{sign}{x:.2f}{unit}"

    summary = (f"failover role={args.role} signal={args.signal} mode={args.mode}: stall {f(stall)} (without the "
               f"failure {f(stall_ref)}), first success "
               f"{f(tfs, sign='+')}, back to 90% throughput {f(ttp, sign='+')}, "
               + (f"declared dead {f(found['detected_s'], sign='+')}, back {f(found['replacement_ready_s'], sign='+')}, "
                  if args.mode == "fabric" else "")
               + (f"processes of surviving nodes restarted: {', '.join(restarted) or 'none'}, " if inj.survivors else "")
               + f"lost {len(gone)}, outputs equal to failure-free run: {'yes' if not differ else 'no'}")
    plotted = tl.plot_timeline(exp.out / "timeline.png", gaps, series, kill, f"SIG{args.signal} {VICTIMS[args.role]}",
                               summary, ready=inj.ready, reference=ref_series)
    for note in notes:
        say("failover", f"log: {note}")
    say("failover", f"wrote {exp.out / 'results.json'}" + (f" and {exp.out / 'timeline.png'}" if plotted else
                                                            " (no plot: pip install 'moe-fabric[experiments]')"))
    print(summary, flush=True)
    return 1 if gone or differ or restarted else 0


def run(args: argparse.Namespace) -> int:
    check(args)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    exp = Experiment(args)
    try:
        say("failover", f"role={args.role} mode={args.mode} cluster={args.cluster} model={exp.model} out={exp.out}")
        exp.start()
        ref = exp.workload("reference run")
        say("failover", "reference run (no failure) ...")
        asyncio.run(ref.run())
        if ref.lost(args.tokens):
            raise FabricError(f"the reference run lost requests {ref.lost(args.tokens)}; see {exp.out}/logs")
        say("failover", f"reference run: {len(ref.streams)} requests complete")
        fail = exp.workload("failure run", limit=len(ref.streams) if args.concurrency else None)
        inj = Injection(exp, fail)
        asyncio.run(fail.run(inj.inject(args.at)))
        if inj.kill is None:
            raise FabricError(f"the failure run ended before the kill at {args.at} s; raise --duration")
        cluster = None
        if args.mode == "fabric":
            if args.signal == "STOP" and inj.victim_pid:
                with contextlib.suppress(ProcessLookupError):  # its supervisor may have killed it
                    os.kill(inj.victim_pid, signal.SIGCONT)  # fenced: it exits once woken
            cluster = _settled_cluster(exp, args.role)
        say("failover", f"failure run: {len(fail.streams)} requests; stopping the fabric")
        exp.stop_all()
        return report(exp, ref, fail, inj, cluster)
    except KeyboardInterrupt:
        print("[failover] interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        exp.aborted = True
        exp.stop_all()
        exp.spawner.shutdown(wait=True, cancel_futures=True)  # a restart in progress gives up within ~1 s
        exp.close()  # whatever it spawned meanwhile, and a loopback Ray cluster
        signal.signal(signal.SIGTERM, previous)


def _settled_cluster(exp: Experiment, role: str) -> dict[str, Any] | None:
    """The cluster view once the victim is replaced or back, bounded, for the detection times."""
    deadline = time.monotonic() + (60.0 if role == "node" else 15.0)
    cluster = None
    while time.monotonic() < deadline:
        try:
            cluster = exp.fabric.cluster()
        except OSError:  # the orchestrator itself is restarting
            time.sleep(0.2)
            continue
        alive = [w["role"] for w in cluster["workers"] if w["state"] == "alive"]
        # Every replacement is up: the AWs back to their number, every slot filled.
        if role == "node":
            settled = (alive.count("attention") >= exp.cfg.attention_workers
                       and not cluster.get("redundancy", {}).get("slots_vacant"))
        else:
            settled = role != "gateway" or alive.count("gateway") >= exp.cfg.gateways
        if not cluster.get("recovering") and settled:
            return cluster
        time.sleep(0.2)
    return cluster
