"""Attention for a serving step over a :class:`~multihead.caches.PrefixCache`: a decode batch
that shares a prompt (:func:`prefix_attention`, cascade), and a ragged batch of requests with
their own query lengths in one call (:func:`ragged_attention`).

A serving step holds some requests in a prefill chunk and others decoding one token (chunked
prefill, continuous batching). :func:`ragged_attention` packs every request's new queries one
after another, with no padding, and every request's keys likewise, and makes one attention call
whose mask keeps each request to its own keys, bottom-right causal per request::

    query_lengths [3, 1]; requests of 5 and 4 tokens       keys:  r0 r0 r0 r0 r0 | r1 r1 r1 r1
                                         r0's q at 2        1  1  1  .  .  |  .  .  .  .
                                         r0's q at 3        1  1  1  1  .  |  .  .  .  .
                                         r0's q at 4        1  1  1  1  1  |  .  .  .  .
                                         r1's q at 3        .  .  .  .  .  |  1  1  1  1

The mask is ``document(request ids) & causal()`` read at each token's position in its own request
(:meth:`~multihead.masks.Mask.at`), and a call's own ``mask`` object is read there too, so it
means for each request what it means for that request alone. Each request may bring its own mask
(a sequence of masks: a draft tree for a request verifying speculative tokens, a window for
another); the call's mask is then ``|`` of one part per request, each ``document`` to its keys and
its mask read on its own sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from multihead.attention import attention
from multihead.caches.prefix import PrefixCache
from multihead.cascade import cascade_attention
from multihead.masks import Mask, Or, causal, document

__all__ = ["ragged_attention", "prefix_attention"]


def ragged_attention(
    cache: PrefixCache,
    q: Tensor,
    rids: Sequence[int],
    query_lengths: Sequence[int],
    *,
    mask: Mask | Sequence[Mask | None] | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """One attention call for requests with their own query lengths.

    Args:
        cache: holds every request's keys and values, the new tokens' included (append first).
        q: ``(1, Hq, T, D)``: the new queries of ``rids[0]``, then of ``rids[1]``, ... packed
            (``T = sum(query_lengths)``); request ``r``'s ``n`` queries are its last ``n`` tokens.
        query_lengths: ``n`` per request, ``>= 0``.
        mask: a mask object read at each request's own positions (as for a request alone), one
            per request (a sequence, ``None`` for none: a request verifying a draft tree beside
            others prefilling), or ``None``; causal always applies. A mask whose meaning depends
            on the lengths (bottom-right: ``tree(parents)``) is read on each request's own
            ``L_r x L_r``, so a tree is that request's last ``T`` tokens.
        scale, backend: as in :func:`multihead.attention`.

    Returns:
        ``(1, Hq, T, Dv)``, packed like ``q``; equal to each request attended alone.
    """
    where = "ragged_attention"
    lengths = _check_lengths(where, cache, q, rids, query_lengths)
    device = q.device
    reads = [cache.read(r) for r in rids]  # (1, Hkv, L_r, ·) each
    keys = torch.cat([k for k, _ in reads], dim=2)  # (1, Hkv, K, D): every request's keys, packed
    values = torch.cat([v for _, v in reads], dim=2)
    q_ids = torch.repeat_interleave(torch.arange(len(rids)), torch.tensor(list(query_lengths)))
    kv_ids = torch.repeat_interleave(torch.arange(len(rids)), torch.tensor(lengths))
    q_pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lengths, query_lengths)])  # own positions
    kv_pos = torch.cat([torch.arange(L) for L in lengths])
    masks = _per_request(where, mask, len(rids))
    if masks is None:  # one mask read alike in every request: one read at positions
        whole = max(lengths, default=1)  # positions of every request lie in [0, whole)
        at_positions = causal() if mask is None else cast(Mask, mask) & causal()
        placed = at_positions.at(q_pos.to(device), kv_pos.to(device), q_len=whole, kv_len=whole)
        call_mask = document(q_ids.to(device), kv_ids.to(device)) & placed
        return attention(q, keys, values, mask=call_mask, scale=scale, backend=backend)
    # A mask per request: request r's rows see r's keys through its own mask, read on its own
    # L_r x L_r (other rows' positions clamped into it: its document part hides them anyway).
    parts = []
    for r, (own, L) in enumerate(zip(masks, lengths, strict=True)):
        rows = torch.where(q_ids == r, r, len(rids))  # an id no key has: rows of other requests see nothing
        at_positions = causal() if own is None else own & causal()
        whole = max([L, *(e for e in own.extent() if e is not None)] if own is not None else [L])
        placed = at_positions.at(
            q_pos.clamp(max=whole - 1).to(device), kv_pos.clamp(max=whole - 1).to(device), q_len=whole, kv_len=whole
        )
        parts.append(document(rows.to(device), kv_ids.to(device)) & placed)
    call_mask = parts[0] if len(parts) == 1 else Or(*parts)
    return attention(q, keys, values, mask=call_mask, scale=scale, backend=backend)


def _per_request(where: str, mask: object, requests: int) -> list[Mask | None] | None:
    """``mask`` as one mask (or ``None``) per request, or ``None`` when a single mask reads alike
    in every request (it does not depend on the lengths): then one read at positions serves all."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        return [mask] * requests if mask.depends_on_lengths() else None
    if isinstance(mask, Sequence) and not isinstance(mask, (str, bytes)):
        masks = list(mask)
        if len(masks) != requests or not all(m is None or isinstance(m, Mask) for m in masks):
            got = [type(m).__name__ for m in masks]
            raise TypeError(
                f"{where}: mask must be a mask object, or one per request ({requests}: mask objects or None), got {got}"
            )
        return masks
    raise TypeError(f"{where}: mask must be a mask object, a sequence of one per request, or None, got {mask!r}")


