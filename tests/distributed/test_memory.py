"""``TensorMemory`` (the per-rank memory meter of the benchmark and the memory check) counts
what it should: new storages from creation to release, not views, in-place results or inputs."""

from __future__ import annotations

import torch

from multihead.distributed.memory import TensorMemory


def test_counts_new_storages_until_they_are_freed():
    x = torch.randn(1000, dtype=torch.float64)  # before the meter: not counted
    with TensorMemory() as memory:
        y = x * 2  # 8000 bytes
        view = y[10:]  # shares y's storage
        x.add_(1)  # in place on an input
        z = torch.empty(500, dtype=torch.float32)  # 2000 bytes
        assert memory.live == 10000 and memory.peak == 10000
        del y
        assert memory.live == 10000, "a view keeps its storage alive"
        del view
        assert memory.live == 2000
        w = torch.zeros(250, dtype=torch.float64)
        assert memory.live == 4000 and memory.peak == 10000
        memory.reset_peak()
        assert memory.peak == 4000
    assert [e[0] for e in memory.at_peak(2)] == [2000, 2000]
    del z, w


def test_sees_autograd_saved_tensors_and_the_backward():
    x = torch.randn(256, 256, requires_grad=True)
    with TensorMemory() as memory:
        y = (x @ x).exp()  # the product and its exp are alive together while exp runs
        forward = memory.peak
        y.sum().backward()
    assert forward == 2 * 256 * 256 * 4
    assert memory.peak > forward, "the backward's gradients were not seen"
