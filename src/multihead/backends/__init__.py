"""Backends: each declares what it supports, says why it refuses, and explains its plan."""

from multihead.backends.base import Backend, Capabilities
from multihead.backends.reference import ReferenceBackend
from multihead.backends.registry import (
    AUTO_ORDER,
    BackendRefusedError,
    available_backends,
    get_backend,
    register_backend,
    select_backend,
)
from multihead.backends.blocksparse import BlockSparseBackend
from multihead.backends.flex import FlexBackend
from multihead.backends.sdpa import SDPABackend

register_backend(ReferenceBackend(), auto_rank=99)
register_backend(SDPABackend(), auto_rank=0)
# Before sdpa: it passes (auto_refusals) on what sdpa runs unmasked; see docs/performance.md.
register_backend(BlockSparseBackend(), auto_rank=0)
# After sdpa, and it passes on CPU (auto_refusals): compile ~1 min on 2 cores.
register_backend(FlexBackend(), auto_rank=2)

__all__ = [
    "Backend", "Capabilities", "BackendRefusedError", "AUTO_ORDER",
    "available_backends", "get_backend", "register_backend", "select_backend",
    "ReferenceBackend", "SDPABackend", "BlockSparseBackend", "FlexBackend",
]
