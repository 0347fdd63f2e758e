"""The heads of a layer: split a projection into heads, attend, merge them back, project out.

A projection ``(B, L, H·D)`` (or ``(L, B, H·D)``) holds head ``h`` at features
``[h·D, (h+1)·D)``. The core wants ``(B, H, L, D)``; both directions are views (no copy), and
SDPA's CPU and CUDA kernels take the resulting strides as they are::

    batch_first=True   (B, L, H·D) -view-> (B, L, H, D) -transpose(1, 2)-> (B, H, L, D)
    batch_first=False  (L, B, H·D) -view-> (L, B, H, D) -permute(1,2,0,3)-> (B, H, L, D)

The fused kernels write their output ``(B, H, L, D)`` with ``(B, L, H, D)`` strides, so
:func:`merge_heads` is free for them as well.

:func:`attend_heads` is the one place where a layer turns its heads into its output:
``attention() -> merge -> out_proj``, with the weights computed only when asked for or captured
(:mod:`multihead.capture`), and the layer's hook points (:mod:`multihead.hooks`). Every layer and
model calls it between its own projections (and rotary embedding, cache, appended keys) and its
output; none re-writes it.

:class:`Attend` is the seam a layer attends through (``MultiHeadAttention(attend=...)``): the
default runs :func:`attend_heads` on this process; another way of attending (context
parallelism: :class:`multihead.distributed.ContextParallelAttend`) is a subclass that declares
what it cannot do in its own checks, so the layer has no branch for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from multihead.attention import attention
from multihead.backends.decode import AUTO_MAX_QUERIES, MAX_QUERIES
from multihead.backends.decode_blocks import KVBlocks, decode_blocks
from multihead.call import ScoreModArg, Selection
from multihead.capture import captures_of, is_capturing
from multihead.explain import Explanation, explain
from multihead.hooks import ATTRIBUTE as HOOKS
from multihead.hooks import observed_attention
from multihead.layers.projection import project
from multihead.masks import Mask

if TYPE_CHECKING:
    from multihead.caches import CacheRead

__all__ = [
    "split_heads",
    "merge_heads",
    "attend_heads",
    "attend_blocks",
    "blocks_take",
    "blocks_explanation",
    "Attend",
    "Heads",
]

#: How a layer's heads become its output, per call: ``(core, out_proj)``, the attention function
#: (:func:`multihead.attention`'s signature; ``None`` for that function itself) and the map of the
#: merged heads ``(B, Lq, Hq·Dv)`` to the output ``(B, Lq, E)``. :func:`attend_heads` runs
#: ``out_proj(merge(core(q, k, v, ...)))``.
Heads = tuple["Callable[..., Any] | None", Callable[[Tensor], Tensor]]


def split_heads(x: Tensor, heads: int, head_dim: int, batch_first: bool) -> Tensor:
    """``(B, L, H·D)`` or ``(L, B, H·D)`` -> ``(B, H, L, D)``, a view."""
    if batch_first:
        B, L, _ = x.shape
        return x.view(B, L, heads, head_dim).transpose(1, 2)  # (B, H, L, D)
    L, B, _ = x.shape
    return x.view(L, B, heads, head_dim).permute(1, 2, 0, 3)  # (B, H, L, D)


def merge_heads(y: Tensor) -> Tensor:
    """``(B, H, L, D)`` -> ``(B, L, H·D)``; a view when ``y`` has ``(B, L, H, D)`` strides."""
    B, H, L, D = y.shape
    return y.transpose(1, 2).reshape(B, L, H * D)  # (B, L, H·D)


def attend_heads(
    layer: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    out_proj: Callable[[Tensor], Tensor],
    mask: Mask | Tensor | None = None,
    score_mod: ScoreModArg = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
    weights_heads: Selection = None,
    weights_rows: Selection = None,
    core: Callable[..., Any] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``attention() -> merge_heads -> out_proj`` for ``layer``, with its weights on demand and its
    hook points (:mod:`multihead.hooks`).

    Args:
        layer: the module whose weights :func:`multihead.capture_attention` records under its name,
            and whose hooks run.
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``, already projected,
            rotated and taken from a cache as the layer needs.
        out_proj: ``(B, Lq, Hq·Dv) -> (B, Lq, E)``.
        mask, score_mod, sinks, dropout_p, backend: passed to :func:`multihead.attention` as they are (the caller
            decides whether it is training, and has checked the mask against ``(B, Hq, Lq, Lk)``).
        need_weights: also return the probabilities ``(B, Hq, Lq, Lk)`` (before dropout).
        weights_heads, weights_rows: with ``need_weights``, only these query heads and rows, as
            for :func:`multihead.attention`: ``(B, len(heads), len(rows), Lk)``.
        core: the attention function, :func:`multihead.attention` (``None``) or a variant's with
            its signature and results (:class:`~multihead.layers.DifferentialAttention`'s two maps); the
            ``scores``/``pattern`` hooks need the plain one (they are of one softmax).

    Returns:
        ``(out, weights)``: ``out (B, Lq, E)`` batch first whatever the layer's layout (the caller
        transposes), ``weights`` ``None`` unless ``need_weights``. Weights are computed when
        ``need_weights`` or while a capture wants ``layer``, and then only once, for the heads and
        rows that the call and the captures select together.
    """
    hooks = layer.__dict__.get(HOOKS)  # None unless a hook is set: the one test the fast path pays
    plain = core is None
    if core is None:
        core = attention
    captures = captures_of(layer) if is_capturing(layer) else ()
    if hooks is None and not captures and not need_weights:
        y = core(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            sinks=sinks,
            dropout_p=dropout_p,
            return_weights=False,
            backend=backend,
        )  # (B, Hq, Lq, Dv): the call made before hooks existed
        return project(out_proj, merge_heads(y)), None
    y, weights = observed_attention(
        layer,
        q,
        k,
        v,
        hooks=hooks,
        captures=captures,
        need_weights=need_weights,
        weights_heads=weights_heads,
        weights_rows=weights_rows,
        mask=mask,
        score_mod=score_mod,
        sinks=sinks,
        dropout_p=dropout_p,
        backend=backend,
        core=None if plain else core,
    )  # (B, Hq, Lq, Dv), the call's own selection of the weights or None
    return project(out_proj, merge_heads(y)), weights


