"""multihead: attention mechanisms for PyTorch.

The functional core is :func:`attention` with its masks (:mod:`multihead.masks`), backends
(:mod:`multihead.backends`) and conventions (:mod:`multihead.conventions`), checked against the
fp64 oracle :func:`reference_attention`.
"""

from multihead import masks
from multihead.attention import attention
from multihead.capture import AttentionCapture, capture_attention
from multihead.backends import available_backends, get_backend, register_backend
from multihead.backends.registry import BackendRefusedError
from multihead.explain import Explanation, explain
from multihead.layers import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention
from multihead import compat
from multihead.masks import causal, custom, document, key_padding, prefix_lm, sliding_window
from multihead.reference import AttentionResult, reference_attention

__version__ = "0.1.0"

__all__ = [
    "attention", "capture_attention", "AttentionCapture", "explain", "Explanation", "reference_attention", "AttentionResult",
    "masks", "causal", "sliding_window", "key_padding", "document", "prefix_lm", "custom",
    "available_backends", "get_backend", "register_backend", "BackendRefusedError",
    "MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention", "compat",
]
