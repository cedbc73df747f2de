"""The GPU acceptance check (`scripts/gpu-check.sh`): what a GPU machine must show of the fabric,
run with the default flags, in one command, with only what such a machine has (torch with CUDA,
triton, transformers, aiohttp, msgpack, uvloop, pytest; no network, no pip install: the source
tree on PYTHONPATH). On a machine without a GPU it runs its CPU part (`--device cpu`) and says
what needs a GPU.

    1. kernels    the Triton kernels against torch (tests/fabric/test_triton_kernels.py: compiled on a
                  GPU, under Triton's interpreter on the CPU), the moves between host and device
                  memory (tests/fabric/test_device_moves.py), and an EW's batches, op by op and as
                  CUDA graphs (tests/expert_worker/test_executor.py)
    2. parity     greedy output against transformers on the same device, both test architectures,
                  the default kernels (on a GPU: CUDA graphs of decode steps, the Triton paged
                  attention), torch's and the Triton ones (on the CPU: torch only; the interpreter's
                  whole fabric is a CI test)
    3. failover   an EW and an AW SIGINT under 8 streams, then the same with a warm standby: 0 lost,
                  outputs identical, the stall (`moe-fabric experiment failover`)
    4. datapath   the bench model on the fabric against transformers `generate` on the same
                  device: tok/s and TBT p50 at 1, 16 and 64 streams (bench/bench_datapath.py)

Each step has a time cap; a table of every check ends the run (also written as JSON). Exit code 0
only if every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

Row = dict[str, Any]
TIE = 1e-3  # transformers' top two logits closer than this: either pick is greedy's up to a product's rounding


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def run(cmd: list[str], cap_s: float, log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Runs `cmd` (output to `log`) for at most `cap_s`; (exit code, seconds). 124: over the cap."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=cap_s,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.monotonic() - t0


def kernels(device: str, out: Path) -> list[Row]:
    env = {} if device != "cpu" else {"TRITON_INTERPRET": "1"}
    try:
        import triton  # noqa: F401
    except ImportError:
        return [{"check": "Triton kernels", "result": "skipped", "detail": "no triton here"}]
    code, secs = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fabric/test_triton_kernels.py",
                      "tests/fabric/test_device_moves.py", "tests/expert_worker/test_executor.py"], 300, out / "kernels.log", env)
    where = "compiled for the GPU" if device != "cpu" else "under the interpreter"
    return [{"check": f"Triton kernels {where} = torch; the host-device moves", "result": "pass" if code == 0 else "FAIL",
             "detail": f"{secs:.0f} s, log {out / 'kernels.log'}"}]


def parity(device: str, out: Path, kernels_: list[str]) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from launch.config import ServeConfig
    from launch.local import Fabric, free_port
    from tests.helpers import write_hf_model

    rows = []
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(3 + 5 * i)] for i in range(8)]
    tokens = 12
    for arch in ("mixtral", "qwen3_moe"):
        model_dir = write_hf_model(out / "models" / arch, arch)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        want, tops = [], []
        for p in prompts:
            with torch.no_grad():
                g = hf.generate(torch.tensor([p], device=device), max_new_tokens=tokens, min_new_tokens=tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
            want.append(g.sequences[0, len(p):].tolist())
            tops.append(torch.stack(g.logits)[:, 0, :].float().cpu())
        del hf
        for kernel in kernels_:
            t0 = time.monotonic()
            cfg = ServeConfig(model=str(model_dir), attention_workers=1, expert_workers=2, port=free_port(),
                              transport="tcp", device=device, kernel=kernel, ready_timeout=240)
            logs = out / f"parity-{arch}-{kernel}"
            try:
                with Fabric(cfg, log_dir=str(logs)) as fabric:
                    with ThreadPoolExecutor(len(prompts)) as pool:
                        got = list(pool.map(lambda p: complete(fabric.port, p, tokens), prompts))
                    dead = [w["id"] for w in fabric.cluster()["workers"] if w["state"] == "dead"]
            except Exception as exc:  # (a fabric that does not start is this check's failure, not the run's)
                rows.append({"check": f"parity {arch} {kernel} on {device}", "result": "FAIL", "detail": str(exc)})
                continue
            equal = sum(g == w or near_tie(g, w, t) for g, w, t in zip(got, want, tops))
            ok = equal == len(prompts) and not dead
            rows.append({"check": f"greedy parity {arch} --kernel {kernel} on {device}", "result": "pass" if ok else "FAIL",
                         "detail": f"{equal}/{len(prompts)} equal to transformers; declared dead: {dead or 'none'}; "
                                   f"{time.monotonic() - t0:.0f} s"})
    return rows


def complete(port: int, prompt: list[int], tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def near_tie(got: list[int], want: list[int], logits: torch.Tensor, tie: float = TIE) -> bool:
    """The first difference falls where transformers' top two logits are within `tie`."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = torch.topk(logits[i], 2).values
            return float(top2[0] - top2[1]) < tie
    return len(got) == len(want)


