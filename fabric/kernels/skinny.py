"""The skinny fp32 GEMM of `skinny_gemm.cpp` for expert FFNs.

A decode step gives each expert a few rows. torch's BLAS (MKL) runs [few, K] @ [K, N] at a fraction of what
reading W once allows on CPUs it does not tune for. It is 2.3x slower than this kernel at 4-8 rows on this
project's AMD EPYC VM (docs/performance.md). Weights are packed once, at load, into column blocks [NB, K, 64], the
last padded with zeros, so a product names its N (a packed weight's shape holds only NB).
The same compiled module carries the AW's paged decode attention (`paged_attention.cpp`, `module_for`)
and its per-layer glue (`layer_ops.cpp`, attention_worker/glue.py).

It is built with torch's C++ extension loader into `<cache>/moe-fabric/kernels/` on first use, in 30-60 s on 2 cores.
`scripts/_venv.sh` builds it at install (`python -m fabric.kernels.skinny`), for AVX-512 where the CPU has it, else for
AVX2 (and FMA): the attention and the glue in sixteen-lane vectors (`simd.h`, one AVX-512 register or two AVX2 ones),
the GEMM's register block written for each; the same floats either way. On a CPU with neither, `load()` returns None
and the workers keep torch's ops.

Legend: M rows, K inner dimension, N output columns, NB = ceil(N / 64).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in (
    "skinny_gemm.cpp", "paged_attention.cpp", "layer_ops.cpp", "codec_write.cpp", "codec_read.cpp")]  # one module
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "codec.h", "second_core.h")]
# torch's CPU capability -> the instruction sets the module is built for
FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AMX": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
COLS = 64  # output columns per packed block


MODULE = "moe_fabric_skinny"


def build_dir(files: list[Path] = SOURCES + HEADERS, name: str = MODULE) -> Path:
    """One build per environment, sources and module: the build files name this Python's torch headers, and a checkout
    of other sources (another version beside this one, or a benchmark's baseline) builds its own instead of rebuilding
    this one's."""
    key = hashlib.sha1(f"{sys.prefix}:{torch.__version__}:{' '.join(_flags() or [])}".encode())
    if name != MODULE:
        key.update(name.encode())
    for src in files:
        key.update(src.read_bytes())
    env = key.hexdigest()[:12]
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-fabric" / "kernels" / env


def compile_module(name: str, sources: list[Path], out: Path) -> Any:
    """The module `name` from `sources`, built in `out` with this CPU's flags (or found built there); raises where it
    cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    out.mkdir(parents=True, exist_ok=True)
    return load_extension(name=name, sources=[str(p) for p in sources], build_directory=str(out),
                          extra_cflags=["-O3", *(_flags() or [])], verbose=False)


def _flags() -> list[str] | None:
    """The compiler's instruction-set flags for this CPU (torch's reading of it), or None where neither build runs."""
    return FLAGS.get(torch.backends.cpu.get_cpu_capability())


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None if it can."""
    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability in FLAGS else f"this CPU's vector capability is {capability}, the kernel needs AVX2 or AVX-512"


