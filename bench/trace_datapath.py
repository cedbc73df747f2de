"""Where a layer's time goes, event by event: a fabric (2 AWs + 2 EWs) under a closed loop of C streams, every
expert call's events stamped in the AW and the EW that served it (fabric/trace.py, MOE_FABRIC_TRACE), and each
layer's time split along its critical path, the call whose result came last:

    AW posts the layer's other calls | encodes and writes this one | to the EW's read callback (the wire, the
    EW's wake-up, its read and decode) | the EW's wait for its batch (a loop hop, the gather) | the batch |
    the EW encodes and writes the result | back to the AW's read callback | the AW's step resumes (a loop hop) |
    the AW's work up to the next layer's first call (the combine, attention or its stand-in, routing, the plan)

The parts add up to the layer (means; medians are shown too). Layers across a step boundary are counted apart,
split the same way along the AW's step stamps:

    the last layers and the logits | sampling, the tokens to the gateways | the step's bookkeeping and the next
    step's scheduling | the step's metadata, embeddings and layers up to the first plan | routing and writing the
    first call

    python bench/trace_datapath.py --concurrency 1,16 --seconds 10 --sim
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import profiler_parser
from fabrics import profiled_fabric
from rounds import closed_loop, make_prompts  # bench/ is on sys.path when run as a script

from fabric import trace
from launch.local import Fabric

KINDS = ("post", "posted", "arrive", "run", "ran", "sent", "result")  # a call's events, AW's and EW's
PARTS = [
    ("post_others", "AW: posts the layer's other calls first"),
    ("encode_write", "AW: encodes and writes the last call"),
    ("to_ew", "to the EW's read callback (wire, wake-up, read, decode)"),
    ("ew_wait", "EW: waits for its batch (loop hop, gather)"),
    ("ew_batch", "EW: the batch"),
    ("ew_send", "EW: encodes and writes the result"),
    ("to_aw", "back to the AW's read callback"),
    ("aw_resume", "AW: the step resumes (loop hop)"),
    ("aw_work", "AW: work up to the next layer's first call"),
]

STEP_KINDS = ("logits", "emitted", "step", "begun")  # an AW's step: logits made, tokens sent, begins, first plan
STEP_PARTS = [
    ("to_logits", "AW: the last layers and the logits"),
    ("emit", "AW: sampling, the tokens to the gateways"),
    ("schedule", "AW: bookkeeping, the next step scheduled"),
    ("begin", "AW: metadata, embeddings, layers up to the first plan"),
    ("first_call", "AW: routes and posts the first call"),
]


def _boundary(stamps: list[tuple[int, str]], resumed: int, first_post: int) -> dict[str, int] | None:
    """A step boundary's parts (ns) from the AW's step stamps between the last layer's resumption and the next
    step's first call; None where one is missing."""
    at: dict[str, int] = {}
    for t, k in stamps:
        if resumed <= t <= first_post and k not in at:
            at[k] = t
    if len(at) != len(STEP_KINDS) or not at["logits"] <= at["emitted"] <= at["step"] <= at["begun"]:
        return None
    return {"to_logits": at["logits"] - resumed, "emit": at["emitted"] - at["logits"],
            "schedule": at["step"] - at["emitted"], "begin": at["begun"] - at["step"],
            "first_call": first_post - at["begun"], "layer": first_post - resumed}


