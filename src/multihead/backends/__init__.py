"""Backends: each declares what it supports, says why it refuses, and explains its plan."""

from multihead.backends.base import MASK_KINDS, SCORE_MOD_KINDS, Backend, Capabilities
from multihead.backends.blocksparse import BlockSparseBackend
from multihead.backends.decode import DecodeBackend
from multihead.backends.flex import FlexBackend
from multihead.backends.reference import ReferenceBackend
from multihead.backends.registry import (
    AUTO_ORDER,
    BackendRefusedError,
    available_backends,
    get_backend,
    register_backend,
    select_backend,
    unregister_backend,
)
from multihead.backends.sdpa import SDPABackend
from multihead.backends.torch_blocks_backend import TorchBlocksBackend
from multihead.backends.triton_blocks import TritonBlocksBackend

# The auto order, lower first (measured; docs/performance.md). decode takes calls of a few query
# tokens (a decode step) and passes (auto_refusals) on longer ones. blocksparse passes (auto_refusals)
# on what sdpa runs as well: no mask, causal diagonals, small calls. torch_blocks takes what the
# fused CPU kernels cannot run (dropout, elementwise modifiers) where it beats sdpa's math kernel.
# flex passes on CPU (a minute to compile on 2 cores) and, on CUDA, on all but large structured
# masks that leave most tiles empty, which it runs in proportion to the visible blocks where sdpa
# needs a dense mask. The oracle is last.
register_backend(DecodeBackend(), priority=5)
register_backend(BlockSparseBackend(), priority=10)
register_backend(TorchBlocksBackend(), priority=11)
register_backend(FlexBackend(), priority=15)
register_backend(SDPABackend(), priority=20)
register_backend(ReferenceBackend(), priority=100)
# triton_blocks (CUDA; Triton kernels of our own) is forced by name only until GPU measurements
# place it in this order (benchmarks/gpu.py).
register_backend(TritonBlocksBackend())

__all__ = [
    "Backend",
    "Capabilities",
    "MASK_KINDS",
    "SCORE_MOD_KINDS",
    "BackendRefusedError",
    "AUTO_ORDER",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "select_backend",
    "ReferenceBackend",
    "SDPABackend",
    "BlockSparseBackend",
    "TorchBlocksBackend",
    "FlexBackend",
    "DecodeBackend",
    "TritonBlocksBackend",
]
