"""An expert worker's batch through torch's ops and the fused Triton kernel (expert_worker/executor.py): the rows of
every call gathered by (layer, expert) into one buffer, each expert run on its slice, the results put back in each
call's order. Each expert's rows must get exactly the products that expert alone would give them, bit for bit, in a
batch of calls from several AWs over two layers, with an empty call and a call whose rows are one expert's. On the
CPU, and on a GPU where there is one (scripts/gpu-check.sh runs this file there): there the calls come in host
memory, go to the device in one copy and come back in one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)

from expert_worker.executor import ExpertExecutor  # noqa: E402
from expert_worker.gather import PendingCall  # noqa: E402
from fabric.messages.expert import ExpertCall  # noqa: E402
from fabric.model.config import ModelConfig  # noqa: E402
from fabric.model.ops import swiglu_ffn_t  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU under the interpreter)
UNITS = [(lyr, e) for lyr in (0, 1) for e in range(4)]
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")


def batch(hidden: int) -> list[PendingCall]:
    """Three AWs' calls at layer 1 (one of them empty, one expert shared by two) and one at layer 0."""
    g = torch.Generator().manual_seed(3)
    calls = [ExpertCall(1, 0, 1, [0, 2, 3], [3, 0, 2], torch.randn(5, hidden, generator=g)),
             ExpertCall(2, 0, 1, [], [], torch.zeros(0, hidden)),
             ExpertCall(3, 0, 1, [2, 3], [4, 1], torch.randn(5, hidden, generator=g)),
             ExpertCall(4, 0, 0, [1], [6], torch.randn(6, hidden, generator=g))]
    return [PendingCall(f"aw-{i}", None, c) for i, c in enumerate(calls)]  # type: ignore[arg-type]


def each_expert_alone(ex: ExpertExecutor, calls: list[PendingCall]) -> list[torch.Tensor]:
    """What the batch must give: each expert's rows, joined in call order, through torch's FFN alone."""
    rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for ci, p in enumerate(calls):
        start = 0
        for e, n in zip(p.call.experts, p.call.counts):
            if n:
                rows.setdefault((p.call.layer, e), []).append((ci, start, n))
            start += n
    outs = [torch.full_like(p.call.x, float("nan")) for p in calls]
    for unit, parts in rows.items():
        x = torch.cat([calls[ci].call.x[s : s + n] for ci, s, n in parts]).to(ex.device)
        y = swiglu_ffn_t(x, *ex.experts[unit]).cpu()
        at = 0
        for ci, s, n in parts:
            outs[ci][s : s + n] = y[at : at + n]
            at += n
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_torch_batches_give_each_expert_its_own_products(hf_models: dict[str, Path], device: str) -> None:
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    ex = ExpertExecutor(cfg, "torch", device)
    ex.load(hf_models["mixtral"], UNITS)
    calls = batch(cfg.hidden_size)
    got = ex.run(calls)
    want = each_expert_alone(ex, calls)
    assert [g.shape for g in got] == [p.call.x.shape for p in calls]
    assert all(g.device.type == "cpu" for g in got)  # calls in host memory, results in host memory
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert ex.tokens_by_expert[(1, 2)] == 4 and ex.tokens_by_expert[(1, 3)] == 3 and ex.tokens_by_expert[(0, 1)] == 6
    alone = ex.run(calls[2:3])  # one call, its rows sorted by expert: no reordering
    assert torch.equal(alone[0], each_expert_alone(ex, calls[2:3])[0])


