"""Attention layers built on :func:`multihead.attention`.

* :class:`MultiHeadAttention`: MHA, GQA (``num_kv_heads``), MQA and cross-attention in one class,
  with :class:`GroupedQueryAttention` and :class:`MultiQueryAttention` as named aliases.
* :class:`MultiHeadLatentAttention`: DeepSeek's MLA (latent K/V cache; naive and absorbed modes).
* ``multihead.compat.MultiheadAttention`` (module ``multihead.layers.compat``): a drop-in for
  ``torch.nn.MultiheadAttention``.
"""

from multihead.layers import compat
from multihead.layers.latent import MultiHeadLatentAttention
from multihead.layers.multihead import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention", "MultiHeadLatentAttention", "compat"]
