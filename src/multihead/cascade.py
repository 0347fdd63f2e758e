"""``cascade_attention``: many requests that share one prompt, attended without copying the prompt.

A batch of ``B`` requests continues one shared prefix of ``P`` tokens, each with its own suffix of
``Ls`` tokens. Attending each request to the concatenation ``prefix + suffix`` reads (and, in a
cache, stores) the prefix ``B`` times. The keys split in two disjoint parts, so the attention
splits too (FlashInfer's cascade attention)::

    prefix:  every request's queries, folded into the rows of ONE batch  (1, Hq, B·Lq, D)
             against the one copy of the prefix                          (1, Hkv, P, D)
    suffix:  each request's queries against its own suffix              (B, Hkv, Ls, D)
    join:    merge_partials(prefix part, suffix part) by log-sum-exp

The result equals attention over the concatenation, with the suffix's mask (causal, padding, ...)
and every prefix key visible to every query (the prefix comes before every suffix token).
"""

from __future__ import annotations

from torch import Tensor

from multihead.attention import attention
from multihead.call import AttentionResult
from multihead.masks import Mask
from multihead.merge import merge_partials

__all__ = ["cascade_attention"]


def cascade_attention(
    q: Tensor,
    prefix_k: Tensor,
    prefix_v: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | AttentionResult:
    """Attention of ``B`` requests over one shared prefix and their own suffixes.

    Args:
        q: ``(B, Hq, Lq, D)``, each request's queries (its suffix's last ``Lq`` tokens).
        prefix_k: ``(1, Hkv, P, D)`` (or ``(Hkv, P, D)``), the shared prefix's keys, one copy.
        prefix_v: ``(1, Hkv, P, Dv)`` (or ``(Hkv, P, Dv)``).
        k, v: ``(B, Hkv, Ls, D)`` and ``(B, Hkv, Ls, Dv)``, each request's own suffix.
        mask: over the suffix, ``(B, Hq, Lq, Ls)`` as in :func:`multihead.attention` (``causal()``
            for a decoder: bottom-right, so the queries sit at the end of their suffix). Every
            query sees the whole prefix.
        scale, backend: as in :func:`multihead.attention`, for both parts.
        return_lse: also return the log-sum-exp over prefix and suffix.

    Returns:
        ``(B, Hq, Lq, Dv)``, or an :class:`~multihead.call.AttentionResult` ``(output, None, lse)``.
    """
    prefix_k, prefix_v = (_one_copy(name, t) for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)))
    _check(q, prefix_k, prefix_v, k, v)
    B, Hq, Lq, D = q.shape
    rows = q.transpose(0, 1).reshape(1, Hq, B * Lq, D)  # (1, Hq, B·Lq, D): every request's queries as rows
    shared = attention(rows, prefix_k, prefix_v, scale=scale, return_lse=True, backend=backend)
    assert shared.lse is not None  # asked for: return_lse=True
    Dv = prefix_v.shape[-1]
    shared_out = shared.output.view(Hq, B, Lq, Dv).transpose(0, 1)  # (B, Hq, Lq, Dv), a view
    shared_lse = shared.lse.view(Hq, B, Lq).transpose(0, 1)  # (B, Hq, Lq)
    own = attention(q, k, v, mask=mask, scale=scale, return_lse=True, backend=backend)
    assert own.lse is not None  # asked for: return_lse=True
    output, lse = merge_partials([shared_out, own.output], [shared_lse, own.lse])
    return AttentionResult(output, None, lse) if return_lse else output


def _one_copy(name: str, t: Tensor) -> Tensor:
    if isinstance(t, Tensor) and t.dim() == 3:
        return t.unsqueeze(0)
    return t


def _check(q: Tensor, prefix_k: Tensor, prefix_v: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t, layout in (
        ("q", q, "(B, Hq, Lq, D)"),
        ("prefix_k", prefix_k, "(1, Hkv, P, D)"),
        ("prefix_v", prefix_v, "(1, Hkv, P, Dv)"),
        ("k", k, "(B, Hkv, Ls, D)"),
        ("v", v, "(B, Hkv, Ls, Dv)"),
    ):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"cascade_attention: {name} must be a 4-D tensor {layout}, got {got}")
    if prefix_k.shape[0] != 1 or prefix_v.shape[0] != 1:
        raise ValueError(
            f"cascade_attention: the prefix is shared, one copy: prefix_k/prefix_v must have batch 1, "
            f"got {tuple(prefix_k.shape)} and {tuple(prefix_v.shape)}; hint: pass prefix_k[:1]"
        )
    if prefix_k.shape[1] != k.shape[1] or prefix_k.shape[3] != k.shape[3] or prefix_v.shape[3] != v.shape[3]:
        raise ValueError(
            f"cascade_attention: prefix and suffix must agree on Hkv, D and Dv, got prefix_k "
            f"{tuple(prefix_k.shape)}, prefix_v {tuple(prefix_v.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
