"""A small causal decoder (GPT-style, pre-norm) built from :class:`multihead.MultiHeadAttention`,
decoding step by step through the layer's ``kv_cache=`` seam.

    ids (B, L) -> tok_emb + pos_emb -> [x = x + attn(norm1(x)); x = x + mlp(norm2(x))] * n_layers
               -> norm -> head -> logits (B, L, V)

The attention layers are ``causal=True`` (and ``sliding_window(window)`` when the config sets a
window). Without a cache each block calls its layer as is; with a :class:`DecoderCache` block ``i``
calls ``attn(h, kv_cache=cache[i])`` and the layer projects only the new tokens, stores their keys
and values in that layer's :class:`~multihead.caches.KVCache` and attends over all of them at
their absolute positions (see :mod:`multihead.caches`), so prefill and one-token steps share one
mask::

    prefill Lq=Lk=3     step Lq=1, Lk=4
    1 . .               1 1 1 1
    1 1 .
    1 1 1

``test_decoder.py`` checks that cached decoding equals the uncached forward, and
:meth:`CausalDecoder.generate` decodes with any of the three caches (compiled, for the static one).
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.caches import DynamicKVCache, KVCache, QuantizedKVCache, SlidingWindowKVCache, StaticKVCache
from multihead.layers import MultiHeadAttention
from multihead.layers.projection import project, unhooked
from multihead.masks import sliding_window

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
    window: int | None = None  # sliding_window(window) attention; None: full causal


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
        """Tokens cached (the same in every layer)."""
        return self.layers[0].length

    def next_positions(self, new: int, device=None) -> Tensor:
        """The positions ``(new,)`` or ``(B, new)`` the next tokens take (every layer agrees)."""
        return self.layers[0].next_positions(new, device)

    def crop(self, length) -> None:
        """:meth:`~multihead.caches.KVCache.crop` every layer (an int, or one length per row)."""
        for cache in self.layers:
            cache.crop(length)

    def reorder(self, indices) -> None:
        """:meth:`~multihead.caches.KVCache.reorder` every layer (beam search)."""
        for cache in self.layers:
            cache.reorder(indices)

    @property
    def nbytes(self) -> int:
        """Bytes held by the caches of all layers."""
        return sum(cache.nbytes for cache in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> KVCache:
        return self.layers[index]

    def reset(self) -> None:
        """Empty every layer's cache."""
        for cache in self.layers:
            cache.reset()

    def __repr__(self) -> str:
        return f"DecoderCache(layers={len(self.layers)} x {type(self.layers[0]).__name__}, length={self.length})"


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        E = config.d_model
        self.norm1 = nn.LayerNorm(E)
        self.attn = MultiHeadAttention(
            E, config.num_heads, num_kv_heads=config.num_kv_heads, dropout=config.dropout, causal=True
        )
        self.window = None if config.window is None else sliding_window(config.window)
        self.norm2 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, config.mlp_ratio * E), nn.GELU(), nn.Linear(config.mlp_ratio * E, E))

    def forward(self, x: Tensor, kv_cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), kv_cache=kv_cache, mask=self.window)  # (B, L, E)
        mlp = self.mlp
        if type(mlp) is not nn.Sequential or len(mlp) != 3 or not unhooked(mlp):  # replaced, or watched
            return x + mlp(self.norm2(x))
        up, act, down = mlp  # its Linears through project: a bf16 decode step's on the one-token kernel
        return x + project(down, act(project(up, self.norm2(x))))