def layers(files: list[str], since: int, until: int) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """Each layer's critical-path parts (ns), and each step boundary's, from the trace files."""
    calls: dict[tuple[str, int], dict[str, int]] = {}
    aw_streams: list[list[tuple[int, str, str, int]]] = []
    for path in files:
        events = trace.read(path)
        if Path(path).name.startswith("attention-worker"):
            aw = next((a for _, k, a, _ in events if k == "post"), "")
            aw_streams.append([(t, k, a or aw, c) for t, k, a, c in events])
            for t, k, _, c in events:
                if k in ("post", "posted", "result"):
                    calls.setdefault((aw, c), {})[k] = t
            continue
        open_run: list[tuple[str, int]] = []
        for t, k, a, c in events:  # an EW: a batch's calls end at the first `ran` after their `run`
            if k == "ran":
                for key in open_run:
                    calls.setdefault(key, {})["ran"] = t
                open_run = []
                continue
            calls.setdefault((a, c), {})[k] = t
            if k == "run":
                open_run.append((a, c))
    out: list[dict[str, int]] = []
    steps: list[dict[str, int]] = []
    for events in aw_streams:
        groups: list[tuple[int, list[tuple[str, int]], int]] = []  # (layer, calls, resumed at)
        pending: list[tuple[str, int]] = []
        stamps = [(t, k) for t, k, _, _ in events if k in STEP_KINDS]
        for t, k, a, c in events:
            if k == "post":
                pending.append((a, c))
            elif k == "resumed":
                groups.append((c, pending, t))
                pending = []
        for (layer, group, resumed), (nxt_layer, nxt, _) in zip(groups, groups[1:]):
            full = [calls[key] for key in group if len(calls.get(key, {})) == len(KINDS)]
            nxt_first = min((calls[key]["post"] for key in nxt if "post" in calls.get(key, {})), default=None)
            if not full or len(full) != len(group) or nxt_first is None or not since <= resumed <= until:
                continue
            if nxt_layer != layer + 1:
                gap = _boundary(stamps, resumed, nxt_first)
                if gap is not None:
                    steps.append(gap)
                continue
            crit = max(full, key=lambda e: e["result"])
            out.append({"post_others": crit["post"] - min(e["post"] for e in full),
                        "encode_write": crit["posted"] - crit["post"], "to_ew": crit["arrive"] - crit["posted"],
                        "ew_wait": crit["run"] - crit["arrive"], "ew_batch": crit["ran"] - crit["run"],
                        "ew_send": crit["sent"] - crit["ran"], "to_aw": crit["result"] - crit["sent"],
                        "aw_resume": resumed - crit["result"], "aw_work": nxt_first - resumed,
                        "layer": nxt_first - min(e["post"] for e in full)})
    return out, steps


def _table(rows: list[dict[str, int]], parts: list[tuple[str, str]], what: str) -> None:
    total = statistics.fmean(r["layer"] for r in rows)
    print(f"| part | mean µs | p10 µs | median µs | p90 µs | share of {what} (means) |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, label in parts:
        vals = sorted(r[key] for r in rows)
        p10, p50, p90 = (vals[int(q * (len(vals) - 1))] / 1e3 for q in (0.1, 0.5, 0.9))
        print(f"| {label} | {statistics.fmean(vals) / 1e3:.0f} | {p10:.0f} | {p50:.0f} | {p90:.0f} | "
              f"{statistics.fmean(vals) / total:.0%} |")


def report(c: int, rows: list[dict[str, int]], steps: list[dict[str, int]]) -> None:
    if not rows:
        print(f"\n{c} streams: no complete layers traced")
        return
    print(f"\n{c} streams: {len(rows)} layers; a layer {statistics.fmean(r['layer'] for r in rows) / 1e3:.0f} µs "
          f"(mean), {statistics.median(r['layer'] for r in rows) / 1e3:.0f} µs (median)")
    _table(rows, PARTS, "the layer")
    if steps:
        print(f"\n{c} streams: {len(steps)} step boundaries, from the last layer's results to the next step's "
              f"first call: {statistics.fmean(r['layer'] for r in steps) / 1e3:.0f} µs (mean), "
              f"{statistics.median(r['layer'] for r in steps) / 1e3:.0f} µs (median)")
        _table(steps, STEP_PARTS, "the boundary")


def main() -> None:
    ap = profiler_parser(__doc__, "bench/out/trace", "1,16", 10.0)
    ap.add_argument("--device", default="cpu", help="where the workers compute (cpu, cuda)")
    ap.add_argument("--kernel", default="auto", help="the workers' --kernel (auto, torch, triton)")
    args = ap.parse_args()
    cfg, vocab = profiled_fabric(args.model_dir, args.out, args.transport, args.sim, device=args.device,
                                 kernel=args.kernel)
    url = f"http://127.0.0.1:{cfg.port}/v1/completions"
    windows: list[tuple[int, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="trace-") as where:
        os.environ[trace.ENV] = where  # the workers inherit it
        try:
            with Fabric(cfg, log_dir=str(args.out / "logs")):
                del os.environ[trace.ENV]
                for c in (int(x) for x in args.concurrency.split(",")):
                    with closed_loop(url, make_prompts(c, 16, vocab, c), 64):
                        time.sleep(1.0)
                        t0 = time.monotonic_ns()
                        time.sleep(args.seconds)
                        windows.append((c, t0, time.monotonic_ns()))
                    print(f"traced {c} streams for {args.seconds:.0f} s", flush=True)
        finally:
            os.environ.pop(trace.ENV, None)
        files = sorted(glob.glob(os.path.join(where, "*-worker-*.trace")))  # written as each worker exits
        print(f"{'sim, zero compute' if args.sim else 'real compute'}, {args.transport}, 2 AW + 2 EW; "
              f"{len(files)} trace files")
        for c, since, until in windows:
            report(c, *layers(files, since, until))


if __name__ == "__main__":
    main()