def failover(device: str, out: Path) -> list[Row]:
    rows = []
    for role, standby in (("expert", 0), ("attention", 0), ("expert", 1), ("attention", 1)):
        name = f"failover-{role}{'-standby' if standby else ''}"
        cmd = [sys.executable, "-m", "launch.cli", "experiment", "failover", "--role", role, "--signal", "INT",
               "--concurrency", "8", "--duration", "12", "--at", "4", "--tokens", "48", "--device", device,
               "--standby-workers", str(standby), "--out", str(out / name)]
        code, secs = run(cmd, 240, out / f"{name}.log")
        try:
            m = json.loads((out / name / "results.json").read_text())["metrics"]
        except (OSError, ValueError, KeyError):
            rows.append({"check": f"{role} SIGINT{' + standby' if standby else ''}", "result": "FAIL",
                         "detail": f"no results (exit {code}, {secs:.0f} s; log {out / f'{name}.log'})"})
            continue
        ok = code == 0 and m["requests_lost"] == 0 and m["outputs_equal"]
        stall = m.get("stall_s")
        rows.append({"check": f"{'EW' if role == 'expert' else 'AW'} SIGINT{' + warm standby' if standby else ''}, "
                              f"8 streams on {device}", "result": "pass" if ok else "FAIL",
                     "detail": f"lost {m['requests_lost']} of {m['requests']}, outputs equal: {m['outputs_equal']}, "
                               f"stall {stall * 1e3:.0f} ms" if stall is not None else "no stall measured"})
    return rows


def datapath(device: str, out: Path, concurrency: str) -> list[Row]:
    cmd = [sys.executable, "bench/bench_datapath.py", "--device", device, "--transports", "tcp", "--concurrency",
           concurrency, "--tokens", "64", "--repeats", "1", "--out", str(out / "datapath")]
    code, secs = run(cmd, 360, out / "datapath.log")
    try:
        result = json.loads((out / "datapath" / "results.json").read_text())
    except (OSError, ValueError):
        return [{"check": f"datapath on {device}", "result": "FAIL",
                 "detail": f"no results (exit {code}, {secs:.0f} s; log {out / 'datapath.log'})"}]
    rows = []
    for r in result["rows"]:
        if r["system"] in ("fabric tcp", "transformers generate"):
            ratio = r.get("vs_transformers_per_round")
            rows.append({"check": f"{r['system']} on {device}, {r['concurrency']} streams", "result": "measured",
                         "detail": f"{r['tok_s']:.1f} tok/s, TBT p50 {r['tbt_p50_ms']:.1f} ms"
                                   + (f", {ratio:.2f}x transformers" if ratio and r["system"] != "transformers generate"
                                      else "")})
    same, total = result.get("identical", {}).get("transformers generate", {}).get("fabric tcp", [0, 0])
    gaps = result.get("tie_gaps", {}).get("transformers generate", {}).get("fabric tcp", [])
    # As parity's rule: a stream may first differ only where transformers' top two logits are a tie.
    ties = len(gaps) == total - same and all(g < TIE for g in gaps)
    rows.append({"check": f"datapath greedy streams token-identical to transformers on {device}, or first different "
                          f"at a tie (top two logits within {TIE:g})",
                 "result": "pass" if total and ties else "FAIL",
                 "detail": f"{same} of {total} identical" + (f"; the others' top-two gaps: {', '.join(f'{g:.2g}' for g in gaps)}"
                                                             if gaps else "")})
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r['check']} | {r['result']} | {r['detail']} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: cuda where a GPU is visible, else the CPU part")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu-check")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out: kernels,parity,failover,datapath")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = ("cuda" if gpu else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not gpu:
        say("--device cuda, but no CUDA device is visible here")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    name = torch.cuda.get_device_name(0) if device == "cuda" else "the CPU"
    say(f"on {name}: torch {torch.__version__}, Python {sys.version.split()[0]}; results in {args.out}")
    rows: list[Row] = []
    t0 = time.monotonic()
    steps = [("kernels", lambda: kernels(device, args.out)),
             ("parity", lambda: parity(device, args.out, ["auto", "torch", "triton"] if device == "cuda" else ["torch"])),
             ("failover", lambda: failover(device, args.out)),
             ("datapath", lambda: datapath(device, args.out, "1,16,64" if device == "cuda" else "1,16"))]
    for step, fn in steps:
        if step in skip:
            continue
        say(f"{step} ...")
        try:
            new = fn()
        except Exception as exc:  # (one step's failure is in the table; the others still run)
            new = [{"check": step, "result": "FAIL", "detail": f"{type(exc).__name__}: {exc}"}]
        rows += new
        for r in new:
            say(f"  {r['check']}: {r['result']} ({r['detail']})")
    if device == "cpu":
        rows.append({"check": "the GPU part (compiled Triton kernels, parity on cuda, GPU failover and datapath)",
                     "result": "needs a GPU", "detail": "run scripts/gpu-check.sh on a machine with one"})
    (args.out / "gpu-check.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
    print(f"\n## gpu-check on {name} ({time.monotonic() - t0:.0f} s)\n\n{table(rows)}\n", flush=True)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
