"""Input checks shared by the attention layers, run before any computation.

Each error names the argument, the value received and what would be valid. ``TypeError`` for
wrong types and dtypes, ``ValueError`` for wrong values and shapes (see ``shared/STYLE.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from multihead.caches import DynamicKVCache
from multihead.inputs import check_positions as _check_positions
from multihead.inputs import check_tensor

__all__ = [
    "check_size",
    "check_optional_size",
    "check_flag",
    "check_dropout",
    "check_counts",
    "check_causal_variant",
    "check_position_cache",
    "check_self_attention",
    "check_inputs",
    "check_positions",
    "layout_name",
    "dims",
]


def check_size(layer: str, name: str, value: object) -> int:
    """A positive ``int`` (``bool`` is refused: ``True`` is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{layer}: {name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{layer}: {name} must be a positive int, got {value}")
    return value


def check_optional_size(layer: str, name: str, value: object, default: int) -> int:
    """``None`` (meaning ``default``) or a positive ``int``."""
    return default if value is None else check_size(layer, name, value)


def check_flag(layer: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{layer}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_dropout(layer: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{layer}: dropout must be a probability in [0, 1), got {value!r}")
    return float(value)


def check_counts(layer: str, sizes: Mapping[str, object]) -> None:
    """Each of ``sizes`` a positive ``int`` (a variant layer's block sizes and counts)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")


def check_causal_variant(layer: str, options: dict[str, Any], causal_why: str, one_call_why: str) -> None:
    """A variant whose structure is causal and that attends its own way (NSA, MoBA, top-k):
    ``causal``, taken out of ``options``, must be ``True``; ``attend`` and ``context_parallel`` are
    refused; each message gives its reason."""
    if options.pop("causal", True) is not True:
        raise ValueError(f"{layer}: causal must be True ({causal_why})")
    for name in ("attend", "context_parallel"):
        if options.get(name) is not None:
            raise TypeError(f"{layer}: {name} is not supported ({one_call_why}), got {options[name]!r}")


def check_position_cache(layer: str, kv_cache: object, why: str) -> None:
    """A variant that cuts blocks at positions reads a :class:`~multihead.caches.DynamicKVCache` only."""
    if kv_cache is not None and not isinstance(kv_cache, DynamicKVCache):
        raise TypeError(f"{layer}: kv_cache must be a DynamicKVCache ({why}), got {type(kv_cache).__name__}")


def check_self_attention(layer: str, args: tuple[Any, ...], kwargs: dict[str, Any], causal_why: str) -> None:
    """A variant's ``forward(x, ...)``: no key or value, no ``mask=`` or ``score_mod=`` (its own
    structure is the mask: ``causal_why``)."""
    if args or kwargs.get("key") is not None or kwargs.get("value") is not None:
        raise TypeError(f"{layer}: self-attention only (forward(x, ...)); got key/value arguments")
    for name in ("mask", "score_mod"):
        if kwargs.get(name) is not None:
            raise TypeError(f"{layer}: {name}= is not supported ({causal_why})")


def layout_name(batch_first: bool, feature: str) -> str:
    return f"(B, L, {feature})" if batch_first else f"(L, B, {feature})"


def check_inputs(
    layer: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    sizes: tuple[int, int, int],
    batch_first: bool,
    ranks: tuple[int, ...] = (3,),
    weight: Tensor | None = None,
) -> None:
    """Check ``query``/``key``/``value``: tensors of one floating dtype and device, of an accepted
    rank, with feature sizes ``sizes = (E, kdim, vdim)``, one batch size, and ``key`` and
    ``value`` of one length; and, given the layer's ``weight``, of its dtype (outside autocast)
    and device. Nothing is broadcast."""
    given = [("query", query, "E", sizes[0])]
    if key is not query or sizes[1] != sizes[0]:  # self-attention: one tensor, checked once
        given.append(("key", key, "kdim", sizes[1]))
    if value is not key or sizes[2] != sizes[1]:
        given.append(("value", value, "vdim", sizes[2]))
    for name, t, _, _ in given:
        check_tensor(name, t, "", where=layer)
    for name, t, feature, size in given:
        if t.dim() not in ranks:
            expected = " or ".join(f"{r}" for r in ranks)
            raise ValueError(
                f"{layer}: {name} must have {expected} dims {layout_name(batch_first, feature)}"
                f"{' or (L, ' + feature + ') unbatched' if 2 in ranks else ''}, "
                f"got shape {tuple(t.shape)}"
                f"{'; hint: add a batch dim with .unsqueeze(0)' if t.dim() == 2 else ''}"
            )
        if t.shape[-1] != size:
            raise ValueError(
                f"{layer}: {name} has {t.shape[-1]} features (last dim of shape {tuple(t.shape)}) "
                f"but the layer expects {feature}={size}"
            )
        if 0 in t.shape:
            raise ValueError(f"{layer}: {name} has a zero-size dimension, shape {tuple(t.shape)}")
    if len(given) == 1:
        _check_weight(layer, query, weight)
        return
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(
            f"{layer}: query, key and value must have the same number of dims, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"{layer}: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"{layer}: query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    _check_weight(layer, query, weight)
    if query.dim() == 3:
        b = 0 if batch_first else 1
        batches = (query.shape[b], key.shape[b], value.shape[b])
        if not batches[0] == batches[1] == batches[2]:  # compared, not hashed: torch.jit.trace gives tensors
            raise ValueError(
                f"{layer}: batch sizes differ: query has B={batches[0]}, key {batches[1]}, "
                f"value {batches[2]} (dim {b} with batch_first={batch_first}); they must be equal"
            )
    seq = 0 if (query.dim() == 2 or not batch_first) else 1
    if key.shape[seq] != value.shape[seq]:
        raise ValueError(
            f"{layer}: key and value lengths differ: key has Lk={key.shape[seq]}, value has "
            f"{value.shape[seq]} (dim {seq}); each key needs exactly one value"
        )


def _check_weight(layer: str, query: Tensor, weight: Tensor | None) -> None:
    """``query`` of the dtype (outside autocast) and on the device of the layer's ``weight``."""
    if isinstance(weight, Tensor) and weight.is_floating_point():
        if query.dtype != weight.dtype and not torch.is_autocast_enabled(query.device.type):
            raise TypeError(
                f"{layer}: query has dtype {query.dtype} but the layer's weights are {weight.dtype}; "
                f"convert one of them (query.to({weight.dtype}) or layer.to({query.dtype}))"
            )
        if query.device != weight.device:
            raise ValueError(
                f"{layer}: query is on {query.device} but the layer's weights are on {weight.device}; "
                f"move one of them (query.to('{weight.device}') or layer.to('{query.device}'))"
            )


def dims(t: Tensor, batch_first: bool) -> tuple[int, int]:
    """``(B, L)`` of a 3-dim input in the given layout."""
    return (t.shape[0], t.shape[1]) if batch_first else (t.shape[1], t.shape[0])


def check_positions(layer: str, positions: object, B: int, Lq: int, device: torch.device) -> Tensor:
    """``positions`` as an ``int64`` tensor ``(Lq,)`` or ``(B, Lq)`` on the device of the query
    (:func:`multihead.inputs.check_positions`, the one check of positions)."""
    return _check_positions(
        layer,
        positions,
        ((Lq,), (B, Lq)),
        device,
        device_of="query",
        expected=f"(Lq,) = ({Lq},) or (B, Lq) = ({B}, {Lq})",
        optional=True,
        hint="positions count tokens, e.g. torch.arange(Lq)",
    )
