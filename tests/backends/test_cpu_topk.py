"""multihead's CPU best-first kernel (``backends/cpu_topk.c``): what ``layers.ranking.best_first``
runs for fp32 CPU scores. Equal to a stable descending sort (ties to the lower index, ``-inf``
never chosen, ``-0.0`` equal to ``0.0``) over rows of many ties, fewer finite scores than ``n``,
non-contiguous rows; rows with a NaN are flagged and ranked as ``best_first`` ranks them without
the kernel (NaN first); under ``torch.compile`` and for other dtypes the PyTorch path runs.
"""

from __future__ import annotations

import pytest
import torch

from multihead.backends import cpu_topk
from multihead.layers import ranking

pytestmark = pytest.mark.skipif(
    cpu_topk.kernel() is None, reason=f"the CPU best-first kernel is unavailable: {cpu_topk.unavailable()}"
)


def _stable_first(scores, n):
    ranked, order = torch.sort(scores.double() + 0.0, dim=-1, descending=True, stable=True)
    n = min(n, scores.shape[-1])
    return torch.where(torch.isneginf(ranked[..., :n]), -1, order[..., :n])


@pytest.mark.parametrize("m,n", [(1, 1), (7, 3), (37, 16), (256, 16), (256, 17), (300, 256), (5, 9), (64, 2)])
def test_the_kernel_is_the_stable_sort(m, n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    s = (torch.randint(-3, 4, (3, 5, m), generator=g) * 0.5).float()  # many ties
    s[torch.rand(s.shape, generator=g) < 0.2] = float("-inf")
    s[torch.rand(s.shape, generator=g) < 0.1] = float("inf")
    s[torch.rand(s.shape, generator=g) < 0.1] = -0.0
    s[0, 0] = float("-inf")  # a row with nothing to choose
    assert cpu_topk.supports(s, min(n, m))
    got, nan = cpu_topk.best_first_rows(s, min(n, m))
    assert not bool(nan.any())
    assert torch.equal(got, _stable_first(s, n))
    assert torch.equal(ranking.best_first(s, n), _stable_first(s, n))
    t = s.transpose(0, 1)  # rows not in order in memory
    assert torch.equal(ranking.best_first(t, n), _stable_first(t, n))


def test_rows_with_nan_rank_as_without_the_kernel(monkeypatch):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(6, 40, generator=g)
    s[2, 7] = float("nan")
    s[4, 0] = float("nan")
    _, nan = cpu_topk.best_first_rows(s, 5)
    assert nan.tolist() == [False, False, True, False, True, False]
    fast = ranking.best_first(s, 5)
    monkeypatch.setattr(cpu_topk, "supports", lambda *args: False)
    assert torch.equal(fast, ranking.best_first(s, 5))


def test_other_operands_take_the_pytorch_path(monkeypatch):
    s = torch.randn(4, 30)
    assert not cpu_topk.supports(s.double(), 5) and not cpu_topk.supports(s.bfloat16(), 5)
    assert not cpu_topk.supports(s, 257)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not cpu_topk.supports(s, 5)


def test_random_rows_of_moba_length():
    """Rows of distinct scores (the first pass's threshold prunes most of them) and of ties."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 8, 16):
        s = torch.randn(64, 256, generator=g)
        s[:8] = s[:8].round()  # many ties, some at the threshold
        s[8:16, 100:] = float("-inf")
        assert torch.equal(ranking.best_first(s, n), _stable_first(s, n))
