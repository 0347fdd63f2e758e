"""multihead: attention mechanisms for PyTorch.

The functional core is :func:`attention` with its masks (:mod:`multihead.masks`), backends
(:mod:`multihead.backends`) and conventions (:mod:`multihead.conventions`), checked against the
fp64 oracle :func:`reference_attention`.
"""

import sys as _sys
from types import ModuleType as _ModuleType

from multihead import (
    caches,
    distributed,  # context parallelism (ring, Ulysses): docs/distributed.md
    masks,
    positions,
    scores,
)
from multihead._version import __version__ as __version__  # written once, there
from multihead.attention import attention, plan
from multihead.backends import available_backends, get_backend, register_backend, unregister_backend
from multihead.backends.registry import BackendRefusedError
from multihead.blocks import Block, Extent
from multihead.caches import (
    CacheRead,
    DynamicKVCache,
    KVCache,
    LatentKVCache,
    PagedKVCache,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from multihead.call import AttentionResult
from multihead.capture import AttentionCapture, capture_attention
from multihead.cascade import cascade_attention
from multihead.explain import Explanation, explain
from multihead.hooks import hook_points, hooked  # docs/hooks.md: also on Hugging Face models
from multihead.layers import (
    DifferentialAttention,
    GatedAttention,
    GroupedQueryAttention,
    MixtureOfBlockAttention,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    MultiQueryAttention,
    NativeSparseAttention,
    TopKIndexerAttention,
    compat,
)
from multihead.masks import causal, custom, document, document_causal, key_padding, prefix_lm, sliding_window, tree
from multihead.merge import merge_partials
from multihead.nonfinite import set_nonfinite_check, skip_nonfinite_check
from multihead.reference import reference_attention

# The nn.MultiheadAttention drop-in lives with the layers; `import multihead.compat` keeps working.
_sys.modules[__name__ + ".compat"] = compat

# Floor-4 packages (models, viz, demo) import optional dependencies; they load on first use so
# that `import multihead` stays light: `multihead.models.SentenceEncoder` works after a plain import.
_LAZY = ("models", "viz", "apps", "integrations")


def __getattr__(name: str) -> _ModuleType:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"multihead.{name}")
    raise AttributeError(f"module 'multihead' has no attribute {name!r}")


__all__ = [
    "attention",
    "plan",
    "capture_attention",
    "AttentionCapture",
    "hook_points",
    "hooked",
    "explain",
    "Explanation",
    "reference_attention",
    "AttentionResult",
    "Extent",
    "Block",
    "merge_partials",
    "set_nonfinite_check",
    "skip_nonfinite_check",
    "cascade_attention",
    "scores",
    "masks",
    "causal",
    "sliding_window",
    "key_padding",
    "document",
    "document_causal",
    "prefix_lm",
    "tree",
    "custom",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "BackendRefusedError",
    "MultiHeadAttention",
    "GroupedQueryAttention",
    "MultiQueryAttention",
    "MultiHeadLatentAttention",
    "GatedAttention",
    "DifferentialAttention",
    "MixtureOfBlockAttention",
    "NativeSparseAttention",
    "TopKIndexerAttention",
    "compat",
    "caches",
    "KVCache",
    "CacheRead",
    "DynamicKVCache",
    "StaticKVCache",
    "SlidingWindowKVCache",
    "PagedKVCache",
    "LatentKVCache",
    "QuantizedKVCache",
    "positions",
    "distributed",
]
