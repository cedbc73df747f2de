"""The GPU path's plumbing, on any machine: `--device` specs checked, a worker that asks for a CUDA
device it does not have refused with the reason, `serve --device cuda` handing worker i GPU i
modulo the GPUs visible (and a replacement the dead one's), host copies of device tensors; and a
whole fabric on the Triton kernels (`--kernel triton`: the EWs' fused MoE, the AWs' paged decode
attention), run by Triton's interpreter on CPU tensors, greedy-equal to transformers."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric import device
from fabric.config import AttentionWorkerConfig, ExpertWorkerConfig
from fabric.errors import ConfigError
from fabric.kernels import choose
from fabric.messages.control import Role
from fabric.messages.supervisor import StartWorker
from launch.config import ServeConfig
from launch.supervisor import Child, Supervisor
from tests.conftest import running_fabric
from tests.system.test_parity import assert_matches, reference, run_requests


def test_device_specs_are_checked() -> None:
    for good in ("cpu", "cuda", "cuda:0", "cuda:12"):
        ExpertWorkerConfig(model="/m", orchestrator="h:1", device=good)
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "cuda:0,1"):
        with pytest.raises(ConfigError, match="unknown device"):
            AttentionWorkerConfig(model="/m", orchestrator="h:1", device=bad)
        with pytest.raises(ConfigError, match="unknown device"):
            ServeConfig(device=bad)
    with pytest.raises(ConfigError, match="unknown kernel"):
        ServeConfig(kernel="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA device")
def test_a_worker_asking_for_a_gpu_it_lacks_exits_saying_why(hf_models: dict[str, Path]) -> None:
    assert device.resolve("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        device.resolve("cuda:0")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        device.worker_device("cuda", 0)
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "expert-worker", "--model", str(hf_models["mixtral"]),
                           "--orchestrator", "127.0.0.1:9", "--device", "cuda"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no CUDA device is visible" in proc.stderr


def test_serve_hands_each_worker_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "visible_gpus", lambda: 3)
    assert [device.worker_device("cuda", i) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    assert device.worker_device("cuda:2", 7) == "cuda:2" and device.worker_device("cpu", 1) == "cpu"
    sup = Supervisor(ServeConfig(attention_workers=2, expert_workers=2, standby_workers=1, device="cuda", auth=False,
                                 weight_store=False), "/m")
    shutil.rmtree(sup._sockdir)  # (nothing is started)
    plan = sup.plan()
    workers = [c for c in plan if c.role in (Role.ATTENTION, Role.EXPERT)]
    assert [c.device for c in workers] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1", "cuda:2"]
    assert all(c.device is None for c in plan if c.role not in (Role.ATTENTION, Role.EXPERT))
    flags = sup._argv(workers[1], None)
    assert flags[flags.index("--device") + 1] == "cuda:1"
    # A replacement takes its dead worker's GPU (and CPU); without one free, the next GPU in turn;
    # a standby takes a dead worker's GPU too, but floats over the CPUs.
    sup._free_devices[Role.EXPERT], sup._free_cpus[Role.EXPERT] = ["cuda:1"], ["1"]
    started: list[tuple[str | None, str | None]] = []

    def spawn(child: Child) -> None:  # (what is started, not the process)
        started.append((child.device, child.cpus))
        child.proc = subprocess.Popen(["true"])

    monkeypatch.setattr(sup, "_spawn", spawn)
    monkeypatch.setattr(sup, "_tell_orchestrator", lambda msg: None)
    sup._provision(plan[0], StartWorker(Role.EXPERT, "expert-worker-1", 0, []))
    sup._provision(plan[0], StartWorker(Role.EXPERT, "expert-worker-0", 0, []))
    sup._free_devices[Role.EXPERT], sup._free_cpus[Role.EXPERT] = ["cuda:2"], ["0"]
    sup._provision(plan[0], StartWorker(Role.EXPERT, "ew-9", 0, [], standby=True))
    for child in sup.children:
        assert child.proc is not None and child.proc.wait(10) == 0
    assert started == [("cuda:1", "1"), ("cuda:0", None), ("cuda:2", None)]
    assert sup._free_cpus[Role.EXPERT] == ["0"]  # (kept for a replacement that is not a standby)
    assert ServeConfig(device="cuda").store_kernel == "torch" and ServeConfig().store_kernel == "auto"


def test_host_copies_on_the_cpu_are_the_tensor_itself() -> None:
    t = torch.arange(6.0)
    host, done = device.HostCopies(torch.device("cpu")).start(t)
    assert host is t and done()
    assert device.to_host(t) is t and device.to_device(t, torch.device("cpu")) is t


def test_triton_needs_a_gpu_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        choose.triton_module("triton_moe", torch.device("cpu"))
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        choose.decode_attention("triton", torch.device("cpu"), torch.float32, 16, 64)
    with pytest.raises(ConfigError, match="power-of-two"):
        choose.decode_attention("triton", torch.device("cpu"), torch.float32, 12, 64)
    assert choose.gemm("auto", torch.device("cuda", 0), torch.float32) is None  # (the skinny GEMM is the CPU's)
    assert choose.decode_attention("auto", torch.device("cuda", 0), torch.float32, 16, 64) is None
    with pytest.raises(ConfigError, match="runs on the CPU"):
        AttentionWorkerConfig(model="/m", orchestrator="h:1", compute="sim", device="cuda")


# (the interpreter evaluates both sides of a tl.where: an empty row's 0/0 on the side not taken)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_a_fabric_on_the_triton_kernels_equals_transformers(hf_models: dict[str, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the workers inherit it: Triton on CPU tensors)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 40)]
    lengths = [10, 6, 8]
    model = hf_models["mixtral"]
    expected = reference(model, prompts, lengths)
    extra = {"attention-worker": ["--max-batch-tokens", "24"]}  # (long prompts in chunks beside decodes)
    # (the default flags: the interpreter's slow steps run in the workers' compute threads, and
    # nobody is declared dead for them)
    with running_fabric(model, tmp_path, aws=1, ews=2, kernel="triton", extra=extra) as fabric:
        got = run_requests(f"http://127.0.0.1:{fabric.port}", prompts, lengths)
        cluster = fabric.cluster()
        ews = [w for w in cluster["workers"] if w["role"] == "expert"]
    for i, (tokens, (want, logits)) in enumerate(zip(got, expected)):
        assert_matches(tokens, want, logits, f"triton request {i}")
    assert [w["stats"]["kernel"] for w in ews] == ["triton", "triton"]
    assert all(w["state"] == "alive" for w in cluster["workers"]) and cluster["replacements_started"] == 0
    assert all(w["stats"]["warmup_ms"] is not None for w in cluster["workers"] if w["role"] in ("attention", "expert"))
