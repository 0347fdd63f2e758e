"""``cascade_attention``: many requests that share one prompt, attended without copying the prompt.

A batch of ``B`` requests continues one shared prefix of ``P`` tokens, each with its own suffix of
``Ls`` tokens. Attending each request to the concatenation ``prefix + suffix`` reads (and, in a
cache, stores) the prefix ``B`` times. The keys split in two disjoint parts, so the attention
splits too (FlashInfer's cascade attention)::

    keys of the whole attention:   0 ........ P-1 | P ........ P+Ls-1       (Lk = P + Ls)
                                   shared prefix  | each request's suffix

    prefix:  every request's queries, folded into the rows of ONE batch  (1, Hq, B·Lq, D)
             against the one copy of the prefix                          (1, Hkv, P, D)
    suffix:  each request's queries against its own suffix              (B, Hkv, Ls, D)
    join:    merge_partials(prefix part, suffix part) by log-sum-exp

The mask is the whole attention's, ``Lq x (P + Ls)``, read on each part's columns at their
absolute positions (``mask.shifted(0, k0, q_len=Lq, kv_len=P + Ls)``, docs/conventions.md), so the
result equals :func:`multihead.attention` over the concatenation with the same mask, whatever
``Lq``. The fold needs every query to see every prefix key in every request (the mask's prefix
block is full, e.g. ``causal()`` with ``Lq <= Ls + 1``) and no float mask; otherwise the prefix part
runs per request, against a batch-``B`` view of the one copy (read ``B`` times, never copied).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from multihead.attention import attention
from multihead.blocks import Block, Extent
from multihead.call import AttentionResult, mask_and_score_mod
from multihead.masks import BlockState, Mask
from multihead.merge import merge_partials
from multihead.scores import ScoreMod, bias

__all__ = ["cascade_attention"]

# The two inner attention calls, as an error names them.
_PARTS = {
    "prefix": "every request's queries against the shared prefix_k/prefix_v",
    "suffix": "each request's queries against its own k/v",
}


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

    Equal to ``attention(q, cat([prefix_k.expand(B, ...), k], 2), cat([prefix_v.expand(B, ...), v], 2),
    mask=mask)``: the keys of the whole attention are the prefix's ``P`` then the suffix's ``Ls``.

    Args:
        q: ``(B, Hq, Lq, D)``, each request's queries.
        prefix_k: ``(1, Hkv, P, D)`` (or ``(Hkv, P, D)``), the shared prefix's keys, one copy.
        prefix_v: ``(1, Hkv, P, Dv)`` (or ``(Hkv, P, Dv)``).
        k, v: ``(B, Hkv, Ls, D)`` and ``(B, Hkv, Ls, Dv)``, each request's own suffix.
        mask: the mask of the whole attention, ``Lq`` queries x ``Lk = P + Ls`` keys (prefix
            first), exactly as :func:`multihead.attention` reads it over the concatenation: a
            mask object, or a bool or float tensor broadcastable to ``(B, Hq, Lq, P + Ls)``.
            ``causal()`` (bottom-right) puts the queries at the last ``Lq`` positions of
            ``prefix + suffix``: with ``Lq <= Ls + 1`` every query sees the whole prefix; with more,
            the first ``Lq - Ls`` queries sit at prefix positions and see the prefix keys up to
            their own only (and with ``Lq > P + Ls`` the first ``Lq - P - Ls`` see no key: output
            0). ``causal("top_left")`` puts query ``i`` at position ``i``; ``key_padding(n)``
            counts prefix keys too (``n = P +`` the suffix's length).
        scale, backend: as in :func:`multihead.attention`, for both parts.
        return_lse: also return the log-sum-exp over prefix and suffix.

    Returns:
        ``(B, Hq, Lq, Dv)``, or an :class:`~multihead.call.AttentionResult` ``(output, None, lse)``.

    Raises:
        ValueError, TypeError: bad shapes or a mask that does not fit ``(B, Hq, Lq, P + Ls)``,
            before any work; an error of either inner attention call says which part (``prefix``
            or ``suffix``) raised it, followed by its own message.
    """
    prefix_k, prefix_v = (_one_copy(name, t) for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)))
    _check(q, prefix_k, prefix_v, k, v)
    B, Hq, Lq, D = q.shape
    P, Ls = prefix_k.shape[2], k.shape[2]
    Lk = P + Ls
    whole, additive = _whole_mask(mask, q, B, Hq, Lq, Lk)

    # Prefix part: keys [0, P) of the whole attention.
    if additive is None and (
        whole is None or whole.block_state(Extent(B, Hq, Lq, Lk), Block(0, Lq, 0, P)) is BlockState.FULL
    ):
        # Every query of every request sees every prefix key: one attention, the requests as rows.
        rows = q.transpose(0, 1).reshape(1, Hq, B * Lq, D)  # (1, Hq, B·Lq, D)
        shared = _part(
            "prefix", lambda: attention(rows, prefix_k, prefix_v, scale=scale, return_lse=True, backend=backend)
        )
        assert shared.lse is not None  # asked for: return_lse=True
        Dv = prefix_v.shape[-1]
        shared_out = shared.output.view(Hq, B, Lq, Dv).transpose(0, 1)  # (B, Hq, Lq, Dv), a view
        shared_lse = shared.lse.view(Hq, B, Lq).transpose(0, 1)  # (B, Hq, Lq)
    else:
        # The mask tells requests or queries apart on the prefix: per request, against a view.
        pk = prefix_k.expand(B, -1, -1, -1)  # (B, Hkv, P, D), stride 0 over B: no copy
        pv = prefix_v.expand(B, -1, -1, -1)  # (B, Hkv, P, Dv)
        part_mask, part_mod = _columns(whole, additive, 0, P, Lq, Lk)
        shared = _part(
            "prefix",
            lambda: attention(
                q, pk, pv, mask=part_mask, score_mod=part_mod, scale=scale, return_lse=True, backend=backend
            ),
        )
        assert shared.lse is not None  # asked for: return_lse=True
        shared_out, shared_lse = shared.output, shared.lse  # (B, Hq, Lq, Dv), (B, Hq, Lq)

    # Suffix part: keys [P, P + Ls) of the whole attention.
    own_mask, own_mod = _columns(whole, additive, P, Lk, Lq, Lk)
    own = _part(
        "suffix",
        lambda: attention(q, k, v, mask=own_mask, score_mod=own_mod, scale=scale, return_lse=True, backend=backend),
    )
    assert own.lse is not None  # asked for: return_lse=True
    output, lse = merge_partials([shared_out, own.output], [shared_lse, own.lse])
    return AttentionResult(output, None, lse) if return_lse else output