class CausalDecoder(nn.Module):
    """Token ids ``(B, L)`` to next-token logits ``(B, L, V)``.

    Attention layers are named ``blocks.{i}.attn`` for :func:`multihead.capture_attention`.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        if config.d_model % config.num_heads:
            raise ValueError(
                f"DecoderConfig: d_model={config.d_model} must be divisible by num_heads={config.num_heads}"
            )
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def new_cache(self, kind: str = "dynamic", *, batch_size: int = 1, max_len: int | None = None) -> DecoderCache:
        """An empty cache for :meth:`forward`, one per layer: ``kind="dynamic"``
        (:class:`~multihead.caches.DynamicKVCache`), ``"static"`` (a
        :class:`~multihead.caches.StaticKVCache` of ``batch_size`` rows and ``max_len`` slots,
        default the model's ``max_len``), ``"sliding"`` (a
        :class:`~multihead.caches.SlidingWindowKVCache` of the config's ``window``) or ``"int8"`` /
        ``"fp8"`` (a :class:`~multihead.caches.QuantizedKVCache` of ``max_len`` slots in that format,
        its defaults for the full-precision sinks and residual window)."""
        c = self.config
        Hkv = c.num_kv_heads or c.num_heads
        D = c.d_model // c.num_heads
        param = self.tok_emb.weight
        layers: list[KVCache]
        if kind == "dynamic":
            layers = [DynamicKVCache() for _ in self.blocks]
        elif kind == "static":
            slots = c.max_len if max_len is None else max_len
            layers = [
                StaticKVCache(batch_size, slots, Hkv, D, dtype=param.dtype, device=param.device) for _ in self.blocks
            ]
        elif kind == "sliding":
            if c.window is None:
                raise ValueError(
                    "new_cache: kind='sliding' needs a model with a sliding window (DecoderConfig(window=...)); "
                    "this one attends to every earlier token: use 'dynamic' or 'static'"
                )
            layers = [
                SlidingWindowKVCache(c.window, batch_size, Hkv, D, dtype=param.dtype, device=param.device)
                for _ in self.blocks
            ]
        elif kind in ("int8", "fp8"):
            slots = c.max_len if max_len is None else max_len
            layers = [
                QuantizedKVCache(batch_size, slots, Hkv, D, format=kind, dtype=param.dtype, device=param.device)
                for _ in self.blocks
            ]
        else:
            raise ValueError(f"new_cache: kind must be 'dynamic', 'static', 'sliding', 'int8' or 'fp8', got {kind!r}")
        return DecoderCache(layers)

    def forward(self, ids: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """``ids (B, L)``; with ``cache``, the tokens come after the cached ones (per row for a static
        cache whose rows differ) and the cache is extended in place. Returns logits ``(B, L, V)``."""
        if cache is not None:
            if not isinstance(cache, DecoderCache):
                raise TypeError(
                    f"cache: expected None or a DecoderCache (model.new_cache()), got {type(cache).__name__}"
                )
            if len(cache) != len(self.blocks):
                raise ValueError(
                    f"cache: expected a DecoderCache of {len(self.blocks)} layers "
                    f"(model.new_cache()), got {len(cache)} layers"
                )
            pos = cache.next_positions(ids.shape[1], ids.device)  # (L,) or (B, L)
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)
        if not torch.compiler.is_compiling() and pos.numel() and int(pos.max()) >= self.config.max_len:
            raise ValueError(
                f"ids: {int(pos.min())} cached + {ids.shape[1]} new tokens exceed max_len={self.config.max_len}"
            )
        x = self.tok_emb(ids) + self.pos_emb(pos)  # (B, L, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        return project(self.head, self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        cache: str = "static",
        prompt_lengths: Tensor | None = None,
        compile: bool = False,
        generator: torch.Generator | None = None,
        progress: bool | None = None,
    ) -> Tensor:
        """Continue ``prompt_ids (B, P)`` by ``max_new_tokens`` tokens; returns them, ``(B, max_new_tokens)``.

        Args:
            temperature: 0 picks the most likely token (greedy); otherwise sample from
                ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely if given.
            cache: ``"static"``, ``"dynamic"`` or ``"sliding"`` (:meth:`new_cache`).
            prompt_lengths: ``(B,)`` real lengths of right-padded prompts (static cache): each row
                continues after its own last real token.
            compile: run the one-token step under ``torch.compile(fullgraph=True)`` (static cache
                only: fixed shapes, no recompilation between steps). The cache then has a power of
                two of slots (at most the model's ``max_len``), and each cache shape is compiled
                once per model and kept: prompts of different lengths share a few graphs.
            generator: for sampling.
            progress: print a progress line to stderr; default: for runs of 256 tokens or more on
                a terminal.
        """
        _check_generate(prompt_ids, max_new_tokens, temperature, top_k, cache, prompt_lengths, compile, self.config)
        B, P = prompt_ids.shape
        total = P + max_new_tokens
        if compile and cache == "static":
            # A compiled step has the cache's shape in its graph: slots in powers of two (at most
            # twice the text, each read every step) keep the graphs few across prompt lengths.
            total = min(self.config.max_len, 1 << (total - 1).bit_length())
        kv = self.new_cache(cache, batch_size=B, max_len=total) if cache != "dynamic" else self.new_cache(cache)
        logits = self(prompt_ids, kv)  # (B, P, V)
        if prompt_lengths is not None:
            lengths = prompt_lengths.to(prompt_ids.device, torch.int64)
            kv.crop(lengths)
            last = logits[torch.arange(B, device=logits.device), lengths - 1]  # (B, V)
        else:
            last = logits[:, -1]
        step = self._compiled_step(kv, prompt_ids) if compile else self._step
        show = progress if progress is not None else (max_new_tokens >= 256 and sys.stderr.isatty())
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=prompt_ids.device)
        for t in range(max_new_tokens):
            token = _pick(last, temperature, top_k, generator)  # (B,)
            out[:, t] = token
            if t + 1 < max_new_tokens:
                last = step(token.view(B, 1), kv)  # (B, V)
            if show and (t + 1) % 64 == 0 or show and t + 1 == max_new_tokens:
                print(f"\rgenerate: {t + 1}/{max_new_tokens} tokens", end="", file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)
        return out

    def _step(self, token: Tensor, cache: DecoderCache) -> Tensor:
        """One decode step: ``token (B, 1)`` -> next-token logits ``(B, V)``."""
        return self(token, cache)[:, -1]

    def _compiled_step(self, cache: DecoderCache, ids: Tensor) -> Callable[[Tensor, DecoderCache], Tensor]:
        """The step under ``torch.compile(fullgraph=True, dynamic=False)``, one per cache shape,
        kept for this model. Each is compiled from its own copy of :meth:`_step`'s code: Dynamo
        keeps its graphs per code object and, with ``fullgraph=True``, fails outright past its
        recompile limit (8), so one shared code object broke the ninth shape a process decoded
        (a batch size, a prompt length). A copy per shape compiles once and is never guarded
        against the others."""
        first = cache.layers[0]
        assert isinstance(first, StaticKVCache)  # generate compiles only a static cache's step
        key = (tuple(first.keys.shape), first.keys.dtype, first.keys.device, ids.device)
        steps = _COMPILED_STEPS.setdefault(self, {})
        if key not in steps:
            fn = CausalDecoder._step
            code = fn.__code__.replace()  # a new code object: its own Dynamo cache
            copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            steps[key] = torch.compile(types.MethodType(copy, self), fullgraph=True, dynamic=False)
        return steps[key]

    def loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy over the scored targets (``-100`` elsewhere)."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


#: Each model's compiled decode steps, by cache shape (CausalDecoder._compiled_step); weak, so a
#: model's graphs go with it, and not an attribute, so that copying or pickling a model does not
#: meet them.
_COMPILED_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator) -> Tensor:
    """The next token of each row from ``logits (B, V)``: greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).view(-1)


def _check_generate(prompt_ids, max_new_tokens, temperature, top_k, cache, prompt_lengths, compile, config) -> None:
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.is_floating_point():
        got = (
            f"dtype {prompt_ids.dtype}, shape {tuple(prompt_ids.shape)}"
            if isinstance(prompt_ids, Tensor)
            else type(prompt_ids).__name__
        )
        raise TypeError(f"generate: prompt_ids must be an integer tensor (B, P), got {got}")
    if prompt_ids.shape[1] == 0:
        raise ValueError(
            f"generate: prompt_ids must hold at least one token per row, got shape {tuple(prompt_ids.shape)}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prompt_ids.shape[1] + max_new_tokens > config.max_len:
        raise ValueError(
            f"generate: {prompt_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed the model's "
            f"max_len={config.max_len}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"generate: temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generate: top_k must be None or a positive int, got {top_k!r}")
    if cache not in ("static", "dynamic", "sliding"):
        raise ValueError(f"generate: cache must be 'static', 'dynamic' or 'sliding', got {cache!r}")
    if compile is not False and (compile is not True or cache != "static"):
        raise ValueError(
            f"generate: compile=True needs cache='static' (a compiled step keeps one shape; a {cache!r} "
            f"cache changes shape as it fills, a recompilation per step), got compile={compile!r}, cache={cache!r}"
        )
    if prompt_lengths is not None:
        if cache != "static":
            raise ValueError(
                f"generate: prompt_lengths (rows of different lengths) needs cache='static', got {cache!r}"
            )
        if (
            not isinstance(prompt_lengths, Tensor)
            or prompt_lengths.shape != (prompt_ids.shape[0],)
            or prompt_lengths.is_floating_point()
        ):
            raise ValueError(
                f"generate: prompt_lengths must be an integer tensor ({prompt_ids.shape[0]},), got {prompt_lengths!r}"
            )
        if int(prompt_lengths.min()) < 1 or int(prompt_lengths.max()) > prompt_ids.shape[1]:
            raise ValueError(
                f"generate: prompt_lengths must be in [1, {prompt_ids.shape[1]}], got {prompt_lengths.tolist()}"
            )