@functools.cache
def load() -> Any | None:
    """The compiled module (built first if needed), or None where it cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("skinny GEMM kernel off: %s; torch matmul instead", reason)
        return None
    t0 = time.perf_counter()
    try:
        module = compile_module(MODULE, SOURCES, build_dir())
    except Exception as exc:
        # No compiler or no headers. Serve with torch's matmul instead.
        log.warning("skinny GEMM kernel could not be built (%s); torch matmul instead", exc)
        return None
    log.debug("skinny GEMM kernel loaded in %.1f s", time.perf_counter() - t0)
    return module


class SkinnyGemm:
    """Packed fp32 weights and products with them; `ops` is the loaded module."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def pack(self, w_t: torch.Tensor) -> torch.Tensor:
        """W [K, N] float32 -> [NB, K, 64]."""
        return self.ops.pack(w_t)

    def mm(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] @ W -> [M, n], for any M (a prefill's too): a row's result does not depend on the rows with it."""
        return self.ops.mm(x, packed, n)

    def swiglu_ffn(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """`fabric.model.ops.swiglu_ffn_t` over packed gate_up ([D, 2I]) and down ([I, D]) weights (D and I are their
        K)."""
        return self.ops.ffn_batch([x], [gate_up], [down])[0]

    def swiglu_calls(self, xs: list[torch.Tensor], segments: list[int], ends: list[int], gate_ups: list[torch.Tensor],
                     downs: list[torch.Tensor]) -> list[torch.Tensor]:
        """An EW's gathered batch in one call that releases the GIL throughout: each call's x [R_c, D] in, its
        results [R_c, D] out. Expert u (`gate_ups[u]`, `downs[u]`) runs once, over the rows named by its segments
        (call, first row, rows), flat in `segments[3 * ends[u - 1] : 3 * ends[u]]`; each is `swiglu_ffn`'s."""
        return self.ops.ffn_calls(xs, segments, ends, gate_ups, downs)


def gemm_for(kernel: str, dtype: torch.dtype) -> SkinnyGemm | None:
    """The kernel a worker with `--kernel kernel` uses for weights of `dtype`, or None (torch)."""
    if kernel != "auto" or dtype != torch.float32:
        return None
    ops = load()
    return SkinnyGemm(ops) if ops is not None else None


def module_for(kernel: str, dtype: torch.dtype) -> Any | None:
    """The kernels' module where it serves `--kernel kernel` over `dtype` (fp32 with `auto`), else None.

    It carries the AW's decode attention (`paged_decode`, paged_attention.cpp) and its per-layer glue (layer_ops.cpp)
    beside the GEMM."""
    return load() if kernel == "auto" and dtype == torch.float32 else None


def second_core(gemm: SkinnyGemm | None) -> bool:
    """Has a helper thread take a share of the few-row products' column blocks (second_core.h): an AW's, whose
    products at one stream read W while a CPU idles. Only where the kernel runs (`gemm`), torch computes with one
    thread, and this process may run on two CPUs or more. Call it from the thread that computes: the helper takes its
    scheduling class. Whether it runs."""
    if gemm is None or torch.get_num_threads() != 1:
        return False
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2:
        return False
    return bool(gemm.ops.second_core())


class Projection:
    """x @ W for one weight W [K, N].

    W is packed for the kernel where `gemm` is given and W is fp32. Else W is kept as it is, in any layout torch's
    matmul takes (e.g. a transposed view)."""

    def __init__(self, w: torch.Tensor, gemm: SkinnyGemm | None) -> None:
        self.gemm = gemm if gemm is not None and w.dtype == torch.float32 else None
        self.n = w.shape[1]
        self.w = self.gemm.pack(w) if self.gemm is not None else w  # [NB, K, 64] or [K, N]

    @classmethod
    def prepared(cls, w: torch.Tensor, gemm: SkinnyGemm | None, n: int) -> Projection:
        """A projection to `n` columns whose W is already in its serving layout (`.w` of another), packed ([NB, K,
        64]) or not ([K, n])."""
        p = cls.__new__(cls)
        p.gemm, p.w, p.n = (gemm if w.dim() == 3 else None), w, n
        if w.dim() == 3 and gemm is None:
            raise ValueError("a packed projection needs the skinny GEMM kernel")
        if not (w.shape[0] * COLS >= n > (w.shape[0] - 1) * COLS if w.dim() == 3 else w.shape[1] == n):
            raise ValueError(f"a weight of shape {tuple(w.shape)} does not project to {n} columns")
        return p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        return self.gemm.mm(x, self.w, self.n) if self.gemm is not None else x @ self.w


def main() -> None:
    """Builds the kernel into the cache (run by scripts/_venv.sh), or says why it cannot be used here."""
    t0 = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    if module is None:
        print(f"skinny GEMM kernel: not used on this machine ({unavailable_reason() or 'build failed'})")
    else:
        print(f"skinny GEMM kernel: ready in {build_dir()} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