def _part(name: str, run: Callable[[], AttentionResult]) -> AttentionResult:
    """``run()``; an error in it re-raised as the same type, its message after the name of the part."""
    try:
        return run()
    except Exception as exc:
        message = f"cascade_attention: the {name} part ({_PARTS[name]}) failed: {exc}"
        try:
            renamed: Exception | None = type(exc)(message)
        except Exception:  # an exception type that takes other arguments
            renamed = None
        if renamed is None:  # keep it as it is, with a note
            exc.add_note(message)  # type: ignore[attr-defined]  # Python 3.11+ (requires-python); mypy targets 3.10
            raise
        raise renamed from exc


def _whole_mask(mask: object, q: Tensor, B: int, Hq: int, Lq: int, Lk: int) -> tuple[Mask | None, Tensor | None]:
    """``mask`` as the boolean mask of the whole attention and, for a float tensor (an additive
    mask, read as :func:`multihead.attention` reads it), its bias ``(B|1, Hq|1, Lq|1, Lk|1)``;
    checked against the whole attention ``(B, Hq, Lq, P + Ls)``."""
    if isinstance(mask, Tensor) and mask.is_floating_point():
        mask = mask.to(q.device)  # as attention() does, before it becomes a bias
    try:
        whole, additive = mask_and_score_mod(mask, None, q_len=Lq, kv_len=Lk)
        if whole is not None:
            whole.check(Extent(B, Hq, Lq, Lk))
        if additive is not None:
            additive.check(Extent(B, Hq, Lq, Lk))
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"cascade_attention: {exc}; the mask is the whole attention's, Lq={Lq} queries x "
            f"Lk = P + Ls = {Lk} keys (the prefix's first)"
        ) from None
    # A float mask with no score_mod of its own becomes exactly one Bias: its tensor.
    return whole, None if additive is None else additive.tensors()[0]


def _columns(
    whole: Mask | None, additive: Tensor | None, k0: int, k1: int, Lq: int, Lk: int
) -> tuple[Mask | None, ScoreMod | None]:
    """The whole attention's mask and bias on keys ``[k0, k1)``, at their absolute positions."""
    part_mask = None if whole is None else whole.shifted(0, k0, q_len=Lq, kv_len=Lk)
    if additive is None:
        return part_mask, None
    cols = additive[..., k0:k1] if additive.shape[-1] > 1 else additive  # (B|1, Hq|1, Lq|1, k1-k0|1)
    return part_mask, bias(cols, name="mask")


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
