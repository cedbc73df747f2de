"""The second core for few-row products (fabric/kernels/second_core.h): the same floats whichever thread computed which
block, the helper taking blocks where a CPU is free, two callers at once, and where it stays off.

Each check runs in a fresh process: the helper, once started, serves the process for good."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fabric.kernels import skinny

pytestmark = pytest.mark.skipif(skinny.unavailable_reason() is not None, reason=skinny.unavailable_reason() or "")
two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a helper needs a second CPU to run on")


def _run(body: str) -> str:
    code = textwrap.dedent("""
        import os, threading, time
        import torch
        from fabric.kernels import skinny
        torch.set_num_threads(1)
        ops = skinny.load()
        g = skinny.SkinnyGemm(ops)
        torch.manual_seed(0)
    """) + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@two_cpus
def test_shared_products_are_the_same_floats_and_the_helper_takes_blocks() -> None:
    """One to four rows (shared) and more (alone), whole and part-full last blocks: bit for bit the products of a
    process without the helper; and the helper computes some of the blocks."""
    out = _run("""
        cases = [(rows, k, n) for rows in (1, 2, 4, 5) for (k, n) in ((512, 1024), (256, 1000), (512, 8192))]
        ws = {(k, n): g.pack(torch.randn(k, n)) for _, k, n in cases}
        xs = {(rows, k): torch.randn(rows, k) for rows, k, _ in cases}
        alone = {c: g.mm(xs[c[:2]], ws[c[1:]], c[2]) for c in cases}
        assert ops.second_core_stats() == (0, 0)
        assert skinny.second_core(g)
        deadline = time.monotonic() + 60
        rounds = 0
        while True:
            rounds += 1
            for c in cases:
                assert torch.equal(g.mm(xs[c[:2]], ws[c[1:]], c[2]), alone[c]), c
            products, helped = ops.second_core_stats()
            if helped or time.monotonic() > deadline:
                break
        print(rounds, products, helped)
    """)
    rounds, products, helped = map(int, out.split())
    assert products > 0, "no product was shared"  # (1-4 rows, >= 4 blocks and 512 KiB of W: every case but 5 rows)
    assert helped > 0, f"in {rounds} rounds of {products} shared products the helper computed no block"


@two_cpus
def test_two_callers_at_once_get_their_own_products() -> None:
    """The GIL is released in a product: a second thread's product while one runs is computed alone, and each
    caller gets its own, bit for bit."""
    _run("""
        w = g.pack(torch.randn(512, 4096))
        xs = [torch.randn(1 + i % 3, 512) for i in range(6)]
        alone = [g.mm(x, w, 4096) for x in xs]
        assert skinny.second_core(g)
        bad = []

        def work(i):
            for _ in range(150):
                if not torch.equal(g.mm(xs[i], w, 4096), alone[i]):
                    bad.append(i)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not bad, bad
    """)


def test_it_stays_off_on_one_cpu_or_with_torchs_threads() -> None:
    """A process kept on one CPU has none to share with; one whose torch computes with threads splits its products
    there (`at::parallel_for`); without the kernel there is nothing to share."""
    out = _run("""
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(skinny.second_core(g), skinny.second_core(None))
    """)
    assert out.split() == ["False", "False"]
    out = _run("""
        torch.set_num_threads(2)
        print(skinny.second_core(g))
    """)
    assert out.split() == ["False"]
