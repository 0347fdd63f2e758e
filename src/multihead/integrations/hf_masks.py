"""Hugging Face masks as `multihead` mask objects.

``transformers`` describes a mask by a function ``mask_function(b, h, q_idx, kv_idx) -> bool``
built from a few factories in ``transformers.masking_utils`` (``causal_mask_function``,
``sliding_window_overlay(w)``, ``and_masks(...)``, ...) plus a 2-D padding mask, and asks the
mask interface registered for the attention implementation to turn them into whatever its
attention function reads. :func:`from_mask_function` is that translation for `multihead`: each
factory's closure is recognised by its code object and becomes the mask object that means the
same, in the coordinates of the call:

==========================================  ==============================================
``transformers``                            ``multihead``
==========================================  ==============================================
``causal_mask_function``                    ``causal()``
``sliding_window_overlay(w)`` & causal      ``sliding_window(w - 1)``
``sliding_window_bidirectional_overlay(w)``  ``sliding_window(w, w)``
``bidirectional_mask_function``             nothing blocked
2-D ``attention_mask`` (padding)            ``key_padding(lengths)`` or ``key_padding(table)``
``packed_sequence_mask_function(ids)``      ``document(ids)`` (position ids restarting)
``chunked_overlay(c, left_padding)``        ``document(chunk of each position)``
``blockwise_overlay(ids)``                  ``document(ids)`` (negative ids see nothing)
``and_masks`` / ``or_masks``                ``&`` / ``|``
anything else (a model's own function)      its bool tensor, evaluated by ``transformers``
==========================================  ==============================================

Which closures are read as structure is decided by :mod:`multihead.integrations.hf_closures`,
which checks each kind against ``transformers``' own evaluation once per process: a closure that
a later ``transformers`` renamed or changed is read densely, with a warning, never wrongly.

Positions: ``transformers`` evaluates a mask at absolute positions ``q_idx = q_offset + i`` and
``kv_idx = kv_offset + j`` of the call's query ``i`` and key ``j`` (``q_offset`` = tokens already
in the cache). Its causal rule ``kv_idx <= q_idx`` is therefore ``j <= i + d`` with
``d = q_offset - kv_offset``: bottom-right ``causal()`` when ``d = Lk - Lq`` (a dynamic cache),
top-left when ``d = 0`` (an empty static cache), and a top-left band read ``shifted`` by ``d``
otherwise (a static cache part-filled).

:func:`from_dense` reads a dense 4-D mask a user passed instead (bool, or additive with
``finfo(dtype).min`` or ``-inf`` for blocked entries) and recognises band, padding and document
structure in it where it is there exactly (:func:`multihead.masks.recognize.from_dense`, the one
recogniser).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from multihead.integrations.hf_closures import Frame as _Frame
from multihead.integrations.hf_closures import MaskFunction, closure_variables, evaluate, kind_of, unread
from multihead.masks import Band, Mask, additive_blocked, as_mask, causal, document, key_padding, sliding_window
from multihead.masks.recognize import from_dense as recognize_dense

__all__ = ["band_blocks_nothing", "from_dense", "from_mask_function", "padding_mask", "read"]


class _Full:
    """A part that blocks nothing (``bidirectional_mask_function``)."""

    def __repr__(self) -> str:
        return "FULL"


FULL = _Full()


class _BandSpec(NamedTuple):
    """Query ``i`` sees keys ``i + d - left .. i + d + right`` (``d`` of the frame); ``None`` is
    unbounded. Kept apart until a whole ``and``/``or`` is read, so that causal & window is one band."""

    left: int | None
    right: int | None


_Part = _Full | _BandSpec | Mask  # what one closure reads as


def from_mask_function(
    mask_function: MaskFunction,
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
) -> Mask | None:
    """The `multihead` mask of HF's ``mask_function`` plus its 2-D padding ``attention_mask``
    ``(B, >= kv_offset + Lk)`` (``True`` = a real token), for a call of ``Lq = q_length`` queries
    and ``Lk = kv_length`` keys; ``None`` when nothing is blocked."""
    # A static cache passes its offset as a 0-d tensor (no graph break in HF's own code).
    frame = _Frame(int(batch_size), int(q_length), int(kv_length), int(q_offset), int(kv_offset), use_vmap, device)
    mask = read(mask_function, frame)
    pad = padding_mask(attention_mask, frame.kv_offset, frame.kv_len)
    if pad is None:
        return mask
    return pad if mask is None else mask & pad


def padding_mask(attention_mask: Tensor | None, kv_offset: int, kv_len: int) -> Mask | None:
    """``key_padding`` of the keys ``[kv_offset, kv_offset + Lk)`` of HF's 2-D mask ``(B, L)``
    (``True``/``1`` = a real token; a mask shorter than the keys blocks the keys past its end, as
    ``transformers.masking_utils.prepare_padding_mask`` does); ``None`` when no key is padding."""
    if attention_mask is None:
        return None
    table = attention_mask.bool()
    if table.shape[-1] < kv_offset + kv_len:
        table = torch.nn.functional.pad(table, (0, kv_offset + kv_len - table.shape[-1]))
    table = table[:, kv_offset : kv_offset + kv_len]
    if bool(table.all()):
        return None
    # Right padding (each row's real keys first) is a length per row: a cheaper structure for backends.
    lengths = table.sum(dim=-1)
    if torch.equal(table, torch.arange(kv_len, device=table.device) < lengths[:, None]):
        return key_padding(lengths)
    return key_padding(table)


# ------------------------------------------------------------------------- reading HF's closures
def read(fn: MaskFunction, frame: _Frame) -> Mask | None:
    """HF's ``mask_function`` alone (no padding) as the mask object of ``frame``; ``None`` when
    nothing is blocked. (What :mod:`multihead.integrations.hf_closures` probes each kind with.)"""
    return _finish(_read(fn, frame, packed=False), frame)


def _kind_of(fn: object) -> str | None:
    return kind_of(fn, read)


def _read(fn: MaskFunction, frame: _Frame, packed: bool) -> _Part:
    """``fn`` as FULL, a ``_BandSpec`` or a ``Mask``; a closure not recognised becomes the bool
    tensor ``transformers`` itself evaluates (the meaning is kept, the structure is not)."""
    kind = _kind_of(fn)
    if kind is None:
        unread(fn, "it is of no kind this version knows")
        return _dense(fn, frame)
    try:
        env = closure_variables(fn)
        if kind == "and":
            parts = env["mask_functions"]
            is_packed = any(_kind_of(p) == "packed" for p in parts)
            return _and([_read(p, frame, packed=is_packed) for p in parts], frame)
        if kind == "or":
            return _or([_read(p, frame, packed=False) for p in env["mask_functions"]], frame)
        if kind == "causal":
            return _BandSpec(None, 0)
        if kind == "full":
            return FULL
        if kind == "window":  # kv_idx > q_idx - w: the w - 1 keys before the aligned one, no right limit
            return _BandSpec(int(env["sliding_window"]) - 1, None)
        if kind == "window_both":  # |q_idx - kv_idx| <= w
            w = int(env["sliding_window"])
            return _BandSpec(w, w)
        if kind == "padding":
            pad = padding_mask(env["padding_mask"], frame.kv_offset, frame.kv_len)
            return FULL if pad is None else pad
        if kind == "packed":
            return _documents(env["packed_sequence_mask"], frame)
        if kind == "chunks":
            return _chunks(int(env["chunk_size"]), env["left_padding"], frame)
        if kind == "blocks":
            return _blocks(env["block_sequence_ids"], frame)
        if kind == "remap" and packed:
            # Inside one packed document its position ids step by 1 (that is how HF finds the
            # documents), so a band of position ids is the band of indices: and-ed with the
            # document mask (``packed``) the remapping changes nothing. Anything else is read densely.
            inner = _read(env["mask_function"], frame, packed=False)
            if inner is FULL or isinstance(inner, _BandSpec):
                return inner
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError):
        # a closure of another shape than the one this version of the factory builds
        unread(fn, f"its {kind!r} closure holds other variables than the one this version reads")
    return _dense(fn, frame)


def _and(parts: list[_Part], frame: _Frame) -> _Part:
    bands = [p for p in parts if isinstance(p, _BandSpec)]
    masks = [p for p in parts if isinstance(p, Mask)]
    if bands:  # the intersection of bands that contain their aligned key is a band
        left = [b.left for b in bands if b.left is not None]
        right = [b.right for b in bands if b.right is not None]
        band = _BandSpec(min(left) if left else None, min(right) if right else None)
        if not masks:
            return band
        if not _blocks_nothing(band, frame):
            masks.insert(0, _band(band, frame))
    return _combine(masks, "&") if masks else FULL


def _or(parts: list[_Part], frame: _Frame) -> _Part:
    if any(isinstance(p, _Full) for p in parts):
        return FULL
    bands = [p for p in parts if isinstance(p, _BandSpec)]
    masks = [p for p in parts if isinstance(p, Mask)]
    if bands:  # every band holds its aligned key, so their union is the widest band
        lefts, rights = [b.left for b in bands], [b.right for b in bands]
        band = _BandSpec(
            None if None in lefts else max(x for x in lefts if x is not None),
            None if None in rights else max(x for x in rights if x is not None),
        )
        if (band.left is None and band.right is None) or _blocks_nothing(band, frame):
            return FULL
        if not masks:
            return band
        masks.insert(0, _band(band, frame))
    return _combine(masks, "|")


def _combine(masks: list[Mask], op: str) -> Mask:
    out = masks[0]
    for m in masks[1:]:
        out = out & m if op == "&" else out | m
    return out


def _finish(part: _Part, frame: _Frame) -> Mask | None:
    if isinstance(part, _Full) or (isinstance(part, _BandSpec) and _blocks_nothing(part, frame)):
        return None
    return _band(part, frame) if isinstance(part, _BandSpec) else part


def _blocks_nothing(spec: _BandSpec, frame: _Frame) -> bool:
    return band_blocks_nothing(spec.left, spec.right, frame.q_len, frame.kv_len, frame.q_offset, frame.kv_offset)


def band_blocks_nothing(
    left: int | None, right: int | None, q_len: int, kv_len: int, q_offset: int, kv_offset: int
) -> bool:
    """Whether every query of the call sees every key through the band of ``left`` keys before
    and ``right`` after the aligned one (``None``: no limit), as a decoding step's causal row
    (``left=None, right=0``) does: then no mask at all (what ``transformers``' ``sdpa`` skips too)."""
    first_q, last_q = q_offset, q_offset + q_len - 1
    first_k, last_k = kv_offset, kv_offset + kv_len - 1
    return (right is None or last_k <= first_q + right) and (left is None or first_k >= last_q - left)


def _band(spec: _BandSpec, frame: _Frame) -> Mask:
    """The band ``spec`` (not unbounded on both sides) at HF's positions: key ``j`` lines up with
    query ``i`` when ``j + kv_offset == i + q_offset``."""
    d = frame.q_offset - frame.kv_offset
    align = "bottom_right" if d == frame.kv_len - frame.q_len else "top_left"
    return _band_mask(spec.left, spec.right, align, 0 if align == "bottom_right" else d)


@functools.lru_cache(maxsize=64)
def _band_mask(left: int | None, right: int | None, align: str, d: int) -> Mask:
    """The band object of :func:`_band`: one per value (masks are immutable), made once, because
    ``transformers`` asks for the mask on every forward, a decode step included, and making a
    band costs a few microseconds. ``d`` is only read for top-left alignment (a static cache)."""
    band: Mask
    if right == 0 and left is None:
        band = causal(align)
    elif left is not None:
        band = sliding_window(left, right, align)
    else:
        band = Band(None, right, align)
    if align == "bottom_right" or d == 0:
        return band
    # A static cache part-filled: top-left read at the call's positions of the whole attention.
    return band.shifted(max(d, 0), max(-d, 0))


def _slice_ids(ids: Tensor, frame: _Frame) -> tuple[Tensor, Tensor]:
    ids = ids.expand(frame.batch, -1) if ids.shape[0] == 1 else ids
    q_ids = ids[:, frame.q_offset : frame.q_offset + frame.q_len]
    kv_ids = ids[:, frame.kv_offset : frame.kv_offset + frame.kv_len]
    if q_ids.shape[-1] != frame.q_len or kv_ids.shape[-1] != frame.kv_len:
        raise ValueError("ids shorter than the call")
    return q_ids, kv_ids


def _documents(ids: Tensor, frame: _Frame) -> Mask:
    return document(*_slice_ids(ids, frame))


def _blocks(ids: Tensor, frame: _Frame) -> Mask:
    # (q_group == kv_group) & (q_group >= 0): every negative id becomes -1 on the query side and -2
    # on the key side, so it matches nothing.
    q_ids, kv_ids = _slice_ids(ids, frame)
    return document(q_ids.clamp(min=-1), torch.where(kv_ids < 0, -2, kv_ids))


def _chunks(chunk_size: int, left_padding: Tensor, frame: _Frame) -> Mask:
    # Same chunk iff (pos - left_padding[b]) // c agree: the chunk index is a document id.
    lp = left_padding.reshape(-1, 1).to(torch.long)
    q_pos = torch.arange(frame.q_len, device=lp.device) + frame.q_offset
    kv_pos = torch.arange(frame.kv_len, device=lp.device) + frame.kv_offset
    return document(
        torch.div(q_pos - lp, chunk_size, rounding_mode="floor"),
        torch.div(kv_pos - lp, chunk_size, rounding_mode="floor"),
    )


def _dense(fn: MaskFunction, frame: _Frame) -> Mask:
    """A closure we do not know, evaluated by ``transformers`` itself: ``(B, 1, Lq, Lk)`` bool."""
    mask = as_mask(evaluate(fn, frame).contiguous(), name=f"hf:{getattr(fn, '__qualname__', 'mask_function')}")
    assert mask is not None  # a tensor in, a mask out
    return mask


# ------------------------------------------------------------------------------ dense 4-D masks
def from_dense(mask: Tensor, kv_len: int) -> tuple[Mask | None, Tensor | None]:
    """A user's 4-D mask ``(B|1, H|1, Lq, >= Lk)`` -> ``(mask object, additive bias or None)``.

    Bool: ``True`` = may attend. Float: additive, as ``eager`` adds it; what it blocks is
    :func:`multihead.masks.additive_blocked`'s rule (``-inf`` and entries at or below
    ``finfo(dtype).min / 2``: HF writes ``finfo.min``), the other non-zero entries are a bias.
    Columns past ``Lk`` are dropped (a static cache's mask is as long as the cache). The structure
    is :func:`multihead.masks.recognize.from_dense`'s (band, documents, key padding where the mask
    is exactly that); otherwise the bool tensor is passed on. ``None``: nothing is blocked.
    """
    if mask.dim() != 4:
        raise ValueError(f"attention_mask: expected a 4-D mask (B, 1, Lq, Lk), got shape {tuple(mask.shape)}")
    mask = mask[..., :kv_len]
    bias = None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = additive_blocked(mask)
        allowed = ~blocked
        rest = mask.masked_fill(blocked, 0.0)
        bias = rest if bool(rest.ne(0).any()) else None
    else:
        raise TypeError(
            f"attention_mask: a 4-D mask must be bool (True = attend) or additive float, got "
            f"dtype {mask.dtype}; hint: pass mask.bool() for 1 = attend"
        )
    found = recognize_dense(allowed)
    return (as_mask(allowed) if found is None else found.mask), bias


def recognise(allowed: Tensor) -> Mask | None:
    """Gone: the one recogniser is :func:`multihead.masks.recognize.from_dense`; this name warns
    and reads ``allowed (B|1, H|1, Lq, Lk)`` bool as :func:`from_dense` does."""
    warnings.warn(
        "integrations.hf_masks.recognise is now hf_masks.from_dense(mask, kv_len) (HF's 4-D masks) or "
        "multihead.masks.recognize.from_dense(mask) (any dense mask)",
        DeprecationWarning,
        stacklevel=2,
    )
    return from_dense(allowed, allowed.shape[-1])[0]
