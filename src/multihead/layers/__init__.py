"""Attention layers built on :func:`multihead.attention`.

* :class:`MultiHeadAttention`: MHA, GQA (``num_kv_heads``), MQA and cross-attention in one class,
  with :class:`GroupedQueryAttention` and :class:`MultiQueryAttention` as named aliases.
* :class:`MultiHeadLatentAttention`: DeepSeek's MLA (latent K/V cache; naive and absorbed modes).
* :class:`GatedAttention`, :class:`DifferentialAttention`, :class:`MixtureOfBlockAttention` (MoBA),
  :class:`NativeSparseAttention` (NSA), :class:`TopKIndexerAttention` (DSA's indexer):
  the variants of ``docs/variants.md``,
  each a :class:`MultiHeadAttention` with its own attention function and last step.
* ``multihead.compat.MultiheadAttention`` (module ``multihead.layers.compat``): a drop-in for
  ``torch.nn.MultiheadAttention``.
"""

from multihead.layers import compat
from multihead.layers.differential import DifferentialAttention
from multihead.layers.gated import GatedAttention
from multihead.layers.latent import MultiHeadLatentAttention
from multihead.layers.moba import MixtureOfBlockAttention
from multihead.layers.multihead import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention
from multihead.layers.nsa import NativeSparseAttention
from multihead.layers.topk_indexer import TopKIndexerAttention

__all__ = [
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
]
