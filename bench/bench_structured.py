"""The cost of constrained decoding: one fabric (the default `serve`: 2 AWs + 2 EWs, the bench
model), C streams of T tokens, every stream unconstrained or every stream constrained to a JSON
schema (an object with one string of at least 400 characters, so that each stream decodes its T
tokens), rounds alternating; tok/s and time between tokens, medians of per-round ratios.

    python bench/bench_structured.py --concurrency 16,64 --tokens 64 --repeats 3
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time

from common import bench_parser, ensure_bench_model, save_figure
from rounds import fabric_round, make_prompts

from launch.config import ServeConfig
from launch.local import Fabric, free_port

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"],
          "additionalProperties": False}
MODES = {"free": None, "json_schema": {"structured_outputs": {"json": SCHEMA}}}


def main() -> None:
    ap = bench_parser(__doc__, "bench/out/structured")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    vocab = ensure_bench_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    cfg = ServeConfig(model=str(args.model_dir), attention_workers=2, expert_workers=2, port=free_port(),
                      ready_timeout=300)
    url = f"http://{cfg.host}:{cfg.port}/v1/completions"
    rows: dict[tuple[int, str], list[dict[str, float]]] = {}
    with Fabric(cfg, log_dir=tempfile.mkdtemp(prefix="structured-", dir=str(args.out))):
        asyncio.run(fabric_round(url, [[1] * 8], 16))  # warm-up: first steps, the grammar's first compile
        asyncio.run(fabric_round(url, [[1] * 8], 16, extra=MODES["json_schema"]))
        for c in levels:
            prompts = make_prompts(c, 16, vocab, seed=c)
            for r in range(args.repeats):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))  # alternating: drift cancels
                for mode in order:
                    t = time.perf_counter()
                    stats = asyncio.run(fabric_round(url, prompts, args.tokens, extra=MODES[mode]))
                    stats.pop("ids", None)
                    rows.setdefault((c, mode), []).append(stats)
                    print(f"  {c:3d} streams {mode:12s} round {r}: {stats['tok_s']:7.1f} tok/s, "
                          f"tbt p50 {stats['tbt_p50_ms']:6.1f} ms ({time.perf_counter() - t:.1f}s)", flush=True)
    print("\n| streams | free tok/s | json_schema tok/s | constrained / free (median of rounds) "
          "| tbt p50 free / constrained (ms) |")
    print("|---:|---:|---:|---:|---:|")
    summary = []
    for c in levels:
        free, con = rows[(c, "free")], rows[(c, "json_schema")]
        ratio = statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(free, con, strict=True))
        line = {"streams": c, "free_tok_s": statistics.median(x["tok_s"] for x in free),
                "constrained_tok_s": statistics.median(x["tok_s"] for x in con), "ratio": ratio,
                "tbt_free_ms": statistics.median(x["tbt_p50_ms"] for x in free),
                "tbt_constrained_ms": statistics.median(x["tbt_p50_ms"] for x in con)}
        summary.append(line)
        print(f"| {c} | {line['free_tok_s']:.1f} | {line['constrained_tok_s']:.1f} | {ratio:.2f}x "
              f"| {line['tbt_free_ms']:.1f} / {line['tbt_constrained_ms']:.1f} |")
    (args.out / "summary.json").write_text(json.dumps({"rounds": {f"{c}/{m}": v for (c, m), v in rows.items()},
                                                       "summary": summary}, indent=1))
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = range(len(levels))
    ax.bar([i - 0.2 for i in x], [s["free_tok_s"] for s in summary], 0.4, label="free")
    ax.bar([i + 0.2 for i in x], [s["constrained_tok_s"] for s in summary], 0.4, label="json_schema")
    ax.set_xticks(list(x), [str(c) for c in levels])
    ax.set_xlabel("streams")
    ax.set_ylabel("output tok/s")
    ax.legend()
    save_figure(fig, args.out / "structured.png")


if __name__ == "__main__":
    main()
