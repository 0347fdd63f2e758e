"""Input checks for :func:`multihead.attention`, run before any computation.

Each error names the argument, what was received and what was expected, with a hint where one
exists. ``ValueError`` for wrong values and shapes, ``TypeError`` for wrong types and dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from multihead.blocks import Extent
from multihead.call import AttentionCall, mask_and_score_mod
from multihead.conventions import default_scale
from multihead.inputs import check_tensor
from multihead.masks import Mask

__all__ = [
    "AttentionCall",
    "DEFAULT_MAX_WEIGHTS_BYTES",
    "check_weights_bytes",
    "validate_call",
    "validate_weights_selection",
]

#: The default ``max_weights_bytes`` of :func:`multihead.attention`: returned weights larger than
#: this are refused before any kernel runs (2 GiB: ``(1, 8, 8192, 8192)`` in fp32).
DEFAULT_MAX_WEIGHTS_BYTES = 2 << 30


def validate_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: object,
    scale: float | None,
    dropout_p: float,
    dropout_mask: Tensor | None,
    return_weights: bool,
    return_lse: bool,
    score_mod: object = None,
) -> AttentionCall:
    for name, t, layout in (("q", q, "(B, Hq, Lq, D)"), ("k", k, "(B, Hkv, Lk, D)"), ("v", v, "(B, Hkv, Lk, Dv)")):
        check_tensor(name, t, layout)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims {layout}, got shape {tuple(t.shape)}; "
                "hint: layers take (B, L, E), the functional core takes heads split out"
            )
        if 0 in (t.shape[0], t.shape[1], t.shape[3]):
            raise ValueError(
                f"{name} has a zero-size dimension: shape {tuple(t.shape)}; expected B, heads and head "
                "dims >= 1 (only the lengths Lq, Lk may be 0)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")

    B, Hq, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"batch sizes differ: q has B={B}, k has {k.shape[0]}, v has {v.shape[0]}; batch "
            f"dimensions do not broadcast here: expand the smaller one (e.g. k.expand({B}, -1, -1, -1), "
            "a view)"
        )
    if k.shape[3] != D:
        raise ValueError(
            f"head dims differ: q has D={D} but k has D={k.shape[3]} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)}); q and k must share D, v may differ"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v lengths differ: k has Lk={k.shape[2]}, v has {v.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: k has Hkv={k.shape[1]}, v has {v.shape[1]}")
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hq % Hkv != 0:
        valid = [h for h in range(1, Hq + 1) if Hq % h == 0]
        raise ValueError(
            f"q has Hq={Hq} heads, not divisible by Hkv={Hkv} key/value heads; Hkv must divide Hq (one of {valid})"
            f"{_layout_hint(q, k, mask)}"
        )

    if scale is None:
        scale = default_scale(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(D)), got {scale!r}")
    q, scale, folded = _fold_nonpositive_scale(q, float(scale))

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_mask is not None:
        if not isinstance(dropout_mask, Tensor) or dropout_mask.dtype != torch.bool:
            raise TypeError(
                f"dropout_mask must be a bool tensor (True = kept), got {type(dropout_mask).__name__}"
                f"{'' if not isinstance(dropout_mask, Tensor) else ' of dtype ' + str(dropout_mask.dtype)}"
            )
        if tuple(dropout_mask.shape) != (B, Hq, Lq, Lk):
            raise ValueError(
                f"dropout_mask must have shape (B, Hq, Lq, Lk) = {(B, Hq, Lq, Lk)}, got {tuple(dropout_mask.shape)}"
            )
        if dropout_p == 0.0:
            raise ValueError("dropout_mask was given with dropout_p=0; give the p it was drawn with")

    for name, flag in (("return_weights", return_weights), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

    given = mask
    try:
        if isinstance(mask, Tensor):
            _check_mask_tensor(mask, q, (B, Hq, Lq, Lk))
        if isinstance(mask, Tensor) and mask.is_floating_point() and mask.device != q.device:
            # Mask tensors may live on any device (bool ones move lazily); an additive one moves here,
            # before it becomes a bias, so that it is not refused as a score_mod on the wrong device.
            mask = mask.to(q.device)
        mask, score_mod = mask_and_score_mod(mask, score_mod, q_len=Lq, kv_len=Lk)
        if mask is not None:
            if "custom" in mask.kinds():  # a block_select with one row per KV head: bound to Hq
                mask = mask.for_heads(Hq)
            mask.check(Extent(B, Hq, Lq, Lk))
    except ValueError as exc:
        # A mask of the whole sequence does not fit inputs in (B, L, H, D): often the only sign.
        hint = "" if _mask_fits(given, (B, Hq, Lq, Lk)) else _layout_hint(q, k, given)
        if not hint:
            raise
        raise ValueError(f"{exc}{hint}") from None
    if score_mod is not None:
        score_mod.check(Extent(B, Hq, Lq, Lk))
        for t in score_mod.tensors():
            if t.device != q.device:
                raise ValueError(
                    f"score_mod {score_mod._describe()} holds a tensor on {t.device} but q is on "
                    f"{q.device}; move it with .to('{q.device}')"
                )

    # The fused kernels read rows of q, k, v with unit stride: a last dimension that is not
    # contiguous (x.transpose(-1, -2), x[..., ::2]) gives garbage there, so such inputs are copied.
    q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in (q, k, v))
    # return_weights is validated but not part of the call: weights come from q, k and the LSE.
    return AttentionCall(
        q, k, v, mask, score_mod, scale, float(dropout_p), dropout_mask, return_lse or return_weights, folded
    )


def _check_mask_tensor(mask: Tensor, q: Tensor, expected: tuple[int, int, int, int]) -> None:
    """A bool or float tensor given as ``mask=``, checked as the user wrote it: its own shape in
    the message (not the 4-D view it becomes), and a device its values can be read from."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return  # refused by its dtype, with its polarity hint (masks.TensorMask)
    if mask.device != q.device and mask.device.type == "meta":
        # Masks on another device are moved to q's lazily (a CPU mask serves CUDA inputs); a
        # meta tensor has no values to move, and PyTorch's own error would not name the mask.
        raise ValueError(
            f"mask is on {mask.device} but q is on {q.device}; a tensor on the meta device holds no values to "
            f"mask with: build the mask on {q.device} (or on any device with data: it is moved to q's device)"
        )
    if not 2 <= mask.dim() <= 4:
        return  # refused by its number of dims (masks.TensorMask, call.mask_and_score_mod)
    B, _, _, Lk = expected
    shape = tuple(mask.shape)
    if _broadcasts(shape, expected):
        return
    hint = ""
    if mask.dim() == 2 and shape == (B, Lk):
        table = (
            "a bool (B, Lk) table with True = a real key, the opposite of PyTorch's key_padding_mask "
            "(True = padding): mask=multihead.key_padding(~key_padding_mask)"
            if mask.dtype == torch.bool
            else "a bool (B, Lk) table with True = a real key; from PyTorch's additive key padding mask "
            "(-inf or finfo.min = padding): mask=multihead.key_padding(~multihead.masks.additive_blocked(mask))"
        )
        hint = (
            f"; hint: a 2-D mask is (Lq, Lk), and ({B}, {Lk}) = (B, Lk) looks like a key padding mask: pass "
            f"mask=multihead.key_padding(lengths_or_table), with lengths (B,) or {table}; or mask[:, None, None, :]"
        )
    raise ValueError(
        f"mask of shape {shape} is not broadcastable to (B, H, Lq, Lk) = {expected}; its dims line up with "
        f"the last {mask.dim()} of these, and each must be 1 or the matching size{hint}"
    )


