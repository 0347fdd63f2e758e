"""A small causal decoder (GPT-style, pre-norm) built from :class:`multihead.MultiHeadAttention`,
with a minimal KV cache for step-by-step decoding.

    ids (B, L) -> tok_emb + pos_emb -> [x = x + attn(norm1(x)); x = x + mlp(norm2(x))] * n_layers
               -> norm -> head -> logits (B, L, V)

Without a cache the blocks call their attention layer as is (``causal=True``). With a
:class:`KVCache` a block projects only the new tokens, appends their keys and values to the
cache and calls :func:`multihead.attention` with :func:`multihead.causal`: its bottom-right
alignment (see :mod:`multihead.conventions`) lets ``Lq`` new queries see the ``Lk - Lq`` cached
keys plus themselves causally, so prefill and one-token steps use the same mask object::

    prefill Lq=Lk=3     step Lq=1, Lk=4
    1 . .               1 1 1 1
    1 1 .
    1 1 1

The cached path uses the layer's own ``q_proj``/``k_proj``/``v_proj``/``out_proj`` and the head
split of :class:`multihead.MultiHeadAttention` (head ``h`` = rows ``[h*D, (h+1)*D)``);
``test_decoder.py`` checks it equals the uncached forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import multihead
from multihead.capture import is_capturing, record
from multihead.layers import MultiHeadAttention
from multihead.layers.heads import merge_heads, split_heads

__all__ = ["DecoderConfig", "CausalDecoder", "KVCache"]


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


class KVCache:
    """Keys and values of every layer for the tokens seen so far: ``(B, Hkv, T, D)`` per layer.

    Minimal by design (concatenation, no preallocation); ``length`` is the number of cached tokens.
    """

    def __init__(self, num_layers: int):
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add ``k, v (B, Hkv, Lnew, D)`` of ``layer``; return all of them ``(B, Hkv, T + Lnew, D)``."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig, index: int):
        super().__init__()
        E = config.d_model
        self.index = index
        self.norm1 = nn.LayerNorm(E)
        self.attn = MultiHeadAttention(E, config.num_heads, num_kv_heads=config.num_kv_heads,
                                       dropout=config.dropout, causal=True)
        self.norm2 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, config.mlp_ratio * E), nn.GELU(), nn.Linear(config.mlp_ratio * E, E))

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        h = self.norm1(x)
        x = x + (self.attn(h) if cache is None else self._cached_attention(h, cache))
        return x + self.mlp(self.norm2(x))

    def _cached_attention(self, h: Tensor, cache: KVCache) -> Tensor:
        """The attention layer on ``h (B, Lnew, E)`` with earlier keys/values taken from ``cache``."""
        attn = self.attn
        q = split_heads(attn.q_proj(h), attn.num_heads, attn.head_dim, True)  # (B, Hq, Lnew, D)
        k = split_heads(attn.k_proj(h), attn.num_kv_heads, attn.head_dim, True)  # (B, Hkv, Lnew, D)
        v = split_heads(attn.v_proj(h), attn.num_kv_heads, attn.head_dim, True)
        k, v = cache.append(self.index, k, v)  # (B, Hkv, T, D), T = cached + Lnew
        capturing = is_capturing(attn)  # weights only when someone records them
        res = multihead.attention(q, k, v, mask=multihead.causal(), return_weights=capturing)
        out = res.output if capturing else res  # (B, Hq, Lnew, D)
        if capturing:
            record(attn, res.weights)  # (B, Hq, Lnew, T)
        return attn.out_proj(merge_heads(out))  # (B, Lnew, E)


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
        self.blocks = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """``ids (B, L)``; with ``cache``, the tokens come after the ``cache.length`` cached ones and
        the cache is extended in place. Returns logits ``(B, L, V)``."""
        start = 0 if cache is None else cache.length
        if start + ids.shape[1] > self.config.max_len:
            raise ValueError(f"ids: {start} cached + {ids.shape[1]} new tokens exceed max_len={self.config.max_len}")
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)  # (B, L, E)
        for block in self.blocks:
            x = block(x, cache)
        return self.head(self.norm(x))

    def loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy over the scored targets (``-100`` elsewhere)."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
