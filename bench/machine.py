"""What a benchmark measures of the machine and its processes: the compute and memory-bandwidth
limits of a decode step, and the CPU seconds of a process tree."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import time
from typing import Any

import torch

from fabric.model.config import ModelConfig


def matmul_gflops(m: int, k: int, n: int, reps: int = 5) -> float:
    """Best fp32 GFLOP/s of an [m, k] x [k, n] matmul; small shapes loop so one timing lasts ~0.1 s."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    flops = 2.0 * m * k * n
    inner = max(1, int(2e8 // flops))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / inner)
    return flops / best / 1e9


def tree_pids(pid: int) -> list[int]:
    """`pid` and every descendant of it now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def role_pids(root: int, roles: tuple[str, ...]) -> dict[str, list[int]]:
    """The processes under `root` (a `serve`) by role: those whose command line is `python -m launch.cli ROLE ...`
    (the fork server gives each process it forks its role's command line)."""
    out: dict[str, list[int]] = {role: [] for role in roles}
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if "launch.cli" in argv[:-1]:
                role = argv[argv.index("launch.cli") + 1]
                if role in out:
                    out[role].append(pid)
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds these processes have used so far (those still running), to the ns where the kernel
    gives a process's CPU clock (clock_getcpuclockid), else in clock ticks (/proc/PID/stat: 10 ms here, coarser than a
    light process's share of a short round)."""
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError):
            total += _cpu_clock(p)
    return total


def _cpu_clock(pid: int) -> float:
    clock = ctypes.c_int()
    if _libc is not None and _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        return time.clock_gettime(clock.value)
    return sum(cpu_split(pid))


def _load_libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds this process has used so far, all its threads; (0, 0) once it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / tick, int(fields[12]) / tick


def copy_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Best bytes/s of a large tensor copy (a read and a write of every byte)."""
    src = torch.empty(mib << 18, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def step_bytes(mcfg: ModelConfig, c: int) -> float:
    """Weight bytes one decode step of `c` sequences must read: attention, routers, dense MLPs and
    the LM head, plus the experts its tokens route to (uniform routing: E (1 - (1 - k/E)^c)
    distinct experts per MoE layer)."""
    d, e, k = mcfg.hidden_size, mcfg.num_experts, mcfg.top_k
    attn = d * mcfg.num_heads * mcfg.head_dim * 2 + d * mcfg.num_kv_heads * mcfg.head_dim * 2
    expert = 3 * d * mcfg.expert_intermediate
    touched = e * (1 - (1 - k / e) ** c)
    moe = len(mcfg.moe_layers)
    params = (mcfg.num_layers * attn + moe * (d * e + touched * expert)
              + len(mcfg.dense_layers) * 3 * d * mcfg.dense_intermediate + d * mcfg.vocab_size)
    return params * torch.tensor([], dtype=mcfg.torch_dtype).element_size()
