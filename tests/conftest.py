import os
import sys

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