def _layout_hint(q: Tensor, k: Tensor, mask: object) -> str:
    """A hint for inputs in FlashAttention's layout ``(B, L, H, D)``, added to an error when the
    shapes read that way make a valid call (and ``mask`` fits it); otherwise ``""``.

    Only errors get it: shapes alone cannot tell the layouts apart (``Lq = Lk`` and ``Lk``
    dividing ``Lq`` read as valid heads), so a call valid in ``(B, H, L, D)`` is never refused."""
    Hq, Lq, Hkv, Lk = q.shape[2], q.shape[1], k.shape[2], k.shape[1]
    if Hq == 0 or Hkv == 0 or Hq % Hkv != 0 or not (mask is None or _mask_fits(mask, (q.shape[0], Hq, Lq, Lk))):
        return ""
    return (
        f"; hint: multihead takes (B, H, L, D); if q, k and v are (B, L, H, D) (FlashAttention's layout), "
        f"pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (read that way: Hq={Hq}, "
        f"Hkv={Hkv}, Lq={Lq}, Lk={Lk}), and out.transpose(1, 2) gives (B, L, H, Dv) back"
    )


def _mask_fits(mask: object, expected: tuple[int, int, int, int]) -> bool:
    """Whether ``mask`` (as given to :func:`validate_call`) passes the shape checks for
    ``(B, H, Lq, Lk)`` = ``expected``."""
    if isinstance(mask, Tensor):
        return 2 <= mask.dim() <= 4 and _broadcasts(tuple(mask.shape), expected)
    if isinstance(mask, Mask):
        try:
            mask.check(Extent(*expected))
        except (TypeError, ValueError):
            return False
        return True
    return mask is None


