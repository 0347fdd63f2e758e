"""Mask fingerprints (``multihead.distributed.fingerprint``), what ranks compare before a sharded
call: by content whatever the size, equal for equal values, and the same numbers on the host
path (small CPU tensors, in Python) as on the tensor path."""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.distributed.fingerprint import (
    _sums_on_device,
    _sums_on_host,
    _words,
    mask_fingerprint,
    tensor_fingerprint,
)

N = 100_003  # more than 2^16 elements: several rows of the weight table, and a partial last row


def _values(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(N, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(N, generator=g).to(dtype)
    return torch.randint(0, 50, (N,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32, torch.float16, torch.float64])
def test_one_changed_element_or_a_swap_changes_the_fingerprint(dtype):
    x = _values(dtype)
    i, j = 5, 5 + (1 << 14)  # one row apart: the same table weight, told apart by the row factor
    x[i], x[j] = 0, 1
    seen = {tensor_fingerprint(x)}
    for i in (0, 1 << 14, N // 2, N - 1):  # first, first of a row, middle, last of a partial row
        y = x.clone()
        y[i] = ~y[i] if dtype == torch.bool else y[i] + 1
        seen.add(tensor_fingerprint(y))
    y = x.clone()
    y[i], y[j] = 1, 0  # swapped
    seen.add(tensor_fingerprint(y))
    assert len(seen) == 6, f"{dtype}: {6 - len(seen)} changes left the fingerprint unchanged"


def test_equal_values_give_equal_fingerprints_whatever_the_layout():
    x = torch.randint(0, 7, (300, 400))
    strided = x.t().contiguous().t()  # the same values, column-major in memory
    assert not strided.is_contiguous()
    assert tensor_fingerprint(x) == tensor_fingerprint(strided) == tensor_fingerprint(x.clone())


@pytest.mark.parametrize(
    "t",
    [torch.tensor([3, 5]), torch.tensor([True, False, True]), torch.randn(64, dtype=torch.float64)],
    ids=["lengths", "bools", "fp64"],
)
def test_host_path_equals_tensor_path(t):
    words = _words(t)
    assert _sums_on_host(words) == _sums_on_device(words)


def test_large_masks_compare_by_content():
    ids = torch.zeros(400, 256, dtype=torch.long)  # 102400 ids
    other = ids.clone()
    other[399, 255] = 1
    assert mask_fingerprint(masks.document(ids)) != mask_fingerprint(masks.document(other))
    assert mask_fingerprint(masks.document(ids)) == mask_fingerprint(masks.document(ids.clone()))
    table = torch.rand(400, 256, generator=torch.Generator().manual_seed(1)) < 0.9
    flipped = table.clone()
    flipped[0, 0] = ~flipped[0, 0]
    assert mask_fingerprint(masks.key_padding(table)) != mask_fingerprint(masks.key_padding(flipped))
    bool_mask = table.reshape(1, 1, 320, 320)
    assert mask_fingerprint(masks.causal() & bool_mask) != mask_fingerprint(
        masks.causal() & flipped.reshape(1, 1, 320, 320)
    )