def test_fused_batches_equal_torchs_across_layers(hf_models: dict[str, Path]) -> None:
    """The fused kernel runs each layer's slice in one launch: its products are the kernel's (not torch's bits), so
    they are compared within fp32 rounding; every row must come back to its own call and place."""
    pytest.importorskip("triton")
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    ex, ref = ExpertExecutor(cfg, "triton", TRITON_DEVICE), ExpertExecutor(cfg, "torch", TRITON_DEVICE)
    for e in (ex, ref):
        e.load(hf_models["mixtral"], UNITS)
    calls = batch(cfg.hidden_size)
    for g, w in zip(ex.run(calls), each_expert_alone(ref, calls)):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_layers_batch_replays_its_graph_as_the_fused_kernel_runs_it(hf_models: dict[str, Path]) -> None:
    """One layer's batch runs as the graph of its bucket (on the CPU: the same launches over the graph's buffers, not
    captured), with the same results, bit for bit, as the fused kernel run op by op: padded tiles do nothing, stale
    rows past the batch's are read by no tile. A graph serves every batch of its bucket; a batch of more rows than
    the graphs take, or of two layers, runs op by op; new experts in a layer rebuild its stack, and its graphs are
    captured again for it."""
    pytest.importorskip("triton")
    cfg = ModelConfig.from_dir(str(hf_models["mixtral"]))
    capture = TRITON_DEVICE == "cuda"
    ex, ref = ExpertExecutor(cfg, "triton", TRITON_DEVICE), ExpertExecutor(cfg, "triton", TRITON_DEVICE)
    ex.use_graphs(8, capture=capture)
    assert ex.graphs is not None and ex.graphs.buckets == [1, 2, 4, 8]
    for e in (ex, ref):
        e.load(hf_models["mixtral"], [(1, 0), (1, 2), (1, 3), (0, 1)])
    layer1 = batch(cfg.hidden_size)[:3]  # 10 rows at layer 1: more than the graphs take
    g = torch.Generator().manual_seed(5)

    def calls(*specs: tuple[int, list[int], list[int]]) -> list[PendingCall]:
        return [PendingCall(f"aw-{i}", None, ExpertCall(i, 0, layer, experts, counts,  # type: ignore[arg-type]
                                                           torch.randn(sum(counts), cfg.hidden_size, generator=g)))
                for i, (layer, experts, counts) in enumerate(specs)]

    def same(batch_: list[PendingCall]) -> None:
        for got, want in zip(ex.run(batch_), ref.run(batch_)):
            assert got.device.type == "cpu" and torch.equal(got, want)

    same(calls((1, [0, 3], [2, 1]), (1, [2, 3], [1, 2])))  # 6 rows, two AWs: bucket 8
    assert ex.graphs.replays == 1 and list(ex.graphs.graphs) == [(1, 8)]
    same(calls((1, [2], [5])))  # another batch of the bucket: the same graph, other tiles
    same(calls((1, [0], [1])))  # 1 row: bucket 1, the input buffer's rows 1.. stale
    assert ex.graphs.replays == 3 and sorted(ex.graphs.graphs) == [(1, 1), (1, 8)]
    same(layer1)
    same(calls((1, [0], [1]), (0, [1], [2])))  # two layers
    assert ex.graphs.replays == 3
    before = ex.graphs.graphs[(1, 8)][0]
    for e in (ex, ref):
        e.load(hf_models["mixtral"], [(1, 1)])  # the layer's stack rebuilt
    same(calls((1, [1, 2], [3, 4])))
    now = ex.graphs.graphs[(1, 8)][0]
    assert ex.graphs.replays == 4 and now is not before and now is ex.stacks[1]


def test_auto_runs_fp32_experts_on_a_gpu_with_the_fused_kernel() -> None:
    """`--kernel auto` on a GPU: the fused kernel (with its graphs) for fp32, where triton is installed; torch's ops
    for bf16, whose products against transformers' were not measured; the CPU's choice stays the CPU's."""
    from importlib.util import find_spec

    from fabric.kernels.choose import expert_ffn

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert expert_ffn("auto", gpu, torch.float32) == ("triton" if find_spec("triton") else "auto")
    assert expert_ffn("auto", gpu, torch.bfloat16) == "auto" and expert_ffn("torch", gpu, torch.float32) == "torch"
    assert expert_ffn("auto", cpu, torch.float32) == "auto" and expert_ffn("triton", cpu, torch.float32) == "triton"
