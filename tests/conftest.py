import os
import sys

import pytest
import torch

# Tests import their helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
if not torch.cuda.is_available():
    # Without a GPU, Triton's kernels can only run in its interpreter, and Triton decides that
    # once, when it is first imported (torch.compile imports it, even on the CPU): set here, before
    # any test can import it, for the triton_blocks tests (tests/backends/test_triton_blocks.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if torch.cuda.is_available():
    # fp32 on CUDA is compared without TF32 (shared TESTING.md): TF32 matmuls round their inputs to
    # 10 mantissa bits, which the relative rule's naive fp32 baseline does not do.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(params=["cpu_kernel", "torch_gemms"])
def decode_kernel(request, monkeypatch):
    """A decode test twice on the CPU: through multihead's CPU decode kernel (where it is built:
    the decode backend, paged and int8 reads) and through PyTorch's GEMMs (what runs without a
    compiler, under autograd and off the CPU). The plans stored by the other run are dropped."""
    from multihead import plans
    from multihead.backends import cpu_kernels

    plans.clear()
    if request.param == "torch_gemms":
        monkeypatch.setattr(cpu_kernels, "supports", lambda *args, **kwargs: False)
    elif cpu_kernels.kernel() is None:
        pytest.skip(f"the CPU decode kernel is unavailable: {cpu_kernels.unavailable()}")
    return request.param