def _broadcasts(shape: tuple[int, ...], expected: tuple[int, int, int, int]) -> bool:
    """Whether a mask tensor of ``shape`` broadcasts to ``(B, H, Lq, Lk)``: its dims line up with
    those from the right, each 1 or the matching size."""
    return all(s == 1 or s == e for s, e in zip(reversed(shape), reversed(expected)))


def check_weights_bytes(
    max_weights_bytes: object,
    *,
    q: Tensor,
    k: Tensor,
    heads: Tensor | None,
    rows: Tensor | None,
    return_weights: bool,
) -> None:
    """Refuse, before any kernel runs, weights that would take more than ``max_weights_bytes``:
    ``B · len(heads) · len(rows) · Lk`` elements of ``q``'s dtype (the selection applied; all
    heads and rows by default). ``None``: no limit."""
    limit = max_weights_bytes
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"max_weights_bytes must be an int (bytes) or None (no limit), got {limit!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"max_weights_bytes must be >= 0 or None (no limit), got {limit}")
    if not return_weights or limit is None:
        return
    B, Hq, Lq, _ = q.shape
    shape = (B, Hq if heads is None else len(heads), Lq if rows is None else len(rows), k.shape[2])
    nbytes = math.prod(shape) * q.element_size()
    if nbytes <= limit:
        return
    raise ValueError(
        f"return_weights=True would allocate {nbytes} bytes ({_in_units(nbytes)}) for the weights "
        f"(B, heads, rows, Lk) = {shape} in {q.dtype}, over max_weights_bytes={limit} "
        f"({_in_units(limit)}); refused before computing anything. Fix: select the weights you "
        "need with weights_heads= and weights_rows= (e.g. weights_heads=0, weights_rows=slice(-1, None): "
        "head 0's last row; a layer takes them beside need_weights=True), or raise the limit with "
        "multihead.attention(..., max_weights_bytes=) (None: no limit)"
    )


def _in_units(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _fold_nonpositive_scale(q: Tensor, scale: float) -> tuple[Tensor, float, bool]:
    """A scale <= 0 is folded into the queries (``q * scale``, kernel scale 1): PyTorch's fused
    kernels compute ``-inf * scale`` for masked scores, which is NaN for 0 and +inf below it
    (PyTorch 2.13, CPU flash and SDPA). The product is the same scores, so every backend agrees."""
    if scale > 0:
        return q, scale, False
    return q * scale, 1.0, True


def validate_weights_selection(
    weights_heads: object, weights_rows: object, *, q: Tensor, return_weights: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``weights_heads`` / ``weights_rows`` of :func:`multihead.attention` as 1-D int64 index
    tensors (``None``: all). Each may be an int, a sequence of ints, a slice or an integer tensor."""
    if (weights_heads is not None or weights_rows is not None) and not return_weights:
        raise ValueError("weights_heads/weights_rows select which weights to return; they need return_weights=True")
    return (
        _index("weights_heads", weights_heads, q.shape[1], "Hq", q.device),
        _index("weights_rows", weights_rows, q.shape[2], "Lq", q.device),
    )


def _index(name: str, value: object, size: int, what: str, device: torch.device) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, slice):
        ids = torch.tensor(range(size)[value], dtype=torch.int64)  # any step, negative included
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a sequence of ints, a slice or an integer tensor, got a bool")
    elif isinstance(value, int):
        ids = torch.tensor([value])
    elif isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(
                f"{name} must be a 1-D integer tensor, got dtype {value.dtype} and shape {tuple(value.shape)}"
            )
        ids = value.reshape(-1).to(torch.int64)
    else:
        try:
            if not isinstance(value, Iterable):
                raise TypeError
            items = list(value)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
                raise TypeError
            ids = torch.tensor(items, dtype=torch.int64)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name} must be an int, a sequence of ints, a slice or an integer tensor, got {value!r}"
            ) from exc
    if ids.numel() == 0:
        raise ValueError(f"{name} selects nothing; expected at least one index in [0, {what}={size})")
    outside = (ids < -size) | (ids >= size)
    if bool(outside.any()):
        raise ValueError(
            f"{name} has indices {ids[outside].tolist()[:8]} outside [0, {what}={size}) "
            f"(or [-{size}, 0), counting from the end)"
        )
    return (ids % size).to(device)
