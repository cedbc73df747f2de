"""The moves between host and device memory that a step makes in bulk (fabric/device.py): a step's metadata
to the device in one copy per dtype, a layer's rows and routing to the host in one wait, and the layer's plan
and combine made in host memory for device tensors, equal to the same on the host. The CUDA cases run where a
GPU is (scripts/gpu-check.sh runs this file there); on the CPU the moves are the tensors themselves."""

from __future__ import annotations

import pytest
import torch

from attention_worker.layer_plan import combine, plan_layer
from fabric.device import to_device_all, to_host_all

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mixed() -> list[torch.Tensor]:
    """Tensors of three dtypes, of every rank a step's metadata has, empty ones and a non-contiguous one among them."""
    g = torch.Generator().manual_seed(0)
    return [torch.arange(7), torch.randn(5, 3, generator=g), torch.zeros(4, 0, dtype=torch.long),
            torch.rand(2, 1, 1, 6, generator=g) > 0.5, torch.randint(0, 9, (3, 4), generator=g).t(),
            torch.empty(0), torch.tensor([True]), torch.randn(1, 8, generator=g)]


def test_on_the_cpu_the_moves_are_the_tensors_themselves() -> None:
    ts = mixed()
    assert all(a is b for a, b in zip(to_device_all(ts, torch.device("cpu")), ts))
    assert all(a is b for a, b in zip(to_host_all(*ts), ts))


@cuda
def test_a_steps_metadata_reaches_the_device_as_one_copy_each_would_make_it() -> None:
    ts = mixed()
    moved = to_device_all(ts, torch.device("cuda"))
    for t, m in zip(ts, moved):
        assert m.device.type == "cuda" and m.dtype == t.dtype and m.shape == t.shape
        assert torch.equal(m.cpu(), t)
    back = to_host_all(*moved)
    assert all(b.device.type == "cpu" and torch.equal(b, t) for b, t in zip(back, ts))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_device_layers_plan_and_combine_equal_the_hosts(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for t in (1, 5, 64):
        x = torch.randn(t, 32).to(dtype)
        experts = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
        weights = torch.rand(t, 2).to(dtype)
        host = plan_layer(1, x, experts, weights, 8)
        dev = plan_layer(1, x.cuda(), experts.cuda(), weights.cuda(), 8)
        assert torch.equal(dev.xs, host.xs) and dev.spans == host.spans and torch.equal(dev.weights, host.weights)
        res = host.xs * 3 + 1  # [R, D] stand-in results, off the wire in host memory
        parts = [(slice(0, res.shape[0]), res)]
        y = combine(dev, parts, x.cuda())
        assert y.device.type == "cuda" and torch.equal(y.cpu(), combine(host, parts, x))
