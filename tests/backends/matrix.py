"""The backend test matrix, generated from the registry and the declared capabilities.

Every registered backend x every device present (CPU always, CUDA when there is one) is a
parameter; :func:`backend_dtype_params` adds the dtypes of each device (fp16 on CUDA only). A call
the backend declares it cannot serve is not a pass: :func:`serve_or_skip` first proves that
forcing the backend raises ``BackendRefusedError`` naming it, then skips the case with the
backend's reasons. Tolerance factors come from the backend's capabilities.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import DEVICES, refusals

# flex compiles (about a minute on 2 cores): its correctness runs in the slow tier (test_flex.py).
SLOW_BACKENDS = {"flex"}
__all__ = ["DEVICES", "backend_dtype_params", "backend_params", "dtypes_for", "factor", "serve_or_skip"]


def backend_params(include_slow: bool = False) -> list:
    """``pytest.param(name, device)`` for every registered backend and every device present."""
    return [
        pytest.param(name, device, id=f"{name}-{device}")
        for name in mh.available_backends()
        if include_slow or name not in SLOW_BACKENDS
        for device in DEVICES
    ]


def dtypes_for(device: str) -> list[torch.dtype]:
    """The dtypes the matrix runs on ``device``: fp64, fp32 and bf16 everywhere; fp16 on CUDA, the
    dtype its fused kernels are written for (on CPU it would add time and no new kernel)."""
    if device == "cuda":
        return [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    return [torch.float64, torch.float32, torch.bfloat16]


def backend_dtype_params(include_slow: bool = False) -> list:
    """``pytest.param(name, device, dtype)``: :func:`backend_params` x :func:`dtypes_for` the device."""
    return [
        pytest.param(name, device, dtype, id=f"{name}-{device}-{dtype}")
        for p in backend_params(include_slow)
        for name, device in [p.values]
        for dtype in dtypes_for(device)
    ]


def serve_or_skip(backend: str, q, k, v, **kwargs) -> None:
    """Skip (with the backend's reasons) unless ``backend`` declares it can serve this call; a
    declared refusal must also make a forced call raise (:func:`helpers.refusals`)."""
    reasons = refusals(backend, q, k, v, **kwargs)
    if reasons:
        pytest.skip(f"{backend} refuses: " + "; ".join(reasons))


def factor(backend: str, dtype: torch.dtype, gradients: bool = False) -> float:
    return mh.get_backend(backend).capabilities.tolerance_factor(dtype, gradients)