def blocks_take(
    layer: nn.Module,
    q: Tensor,
    blocks: KVBlocks,
    score_mod: ScoreModArg,
    sinks: Tensor | None,
    dropout_p: float,
    need_weights: bool,
    backend: str,
) -> bool:
    """Whether :func:`attend_blocks` reads a cache's blocks for this call (see there); ``explain()``
    asks the same question."""
    Lq = q.shape[2]
    return not (
        need_weights
        or score_mod is not None
        or sinks is not None
        or dropout_p
        or backend not in ("auto", "decode")
        or Lq > (AUTO_MAX_QUERIES if backend == "auto" else MAX_QUERIES)
        or q.dtype != blocks.dtype
        or (torch.is_grad_enabled() and q.requires_grad)
        or torch.compiler.is_compiling()
        or layer.__dict__.get(HOOKS) is not None
        or is_capturing(layer)
    )


def attend_blocks(
    layer: nn.Module,
    q: Tensor,
    blocks: KVBlocks,
    *,
    out_proj: Callable[[Tensor], Tensor],
    mask: Mask | Tensor | None,
    score_mod: ScoreModArg,
    sinks: Tensor | None,
    dropout_p: float,
    need_weights: bool,
    backend: str,
) -> Tensor | None:
    """``out (B, Lq, E)`` of a decode step over a cache read's :class:`KVBlocks` (pages read through
    their block table, quantized slots dequantized a piece at a time), or ``None`` when the call
    needs more than the decode path gives, and the caller runs :func:`attend_heads` over the read's
    dense keys and values instead: weights, hooks or captures, a score modifier, sinks, dropout,
    autograd, ``torch.compile``, another backend than ``auto``/``decode``, or more query tokens than
    the decode path takes (``auto``: :data:`~multihead.backends.decode.AUTO_MAX_QUERIES`)."""
    if not blocks_take(layer, q, blocks, score_mod, sinks, dropout_p, need_weights, backend):
        return None
    y = decode_blocks(q, blocks, mask)  # (B, Hq, Lq, Dv)
    return project(out_proj, merge_heads(y))


