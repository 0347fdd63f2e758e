"""`Value`: the one base of the immutable objects compared by what they mean, masks
(:class:`multihead.masks.Mask`) and score modifiers (:class:`multihead.scores.ScoreMod`).

A value's *fields* are its public attributes, set once (in ``__init__``, with ``self.x = ...``
or :meth:`Value._set`) and never changed; attributes whose names start with ``_`` are *derived*,
computed on first use by :meth:`Value._cached` and not part of the value. From the fields come:

* equality and a hash by value (``causal() == causal()``), so that caches of plans key on what an
  object means, not on which Python object carries it; tensors take part by
  :func:`tensor_identity` (small host tensors by content, others by identity and version);
* :meth:`Value.to`, the same value with every tensor on a device;
* :meth:`Value.by_value`, whether the value says everything (no tensor taken by identity);
* :meth:`Value._replace`, a copy with some fields changed (its derived values recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

__all__ = ["Value", "tensor_identity"]

# Tensors up to this many elements on the CPU take part in a value by content.
_CONTENT_ELEMENTS = 4096
_PLAIN = frozenset({int, float, str, bool})
_T = TypeVar("_T")
_V = TypeVar("_V", bound="Value")


class Value:
    """Base class of immutable objects with equality and hash by value (see the module's doc)."""

    def __setattr__(self, name: str, value: object) -> None:
        fields = self.__dict__
        if name in fields or name.startswith("_") or "_value_cache" in fields:
            raise AttributeError(
                f"{type(self).__name__} is immutable: its fields are set once, in __init__ "
                f"(setting {name!r}); build a new one instead"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: its fields are set once (deleting {name!r})")

    def _set(self, **fields: Any) -> None:
        """Set fields (in ``__init__``), without :meth:`__setattr__`'s checks."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, object]:
        # A copy (copy.deepcopy, pickle) holds other tensors: its derived values are recomputed.
        return self._fields()

    def _fields(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def _replace(self: _V, **changes: object) -> _V:
        """A copy with ``changes`` to its fields and no derived value (they are recomputed)."""
        new = object.__new__(type(self))
        new._set(**{**self._fields(), **changes})
        return new

    # ----------------------------------------------------------------------------- value
    def _value(self) -> tuple[object, ...]:
        value: tuple[object, ...] | None = self.__dict__.get("_value_cache")  # immutable: computed once per object
        if value is None:
            fields = vars(self)
            value = (type(self), *((k, _field_value(fields[k])) for k in sorted(fields) if k[0] != "_"))
            object.__setattr__(self, "_value_cache", value)
        return value

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Value) and hash(self) == hash(other) and self._value() == other._value()
        )

    def __hash__(self) -> int:
        # Read on every plan lookup (multihead.plans): the cached value without a closure or a call.
        cached: int | None = self.__dict__.get("_hash_cache")
        return self._cached("_hash_cache", lambda: hash(self._value())) if cached is None else cached

    def to(self: _V, device: torch.device | str) -> _V:
        """This value with every tensor it holds on ``device`` (``self`` when all are there)."""
        fields = self._fields()
        moved = {k: _moved(v, device) for k, v in fields.items()}
        if all(moved[k] is fields[k] for k in fields):
            return self
        return self._replace(**moved)

    def by_value(self) -> bool:
        """Whether the value says everything the object means: every tensor inside is a small host
        copy compared by content (:func:`tensor_identity`). A tensor taken by identity could change
        in place after the value was computed (it is computed once), so plan caches
        (:mod:`multihead.plans`) keep an object only when this is ``True``."""
        return self._cached("_by_value_cache", lambda: all(_by_content(v) for v in self._fields().values()))

    def _cached(self, name: str, compute: Callable[[], _T]) -> _T:
        """A derived value computed on first use (host synchronisation happens here, when a
        structural question needs it, never when the object is built)."""
        cache = self.__dict__
        if name not in cache:
            object.__setattr__(self, name, compute())
        return cast(_T, cache[name])


def tensor_identity(t: Tensor) -> tuple[object, ...]:
    """How a tensor inside a mask or modifier takes part in its value. Small CPU tensors (lengths,
    ids, positions) by content, so that ``key_padding(torch.tensor([3, 5]))`` built twice is one
    mask; others by identity (the same memory viewed the same way, and the same in-place version:
    no host synchronisation, and a tensor changed in place is another value). Masks copy the small
    tensors they are built from, so changing the caller's tensor afterwards changes no mask."""
    if _content_tensor(t):
        return ("values", t.dtype, tuple(t.shape), tuple(t.flatten().tolist()))
    return (
        "tensor",
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device,
        t._version,
    )


def _field_value(v: object) -> object:
    """A field as plain data: nested values by their values (compared without calling back into
    ``__eq__``), tensors by :func:`tensor_identity`."""
    if v is None or v.__class__ in _PLAIN:  # most fields (a mask rebuilt per call is hashed per call)
        return v
    if isinstance(v, Tensor):
        return tensor_identity(v)
    if isinstance(v, Value):
        return v._value()
    if isinstance(v, tuple):
        return tuple(_field_value(x) for x in v)
    return v


def _moved(v: object, device: torch.device | str) -> object:
    """A field with its tensors on ``device`` (the same object where nothing moves)."""
    if isinstance(v, Tensor):
        want = torch.device(device)
        same = v.device.type == want.type and (want.index is None or v.device.index == want.index)
        return v if same else v.to(want)
    if isinstance(v, Value):
        return v.to(device)
    if isinstance(v, tuple):
        items = tuple(_moved(x, device) for x in v)
        return v if all(a is b for a, b in zip(items, v)) else items
    return v


def _by_content(v: object) -> bool:
    """A field whose value is plain data (tensors by content, nested values by value)."""
    if isinstance(v, Tensor):
        return _content_tensor(v)
    if isinstance(v, Value):
        return v.by_value()
    if isinstance(v, tuple):
        return all(_by_content(x) for x in v)
    return True


def _content_tensor(t: Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() <= _CONTENT_ELEMENTS and not t.requires_grad