def prefix_attention(
    cache: PrefixCache, q: Tensor, rids: Sequence[int], *, scale: float | None = None, backend: str = "auto"
) -> Tensor:
    """Attention of a batch of requests with one query length each, ``q (B, Hq, Lq, D)``, over
    their keys (the new ``Lq`` tokens appended already), bottom-right causal per request. The
    pages every request begins with (:meth:`PrefixCache.shared_prefix`) are read once, for the
    whole batch (:func:`multihead.cascade_attention`); each request's own tokens after them are
    attended per request, right-padded to the longest. Returns ``(B, Hq, Lq, Dv)``."""
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != len(rids):
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"prefix_attention: q must be (B, Hq, Lq, D) with B = len(rids) = {len(rids)}, got {got}")
    lengths = [cache.length(r) for r in rids]
    if min(lengths, default=0) < q.shape[2]:
        raise ValueError(
            f"prefix_attention: every request must hold its Lq={q.shape[2]} new tokens (append them first); "
            f"the requests hold {lengths}"
        )
    P = cache.shared_prefix(rids) if len(rids) > 1 else 0  # whole pages
    whole = causal(kv_lengths=torch.tensor(lengths, device=q.device))  # per request, over prefix + suffix
    if P == 0:
        keys, values = _padded(cache, rids, 0)
        return attention(q, keys, values, mask=whole, scale=scale, backend=backend)
    prefix_k, prefix_v = cache.read(rids[0])  # the shared pages, gathered once for the batch
    keys, values = _padded(cache, rids, P)
    return cascade_attention(
        q, prefix_k[:, :, :P], prefix_v[:, :, :P], keys, values, mask=whole, scale=scale, backend=backend
    )  # type: ignore[return-value]  # return_lse=False: a tensor


def _padded(cache: PrefixCache, rids: Sequence[int], start: int) -> tuple[Tensor, Tensor]:
    """Each request's keys and values from page ``start // page_size`` on, right-padded to the
    longest: ``(B, Hkv, Ls, ·)``, one gather per tensor (``start`` is a multiple of the page size;
    the mask hides the padding, which reads page 0)."""
    ps = cache.page_size
    tables = [cache.table(r)[start // ps :] for r in rids]
    width = max(1, max(len(t) for t in tables))
    device = cache.pool.key_pages.device
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
    out = []
    for pages in (cache.pool.key_pages, cache.pool.value_pages):
        got = pages[:, table]  # (Hkv, B, width, ps, ·): the pool is head-major
        out.append(got.transpose(0, 1).reshape(len(rids), got.shape[0], width * ps, got.shape[-1]))
    return out[0], out[1]


def _check_lengths(
    where: str, cache: PrefixCache, q: Tensor, rids: Sequence[int], query_lengths: Sequence[int]
) -> list[int]:
    """Every request's length; refuses shapes and query lengths that do not fit."""
    if len(rids) != len(query_lengths) or not rids:
        raise ValueError(
            f"{where}: rids and query_lengths must be non-empty and of one length, got {list(rids)} and "
            f"{list(query_lengths)}"
        )
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in query_lengths):
        raise ValueError(f"{where}: query_lengths must be ints >= 0, got {list(query_lengths)}")
    T = sum(query_lengths)
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != T:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(
            f"{where}: q must be (1, Hq, T, D) with T = sum(query_lengths) = {T} (packed, no padding), got {got}"
        )
    lengths = [cache.length(r) for r in rids]
    short = [(r, L, n) for r, L, n in zip(rids, lengths, query_lengths) if n > L]
    if short:
        r, L, n = short[0]
        raise ValueError(
            f"{where}: request {r} has {n} queries but holds {L} tokens; its queries are its last tokens, "
            f"so append them to the cache first"
        )
    return lengths