def blocks_explanation(q: Tensor, read: CacheRead, mask: Mask | Tensor | None) -> Explanation:
    """What a decode step over a cache read's blocks runs (:func:`~multihead.layers.heads.attend_blocks`):
    the decode backend's report of the dense call those pieces amount to, with how they are read."""
    blocks = read.blocks
    assert blocks is not None
    keys, values = read.keys, read.values
    report = explain(q, keys, values, mask=mask, backend="decode")
    how = (
        "cache read as blocks, not as one tensor (a paged or quantized cache): decode_blocks attends over its "
        "pieces in place (pages through their block table; 8-bit slots with their scales, beside the cache's "
        "full-precision sinks and window: one call of the CPU decode kernel where it is built and takes them, "
        "else a piece at a time) and joins their partial results by log-sum-exp; the lines below describe the "
        "dense call they amount to"
    )
    kernel = blocks.describe(q.shape[1] // blocks.shape[1] * q.shape[2])  # rows per KV head: G·Lq
    return dataclasses.replace(report, plan=(how, *((kernel,) if kernel else ()), *report.plan))


class Attend:
    """How a layer attends once its heads are projected (and rotated, and read from a cache): the
    default attends on this process, through :func:`attend_heads`.

    A layer calls, in this order:

    * :meth:`check_layer` once, from its constructor, with the options that change attention;
    * :meth:`check_call` on every call that is not the plain one (see :attr:`sharded`);
    * :meth:`mask_lengths`: the ``(Lq, Lk)`` the call's mask is over;
    * :meth:`positions`: the default positions of the query tokens for ``rope`` (no cache, none
      given);
    * :meth:`attend_heads`, with :func:`attend_heads`'s arguments, for ``(out (B, Lq, E), weights)``.

    A subclass refuses what it cannot do in the two checks, with its own messages.
    """

    #: Whether the layer's tokens are a shard of a longer sequence (masks over the whole sequence,
    #: global positions). ``False``: a plain call (self-attention, at most a mask object) needs
    #: none of the methods but the call itself, and the layer skips them.
    sharded: bool = False

    def check_layer(self, layer: str, options: Mapping[str, object]) -> None:
        """Refuse, at construction, a layer option (``score_mod``, ``softcap``, ``sinks``,
        ``dropout``: their values, ``None``/``0.0`` when unset) this way of attending cannot run."""

    def check_call(
        self,
        layer: str,
        *,
        self_attention: bool,
        kv_cache: object,
        need_weights: bool,
        score_mod: object,
        dropout: float,
    ) -> None:
        """Refuse a call this way of attending cannot run, before any work (``dropout``: the
        probability this call would drop with, 0 outside training)."""

    def mask_lengths(self, Lq: int, Lk: int) -> tuple[int, int]:
        """The ``(Lq, Lk)`` a call's mask is over, for ``Lq`` queries and ``Lk`` keys given to the layer."""
        return Lq, Lk

    def positions(self, Lq: int, device: torch.device) -> Tensor:
        """``(Lq,)`` int64: the positions of the query tokens when neither the call nor a cache gives them."""
        return torch.arange(Lq, device=device)

    # The module's attend_heads itself (no frame between, which the plain call would pay for; a
    # staticmethod __call__ would save the name but torch.compile cannot trace it).
    attend_heads = staticmethod(attend_heads)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
