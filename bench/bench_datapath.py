"""Data-path benchmark: the fabric over tcp/ucx vs transformers `generate` vs this machine's compute limit.

The fabrics stay up for the whole run (idle between their rounds); each repeat runs, per concurrency,
one transformers round and one round of each fabric back to back (who goes first alternates), on the
same `bench` demo weights. The table reports medians, and the median of the per-round ratios to the
transformers round next to it, which cancels most of a shared, noisy machine's drift. Example (the
full run):

    python bench/bench_datapath.py --concurrency 1,16 --tokens 128 --repeats 3

`--gateways 2,1` adds a fabric with one gateway (the setting before resumable streams) beside the
default two. `--security none,tls` adds fabrics without authentication (`serve --no-auth`) and with
TLS on every TCP link and HTTP server (a self-signed cluster certificate) beside the default
(authenticated, not encrypted):

    python bench/bench_datapath.py --transports tcp --concurrency 1,16 --security none,tls --repeats 5

`--step-budgets 256,2048` adds a fabric per AW step budget (`serve --max-batch-tokens`): a burst of
prompts is prefilled in chunks of that many tokens beside the decodes, so the budget trades TTFT
against the gaps between tokens while the burst is prefilled (the TBT p99 of a round):

    python bench/bench_datapath.py --transports tcp --concurrency 64,128 --tokens 64 --step-budgets 128,256,1024,2048

`--torch-matmul` adds a fabric whose workers run torch's matmul (`--kernel torch`) instead of the
skinny GEMM kernel (fabric/kernels/skinny.py); `--vllm` adds vLLM's CPU build as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import holes
import torch
from common import scan_logs  # bench/ is on sys.path when run as a script
from fabrics import FabricSpec, baseline_fabric, running_fabric
from machine import copy_bandwidth, cpu_seconds, matmul_gflops, step_bytes, tree_pids
from rounds import Stats, fabric_round, in_turn, make_prompts, summarize
from vllm_server import VLLM_VERSION, vllm_server

from fabric.config_fields import auto_sched
from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from fabric.tls import Tls
from launch.config import ServeConfig

HF = "transformers generate"
VLLM = "vLLM CPU"
LIMIT = "compute limit"
BW_LIMIT = "memory-bandwidth limit"
def load_hf(model: Path, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device).eval()


def hf_round(hf: Any, prompts: list[list[int]], tokens: int, threads: int = 0) -> Stats:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per decoding step, right after the forward pass that produced the step's logits."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            self.times.append(time.perf_counter())
            return scores

    ids, clock = torch.tensor(prompts, dtype=torch.long, device=hf.device), StepClock()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                          min_new_tokens=tokens, logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    wall = time.perf_counter() - t0
    torch.set_num_threads(default_threads)
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    assert n == len(prompts) * tokens, f"generate produced {n} tokens, expected {len(prompts) * tokens}"
    return {**summarize(n, wall, [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)],
                        [clock.times[0] - t0] if clock.times else None), "ids": out[:, ids.shape[1]:].tolist()}


def tie_gaps(hf: Any, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]) -> list[float]:
    """For each stream that differs from transformers' (`want`): the gap between transformers' top two logits where
    it first differs, from the prompt and the tokens both agree on, run alone. Under ~1e-3 the two picks are a tie
    that a product's rounding decides (on a GPU its kernel, so its result, depends on the batch's row count)."""
    gaps = []
    for p, a, b in zip(prompts, got, want):
        if a == b:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([p + b[:i]], device=hf.device)).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
    return gaps


def median_stats(runs: list[Stats]) -> Stats:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} if runs else {}


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: float | None, spec: str, unit: str = "") -> str:
        return "–" if x is None or x != x else format(x, spec) + unit

    lines = ["| system | concurrency | output tok/s | TBT p50 ms | TBT p99 ms | TBT p99 once all decode, ms | TTFT ms"
             " | CPU s / 1k tokens | vs vLLM (median of per-round ratios) | vs transformers (median of per-round ratios) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['concurrency']} | {f(r['tok_s'], '.1f')} | {f(r.get('tbt_p50_ms'), '.2f')}"
                     f" | {f(r.get('tbt_p99_ms'), '.2f')} | {f(r.get('tbt_p99_decode_ms'), '.2f')}"
                     f" | {f(r.get('ttft_ms'), '.0f')} | {f(r.get('cpu_s_per_1k'), '.2f')}"
                     f" | {f(r.get('vs_vllm_per_round'), '.2f', 'x')} | {f(r.get('vs_transformers_per_round'), '.2f', 'x')} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], concs: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for s in systems:
        pts = sorted((r["concurrency"], r) for r in rows if r["system"] == s)
        style = "--" if "limit" in s else "-o"
        a.plot([c for c, _ in pts], [r["tok_s"] for _, r in pts], style, label=s)
        if pts and "tbt_p50_ms" in pts[0][1]:
            b.plot([c for c, _ in pts], [r["tbt_p50_ms"] for _, r in pts], style, label=s)
    for ax, label in ((a, "output tokens/s (median)"), (b, "time between tokens, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.set_xticks(concs, [str(c) for c in concs])
    a.legend(fontsize=7)
    fig.suptitle("moe-fabric data path vs vLLM CPU and transformers (bench demo model, fp32 CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("bench/out/model-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--concurrency", default="1,16", help="comma-separated numbers of concurrent streams")
    ap.add_argument("--transports", default="tcp,ucx")
    ap.add_argument("--other-sched", action="store_true",
                    help="add a row per transport with the workers in the scheduling class `--sched auto` does not "
                         "pick for it (`serve --sched normal` over tcp, `--sched batch` over ucx)")
    ap.add_argument("--gateways", default="2",
                    help="comma-separated gateway counts: a fabric per count (the first one for every transport; "
                         "1 is the single-gateway setting of the design before resumable streams)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run the fabric of this checkout (e.g. `git worktree add /tmp/base COMMIT`), over the "
                         "first transport: the previous design side by side")
    ap.add_argument("--baseline-flags", default="",
                    help="serve flags for the baseline fabric (e.g. --pin-workers, where its tree has it; it runs "
                         "unpinned otherwise, whatever this tree's fabric does)")
    ap.add_argument("--security", default="",
                    help="comma-separated extra fabrics over the first transport: none (serve --no-auth), tls "
                         "(TLS on every TCP link and HTTP server); the default fabric is authenticated")
    ap.add_argument("--torch-matmul", action="store_true",
                    help="add a fabric whose workers use torch's matmul (--kernel torch) beside the default (the "
                         "skinny GEMM kernel where it runs)")
    ap.add_argument("--triton", action="store_true",
                    help="add a fabric whose workers run the Triton kernels (--kernel triton; a GPU, or "
                         "TRITON_INTERPRET=1) beside the default")
    ap.add_argument("--step-budgets", default="",
                    help="comma-separated step token budgets (serve --max-batch-tokens): a fabric over the first "
                         f"transport per budget beside the default ({ServeConfig().max_batch_tokens}); the trade "
                         "between TTFT and the time between tokens while prompts are prefilled")
    ap.add_argument("--pinned", action="store_true",
                    help="add a fabric with serve --pin-workers beside the default (serve's defaults: the workers "
                         "float over the CPUs)")
    ap.add_argument("--vllm", action="store_true",
                    help=f"add vLLM's CPU build ({VLLM_VERSION}, installed on first use into bench/.venv-vllm) as the "
                         "baseline: rows and per-round ratios against it")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-threads", type=int, default=0, help="torch threads for generate (0 = torch default)")
    ap.add_argument("--device", default="cpu", help="where the fabric's workers and transformers run (cpu, cuda)")
    ap.add_argument("--watch-holes", action="store_true",
                    help="watch the machine for holes in its scheduling beside the rounds (bench/holes.py: a plain "
                         "process that could not run for 200 ms, and what ran instead); printed at the end")
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if "ucx" in transports:
        try:
            import ucxx  # noqa: F401
        except ImportError as exc:
            print(f"note: skipping the ucx fabric ({exc})")
            transports.remove("ucx")

    model = args.model_dir
    if not (model / "config.json").exists():
        print(f"writing the bench demo model to {model} ...", flush=True)
        write_demo_model(model, arch="mixtral", size="bench")
    mcfg = ModelConfig.from_dir(model)
    active = mcfg.active_params_per_token()
    prompts = make_prompts(max(concs), args.prompt_len, mcfg.vocab_size, args.seed)
    print(f"model {model}: {active / 1e6:.1f}M active params/token; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.2f} (other work on the machine skews every number)")
    hf = load_hf(model, args.device)
    warm = [prompts[:c] for c in concs]
    for batch in warm:  # warm-up, as every fabric gets
        hf_round(hf, batch, 16, args.hf_threads)
    log_root = tempfile.mkdtemp(prefix="bench-datapath-logs-")
    counts = [int(g) for g in args.gateways.split(",") if g.strip()]
    t0, g0 = transports[0], counts[0]
    dev = {"device": args.device}
    fabrics = {f"fabric {t}": FabricSpec(t, g0, **dev) for t in transports}
    for g in counts[1:]:
        fabrics[f"fabric {t0}, {g} gateway{'s' if g > 1 else ''}"] = FabricSpec(t0, g, **dev)
    if args.other_sched:
        for t in transports:
            other = "normal" if auto_sched(t) == "batch" else "batch"
            fabrics[f"fabric {t}, --sched {other}"] = FabricSpec(t, g0, sched=other, **dev)
    for sec in [x.strip() for x in args.security.split(",") if x.strip()]:
        if sec not in ("none", "tls"):
            ap.error(f"--security takes none and tls, not {sec!r}")
        fabrics[f"fabric {t0}, {'no auth' if sec == 'none' else 'TLS'}"] = FabricSpec(t0, g0, security=sec, **dev)
    if args.torch_matmul:
        fabrics[f"fabric {t0}, --kernel torch"] = FabricSpec(t0, g0, kernel="torch", **dev)
    if args.triton:
        fabrics[f"fabric {t0}, --kernel triton"] = FabricSpec(t0, g0, kernel="triton", **dev)
    if args.pinned:
        fabrics[f"fabric {t0}, pinned"] = FabricSpec(t0, g0, pin=True, **dev)
    for budget in [int(b) for b in args.step_budgets.split(",") if b.strip()]:
        fabrics[f"fabric {t0}, --max-batch-tokens {budget}"] = FabricSpec(t0, g0, max_batch_tokens=budget, **dev)
    names = [*fabrics] + ([f"baseline {transports[0]} ({args.baseline_tree.name})"] if args.baseline_tree else [])
    systems = [*names, *([VLLM] if args.vllm else []), HF]
    raw: dict[str, dict[int, list[Stats]]] = {s: {c: [] for c in concs} for s in systems}
    ratios: dict[str, dict[int, list[float]]] = {s: {c: [] for c in concs} for s in names}
    vs_vllm: dict[str, dict[int, list[float]]] = {s: {c: [] for c in concs} for s in names}
    pids: dict[str, Any] = {HF: lambda: [os.getpid()]}  # system -> its processes now (for CPU seconds)
    rates: list[dict[str, float]] = []
    errors: list[str] = []
    streams: dict[str, dict[int, list[list[int]]]] = {s: {} for s in systems}  # the token ids of each stream
    with contextlib.ExitStack() as stack:
        holes_log = stack.enter_context(holes.watching(Path(log_root) / "holes.log")) if args.watch_holes else None
        # Every fabric stays up (idle between its rounds) for the whole run, so the systems'
        # rounds alternate closely and each fabric round has a transformers round next to it.
        urls: dict[str, str] = {}
        tlss: dict[str, Tls | None] = {}
        for name, spec in fabrics.items():
            try:
                urls[name], tlss[name], fab = stack.enter_context(running_fabric(model, spec, log_root, warm))
                pids[name] = lambda fab=fab: [p.pid for _, p in fab.procs]
            except Exception as exc:  # keep the other systems' numbers; the table shows gaps
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"  ERROR {errors[-1]}", flush=True)
        if args.baseline_tree is not None:
            name = f"baseline {transports[0]} ({args.baseline_tree.name})"
            try:
                urls[name] = stack.enter_context(baseline_fabric(args.baseline_tree.resolve(), model.resolve(),
                                                                 transports[0], log_root, warm,
                                                                 shlex.split(args.baseline_flags)))
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"  ERROR {errors[-1]}", flush=True)
        if args.vllm:
            try:
                urls[VLLM], vpid = stack.enter_context(vllm_server(
                    model.resolve(), log_root, lambda url: [asyncio.run(fabric_round(url, b, 16)) for b in warm]))
                pids[VLLM] = lambda vpid=vpid: tree_pids(vpid)
            except Exception as exc:
                errors.append(f"{VLLM}: {type(exc).__name__}: {exc}")
                print(f"  ERROR {errors[-1]}", flush=True)
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", flush=True)
            for c in concs:
                served = in_turn(list(urls), rep)  # each server takes each place in turn
                order = [HF, *served] if rep % 2 == 0 else [*served, HF]  # transformers first or last
                done: dict[str, Stats] = {}
                for name in order:
                    procs = pids.get(name, lambda: [])()
                    cpu0 = cpu_seconds(procs)
                    try:
                        if name == HF:
                            done[name] = hf_round(hf, prompts[:c], args.tokens, args.hf_threads)
                        else:
                            done[name] = asyncio.run(fabric_round(urls[name], prompts[:c], args.tokens, tlss.get(name)))
                    except Exception as exc:
                        errors.append(f"repeat {rep + 1} {name} C={c}: {type(exc).__name__}: {exc}")
                        print(f"  ERROR {errors[-1]}", flush=True)
                        continue
                    if procs:
                        done[name]["cpu_s_per_1k"] = (cpu_seconds(procs) - cpu0) / done[name]["tokens"] * 1000
                    streams[name].setdefault(c, done[name].pop("ids"))  # (greedy: every round the same)
                    raw[name][c].append(done[name])
                    print(f"  {name} C={c}: {done[name]['tok_s']:.1f} tok/s", flush=True)
                for name in names:
                    if name in done and HF in done:
                        ratios[name][c].append(done[name]["tok_s"] / done[HF]["tok_s"])
                    if name in done and VLLM in done:
                        vs_vllm[name][c].append(done[name]["tok_s"] / done[VLLM]["tok_s"])
            rate = {"1024x1024x1024": matmul_gflops(1024, 1024, 1024), "copy_bytes_s": copy_bandwidth()}
            rate.update({f"{c}x512x4096": matmul_gflops(c, 512, 4096) for c in concs})
            rates.append(rate)

    best = max(r["1024x1024x1024"] for r in rates)
    bound = best * 1e9 / (2 * active)
    bandwidth = max(r["copy_bytes_s"] for r in rates)
    rows: list[dict[str, Any]] = []
    for s in [*systems, LIMIT, BW_LIMIT]:
        for c in concs:
            if s == BW_LIMIT:
                rows.append({"system": s, "concurrency": c, "tok_s": c * bandwidth / step_bytes(mcfg, c),
                             "step_ms": step_bytes(mcfg, c) / bandwidth * 1e3, "repeats": len(rates)})
                continue
            st: dict[str, Any] = {"tok_s": bound} if s == LIMIT else dict(median_stats(raw[s][c]))
            if not st:
                continue
            hf_tok = statistics.median(r["tok_s"] for r in raw[HF][c]) if raw[HF][c] else None
            st["vs_transformers"] = st["tok_s"] / hf_tok if hf_tok else None
            per_round = ratios.get(s, {}).get(c) or ([1.0] if s == HF else [])
            st["vs_transformers_per_round"] = statistics.median(per_round) if per_round else None
            st["vs_vllm_per_round"] = statistics.median(vs_vllm[s][c]) if vs_vllm.get(s, {}).get(c) else None
            rows.append({"system": s, "concurrency": c, "repeats": len(raw[s][c]) if s != LIMIT else len(rates), **st})

    print(f"\n`{command}`\n")
    print(table(rows))
    print(f"\nmemory-bandwidth limit: c x (best copy bandwidth {bandwidth / 1e9:.1f} GB/s) / (weight bytes a step of c "
          f"reads: " + ", ".join(f"{c}: {step_bytes(mcfg, c) / 2**20:.0f} MiB" for c in concs) + ")")
    print(f"compute limit: best fp32 matmul {best:.1f} GFLOP/s (1024^3) / (2 x {active / 1e6:.1f}M active params)")
    for c in concs:
        print(f"  [{c}, 512] x [512, 4096] matmul: best {max(r[f'{c}x512x4096'] for r in rates):.1f} GFLOP/s")
    identical: dict[str, dict[str, list[int]]] = {}  # reference -> system -> [streams equal, streams]
    tie_gaps_of: dict[str, dict[str, list[float]]] = {}  # reference -> system -> top-two gaps where streams differ
    for ref in (HF, VLLM):
        for s in systems:
            if s != ref and streams.get(ref) and streams[s]:
                same = [sum(a == b for a, b in zip(streams[s][c], streams[ref][c])) for c in concs if c in streams[s]
                        and c in streams[ref]]
                identical.setdefault(ref, {})[s] = [sum(same), sum(c for c in concs if c in streams[s])]
                gaps = [] if ref != HF else [g for c in concs if c in streams[s] and c in streams[ref]
                                             for g in tie_gaps(hf, prompts[:c], streams[s][c], streams[ref][c])]
                print(f"token-identical to {ref}: {s}: {sum(same)} of {sum(c for c in concs if c in streams[s])} "
                      "greedy streams" + (f"; the others first differ where transformers' top two logits are "
                                          f"{', '.join(f'{g:.2g}' for g in gaps)} apart" if gaps else ""))
                tie_gaps_of.setdefault(ref, {})[s] = gaps
    notes = scan_logs(log_root)
    if holes_log is not None:
        found = holes_log.read_text().splitlines()
        notes.append(f"holes in the machine's scheduling (bench/holes.py): {len(found)}")
        notes.extend(found)
    for line in errors + notes:
        print(f"note: {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "args": {k: str(v) for k, v in vars(args).items()}, "model": str(model),
              "active_params_per_token": active, "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
              "matmul_gflops": rates, "rows": rows, "per_round_ratios": {s: {str(c): v for c, v in d.items()} for s, d in ratios.items()},
              "vs_vllm_ratios": {s: {str(c): v for c, v in d.items()} for s, d in vs_vllm.items()}, "raw": {s: {str(c): v for c, v in d.items()} for s, d in raw.items()},
              "identical": identical, "tie_gaps": tie_gaps_of, "device": args.device, "errors": errors, "log_notes": notes, "log_dir": log_root}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        plot(rows, concs, args.out / "datapath_tok_s.png")
        print(f"wrote {args.out / 'results.json'} and {args.out / 'datapath_tok_s.png'}")
    except ImportError:
        print(f"wrote {args.out / 'results.json'} (no plot: matplotlib is not installed)")


if __name__ == "__main__":
    main()
