"""A small causal decoder (GPT-style, pre-norm) built from :class:`multihead.MultiHeadAttention`,
decoding step by step through the layer's ``kv_cache=`` seam.

    ids (B, L) -> tok_emb + pos_emb -> [x = x + attn(norm1(x)); x = x + mlp(norm2(x))] * n_layers
               -> norm -> head -> logits (B, L, V)

The attention layers are ``causal=True``. Without a cache each block calls its layer as is; with
a :class:`DecoderCache` block ``i`` calls ``attn(h, kv_cache=cache[i])`` and the layer projects
only the new tokens, stores their keys and values in that layer's
:class:`~multihead.caches.ConcatKVCache` and attends over all of them with the bottom-right
``causal()`` (see :mod:`multihead.conventions`), so prefill and one-token steps share one mask::

    prefill Lq=Lk=3     step Lq=1, Lk=4
    1 . .               1 1 1 1
    1 1 .
    1 1 1

``test_decoder.py`` checks that cached decoding equals the uncached forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.caches import ConcatKVCache, KVCache
from multihead.layers import MultiHeadAttention

__all__ = ["DecoderConfig", "CausalDecoder", "DecoderCache"]


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    max_len: int  # positions of the learned position embedding
    d_model: int = 64  # E
    num_layers: int = 2
    num_heads: int = 4  # Hq
    num_kv_heads: int | None = None  # Hkv; None = num_heads
    mlp_ratio: int = 4
    dropout: float = 0.0


class DecoderCache:
    """The per-layer key/value caches of a decoder, one :class:`~multihead.caches.KVCache` per
    attention layer (``cache[i]`` for block ``i``), all holding the same tokens.

    ``length`` is the number of tokens seen so far; :meth:`reset` empties every layer.
    """

    def __init__(self, layers: Sequence[KVCache]):
        layers = list(layers)
        if not layers or not all(isinstance(c, KVCache) for c in layers):
            got = [type(c).__name__ for c in layers]
            raise TypeError(f"DecoderCache: layers must be a non-empty sequence of multihead.caches.KVCache, got {got}")
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> KVCache:
        return self.layers[index]

    def reset(self) -> None:
        for cache in self.layers:
            cache.reset()

    def __repr__(self) -> str:
        return f"DecoderCache(layers={len(self.layers)} x {type(self.layers[0]).__name__}, length={self.length})"


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        E = config.d_model
        self.norm1 = nn.LayerNorm(E)
        self.attn = MultiHeadAttention(E, config.num_heads, num_kv_heads=config.num_kv_heads,
                                       dropout=config.dropout, causal=True)
        self.norm2 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, config.mlp_ratio * E), nn.GELU(), nn.Linear(config.mlp_ratio * E, E))

    def forward(self, x: Tensor, kv_cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), kv_cache=kv_cache)  # (B, L, E)
        return x + self.mlp(self.norm2(x))


class CausalDecoder(nn.Module):
    """Token ids ``(B, L)`` to next-token logits ``(B, L, V)``.

    Attention layers are named ``blocks.{i}.attn`` for :func:`multihead.capture_attention`.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        if config.d_model % config.num_heads:
            raise ValueError(f"DecoderConfig: d_model={config.d_model} must be divisible by num_heads={config.num_heads}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def new_cache(self) -> DecoderCache:
        """An empty cache for :meth:`forward`: one :class:`~multihead.caches.ConcatKVCache` per layer."""
        return DecoderCache(ConcatKVCache() for _ in self.blocks)

    def forward(self, ids: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """``ids (B, L)``; with ``cache``, the tokens come after the ``cache.length`` cached ones and
        the cache is extended in place. Returns logits ``(B, L, V)``."""
        start = 0
        if cache is not None:
            if not isinstance(cache, DecoderCache):
                raise TypeError(f"cache: expected None or a DecoderCache (model.new_cache()), "
                                f"got {type(cache).__name__}")
            if len(cache) != len(self.blocks):
                raise ValueError(f"cache: expected a DecoderCache of {len(self.blocks)} layers "
                                 f"(model.new_cache()), got {len(cache)} layers")
            start = cache.length
        if start + ids.shape[1] > self.config.max_len:
            raise ValueError(f"ids: {start} cached + {ids.shape[1]} new tokens exceed max_len={self.config.max_len}")
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)  # (B, L, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        return self.head(self.norm(x))

    def loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy over the scored targets (``-100`` elsewhere)."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
