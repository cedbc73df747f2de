"""`moe-fabric experiment chaos`: a soak that kills processes under load.

Every `--kill-every` seconds it kills a random process of a random role, with SIGKILL, SIGINT or
SIGSTOP. The load is a closed-loop workload whose client resumes broken streams with `Last-Event-ID`.

Each kill is a single failure. Before the next one the soak waits, bounded, until the fabric is
whole again: every worker role back to its size, every expert with all its copies, and the
orchestrator not recovering. A stopped process is woken `--stop-for` seconds later. By then the
fabric will have fenced it, or its supervisor restarted it. Greedy outputs are compared with a
failure-free pass over the same prompts, made first.

It reports the stall per kill. For each stream decoding at the kill, that is the longer of its first
two token gaps after it, and the stall is the largest over the streams. Overall it reports requests
lost (an error, or fewer tokens than asked), corrupt (complete, but not the failure-free tokens)
and hung (not complete within `--deadline`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.errors import ConfigError, FabricError
from launch.config import ServeConfig
from launch.experiments import timeline as tl
from launch.experiments.logs import scan_logs
from launch.experiments.workload import Run, say

if TYPE_CHECKING:
    from launch.local import Fabric

ROLES = {"attention": "attention-worker", "expert": "expert-worker", "store": "checkpoint-store",
         "orchestrator": "orchestrator", "gateway": "gateway"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load and kills")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (after the fabric is whole)")
    p.add_argument("--roles", default=",".join(ROLES), help="roles to pick victims from")
    p.add_argument("--signals", default="KILL,INT,STOP", help="signals to pick from")
    p.add_argument("--stop-for", type=float, default=5.0, help="seconds a SIGSTOPped victim stays stopped")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: streams always in flight")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (the requests cycle through them)")
    p.add_argument("--deadline", type=float, default=120.0, help="a request not complete after this is hung")
    p.add_argument("--attention-workers", type=int, default=2)
    p.add_argument("--expert-workers", type=int, default=3)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--checkpoint-stores", type=int, default=1)
    p.add_argument("--transport", choices=["tcp", "ucx"], default="tcp")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the cached demo model)")
    p.add_argument("--out", default="results/chaos")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Kill:
    at: float  # seconds into the run
    role: str
    victim: str
    pid: int
    signal: str
    whole_after: float | None = None  # seconds until the fabric was whole again
    stall_s: float | None = None


class Chaos:
    def __init__(self, args: argparse.Namespace, fabric: Fabric, run: Run) -> None:
        self.args, self.fabric, self.run = args, fabric, run
        self.rng = random.Random(args.seed)
        self.roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        self.signals = [s.strip().upper() for s in args.signals.split(",") if s.strip()]
        self.kills: list[Kill] = []
        self.stopped: set[int] = set()
        self.woken: set[int] = set()
        self._wake: set[asyncio.Task[None]] = set()

    def whole(self, victim: Kill | None = None) -> bool:
        """Whether the fabric is whole again.

        That means every role back to its size, every expert with all its copies, and no recovery
        under way. The victim, if any, must be out of the view, or woken again (a SIGSTOP the fabric
        never saw)."""
        try:
            c = self.fabric.cluster()
        except OSError:
            return False
        if victim is not None and victim.pid not in self.woken and any(
                w["pid"] == victim.pid and w["state"] == "alive" for w in c["workers"]):
            return False
        a = self.args
        alive = [w["role"] for w in c["workers"] if w["state"] == "alive"]
        want = {"attention": a.attention_workers, "expert": a.expert_workers, "checkpoint_store": a.checkpoint_stores,
                "gateway": a.gateways}
        red = c.get("redundancy") or {}
        return (not c.get("recovering") and all(alive.count(r) >= n for r, n in want.items())
                and red.get("copies_min") == red.get("copies_wanted")
                and all(p.poll() is None for _, p in self.fabric.procs if _.startswith(("orchestrator", "gateway"))))

    async def wait_whole(self, victim: Kill, limit: float) -> float | None:
        """Seconds from the kill until the fabric is whole again, or None if not within `limit`."""
        while self.run.now() - victim.at < limit:
            if await asyncio.to_thread(self.whole, victim):
                return self.run.now() - victim.at
            await asyncio.sleep(0.1)
        return None

    def victims(self, role: str) -> list[tuple[str, Any]]:
        prefix = ROLES[role]
        return [(n, p) for n, p in self.fabric.procs
                if n.startswith(prefix) and p.poll() is None and p.pid not in self.stopped]

    async def loop(self) -> None:
        a = self.args
        while True:
            next_at = max((len(self.kills) + 1) * a.kill_every, self.run.now())
            if next_at + 2.0 > a.duration:
                return
            await asyncio.sleep(next_at - self.run.now())
            role = self.rng.choice(self.roles)
            sig = self.rng.choice(self.signals)
            candidates = self.victims(role)
            if not candidates:
                continue
            name, proc = self.rng.choice(candidates)
            proc.send_signal(signal.Signals[f"SIG{sig}"])
            kill = Kill(self.run.now(), role, name, proc.pid, sig)
            self.kills.append(kill)
            say("chaos", f"t={kill.at:6.1f} s  SIG{sig} {name} (pid {proc.pid})")
            if sig == "STOP":
                self.stopped.add(proc.pid)
                task = asyncio.create_task(self._wake_later(proc))
                self._wake.add(task)
                task.add_done_callback(self._wake.discard)
            kill.whole_after = await self.wait_whole(kill, max(3 * a.kill_every, 60.0))
            if kill.whole_after is None:
                say("chaos", "the fabric is not whole again; another kill would be a double fault: no more kills")
                return
            say("chaos", f"           whole again {kill.whole_after:.1f} s after")

    async def _wake_later(self, proc: Any) -> None:
        await asyncio.sleep(self.args.stop_for)
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        self.woken.add(proc.pid)


def report(args: argparse.Namespace, out: Path, run: Run, chaos: Chaos, reference: dict[int, list[int]]) -> int:
    times = [s.times for s in run.streams]
    for i, k in enumerate(chaos.kills):
        end = chaos.kills[i + 1].at if i + 1 < len(chaos.kills) else float("inf")
        window = [[t for t in ts if t < end] for ts in times]
        k.stall_s = tl.stall(window, k.at)
    lost = [s for s in run.streams if s.error or len(s.tokens) != args.tokens]
    hung = [s for s in lost if s.error and s.error.startswith("hung")]
    corrupt = [s for s in run.streams if not s.error and len(s.tokens) == args.tokens
               and s.tokens != reference[s.index % args.prompts]]
    stalls = [k.stall_s for k in chaos.kills if k.stall_s is not None]
    normal = tl.normal_gap(times, float("inf"))
    summary = {"requests": len(run.streams), "lost": len(lost), "corrupt": len(corrupt), "hung": len(hung),
               "kills": len(chaos.kills), "output_tokens": sum(len(t) for t in times),
               "client_resumes": sum(s.resumes for s in run.streams), "normal_gap_s": normal,
               "stall_median_s": statistics.median(stalls) if stalls else None,
               "stall_max_s": max(stalls) if stalls else None}
    notes = scan_logs(out)
    result = {"config": vars(args), "summary": summary, "kills": [asdict(k) for k in chaos.kills],
              "lost": [{"index": s.index, "error": s.error, "tokens": len(s.tokens)} for s in lost],
              "corrupt": [s.index for s in corrupt], "log_notes": notes,
              "throughput": [[round(t, 3), v] for t, v in tl.throughput(times)]}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| t (s) | role | victim | signal | stall (ms) | whole again after (s) |")
    print("|---:|---|---|---|---:|---:|")
    for k in chaos.kills:
        stall = "–" if k.stall_s is None else f"{k.stall_s * 1e3:.0f}"
        whole = "–" if k.whole_after is None else f"{k.whole_after:.1f}"
        print(f"| {k.at:.1f} | {k.role} | {k.victim} | SIG{k.signal} | {stall} | {whole} |")
    for note in notes:
        say("chaos", f"log: {note}")
    med = summary["stall_median_s"]
    line = (f"chaos {args.duration:.0f} s, {len(chaos.kills)} kills: requests {len(run.streams)}, lost {len(lost)}, "
            f"corrupt {len(corrupt)}, hung {len(hung)}; stall median "
            f"{'–' if med is None else f'{med * 1e3:.0f} ms'}, max "
            f"{'–' if not stalls else f'{max(stalls) * 1e3:.0f} ms'} (normal token gap "
            f"{'–' if normal is None else f'{normal * 1e3:.0f} ms'}); {summary['client_resumes']} client resumes")
    plot(out / "chaos.png", times, chaos.kills, line)
    print(line, flush=True)
    return 1 if lost or corrupt else 0


def plot(path: Path, times: list[list[float]], kills: list[Kill], title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        say("chaos", "no plot: pip install 'moe-fabric[experiments]'")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = tl.throughput(times)
    fig, ax = plt.subplots(figsize=(11, 4))
    if series:
        ax.step([t for t, _ in series], [v for _, v in series], where="post", color="tab:green")
    colors = {"attention": "tab:red", "expert": "tab:orange", "store": "tab:purple", "orchestrator": "tab:blue",
              "gateway": "tab:brown"}
    for k in kills:
        ax.axvline(k.at, color=colors.get(k.role, "k"), linestyle="--" if k.signal != "STOP" else ":", linewidth=1)
    for role, color in colors.items():
        ax.plot([], [], color=color, linestyle="--", label=role)
    ax.legend(loc="lower right", fontsize=8, ncol=5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"output tokens/s ({tl.WINDOW:g} s windows)")
    ax.set_ylim(bottom=0)
    import textwrap

    ax.set_title(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check(args: argparse.Namespace) -> None:
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if not roles or any(r not in ROLES for r in roles):
        raise ConfigError(f"--roles takes some of {', '.join(ROLES)}")
    if any(s.strip().upper() not in ("KILL", "INT", "STOP") for s in args.signals.split(",")):
        raise ConfigError("--signals takes some of KILL, INT, STOP")
    if args.kill_every <= 0 or args.duration <= args.kill_every or args.concurrency < 1 or args.prompts < 1:
        raise ConfigError("--kill-every must be > 0 and < --duration; --concurrency and --prompts >= 1")
    if args.attention_workers < 2 or args.expert_workers < 2 or args.gateways < 2:
        raise ConfigError("chaos needs at least 2 attention workers, 2 expert workers and 2 gateways")


def run(args: argparse.Namespace) -> int:
    check(args)
    from fabric.model.config import ModelConfig
    from launch.local import Fabric, ensure_demo_model, free_port

    model = args.model or str(ensure_demo_model())
    vocab = ModelConfig.from_dir(model).vocab_size
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = ServeConfig(model=model, attention_workers=args.attention_workers, expert_workers=args.expert_workers,
                      gateways=args.gateways, checkpoint_stores=args.checkpoint_stores, transport=args.transport,
                      port=port, ready_timeout=180)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    def prompt(i: int) -> list[int]:
        return prompts[i % args.prompts]

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    fabric = Fabric(cfg, log_dir=str(out / "logs"))
    try:
        fabric.start()
        fabric.wait_ready(cfg.ready_timeout)
        say("chaos", f"fabric up ({args.attention_workers} AW, {args.expert_workers} EW, {args.checkpoint_stores} "
                     f"store, {args.gateways} gateways); failure-free pass over {args.prompts} prompts ...")
        ref = Run("reference", url, args.tokens, prompt, float("inf"), args.concurrency, limit=args.prompts, tag="chaos")
        asyncio.run(ref.run())
        if ref.lost(args.tokens):
            raise FabricError(f"the failure-free pass lost requests {ref.lost(args.tokens)}; see {out}/logs")
        reference = {s.index: s.tokens for s in ref.streams}
        soak = Run("soak", url, args.tokens, prompt, args.duration, args.concurrency, deadline=args.deadline,
                   tag="chaos")
        chaos = Chaos(args, fabric, soak)
        asyncio.run(soak.run(chaos.loop()))
        say("chaos", f"soak over: {len(soak.streams)} requests, {len(chaos.kills)} kills; stopping the fabric")
        fabric.stop()
        return report(args, out, soak, chaos, reference)
    except KeyboardInterrupt:
        print("[chaos] interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        fabric.stop()
        signal.signal(signal.SIGTERM, previous)
