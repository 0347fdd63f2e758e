"""``KVCache``: what an attention layer needs from a key/value cache, and nothing more.

The layer projects only the new tokens, applies its rotary module to their keys, then calls
:meth:`KVCache.update` and attends over what it returns. Queries at positions
``length .. length + Lnew - 1`` see the ``T = length + Lnew`` keys through a bottom-right
``causal()`` mask (see :mod:`multihead.conventions`)::

    length=3, Lnew=2:   k0 k1 k2 k3 k4
                   q3    1  1  1  1  .
                   q4    1  1  1  1  1
"""

from __future__ import annotations

import abc

from torch import Tensor

__all__ = ["KVCache", "check_update", "check_truncate"]


class KVCache(abc.ABC):
    """One attention layer's keys and values for the tokens seen so far.

    A subclass stores them as it likes (concatenated, preallocated, in pages, a sliding window)
    but answers the same three questions. :meth:`update` validates its inputs before it changes
    anything: a refused update leaves the cache as it was.
    """

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """``T``, the number of tokens stored (0 when empty)."""

    @abc.abstractmethod
    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys ``k (B, Hkv, Lnew, D)`` and values ``v (B, Hkv, Lnew, Dv)`` of ``Lnew``
        new tokens, placed after the ``length`` stored ones.

        Returns every stored key and value, ``(B, Hkv, T, D)`` and ``(B, Hkv, T, Dv)`` with
        ``T = length + Lnew``, oldest token first.
        """

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens and forget the rest (``0 <= length <= self.length``):
        a layer call that fails after :meth:`update` rolls back this way, and speculative
        decoding drops rejected tokens this way."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every token: ``length`` becomes 0 and the next update may start a new sequence
        (of any batch size, heads, head dims, dtype and device)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length})"


def check_update(cache: str, k, v, stored_k: Tensor | None = None, stored_v: Tensor | None = None) -> None:
    """Refuse an update that the cache could not store as the continuation of what it holds.

    ``k (B, Hkv, Lnew, D)`` and ``v (B, Hkv, Lnew, Dv)`` must be 4-D tensors of one dtype and
    device, agreeing on ``B, Hkv, Lnew``; against ``stored_k``/``stored_v`` (whatever the cache
    keeps, ``(B, Hkv, ·, D)``/``(B, Hkv, ·, Dv)``) they must also agree on ``B, Hkv, D, Dv``,
    dtype and device. Raises before anything is stored. ``cache`` names the caller in messages.
    """
    where = f"{cache}.update"
    for name, t, last in (("k", k, "D"), ("v", v, "Dv")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor (B, Hkv, Lnew, {last}), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must have 4 dims (B, Hkv, Lnew, {last}), got shape {tuple(t.shape)}; "
                             f"hint: split the heads first, (B, Lnew, Hkv·{last}) -> (B, Hkv, Lnew, {last})")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{where}: k and v must agree on (B, Hkv, Lnew), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise TypeError(f"{where}: k and v must share a dtype, got {k.dtype} and {v.dtype}")
    if k.device != v.device:
        raise ValueError(f"{where}: k and v must be on one device, got {k.device} and {v.device}")
    if stored_k is None:
        return
    B, Hkv, T, D = stored_k.shape
    Dv = stored_v.shape[-1]
    hint = "; hint: use one cache per layer, and reset() it before a new sequence"
    for what, got, expected in (("B", k.shape[0], B), ("Hkv", k.shape[1], Hkv), ("D", k.shape[3], D),
                                ("Dv", v.shape[3], Dv)):
        if got != expected:
            raise ValueError(f"{where}: new keys/values have {what}={got} but the {T} stored tokens have "
                             f"{what}={expected} (stored k {tuple(stored_k.shape)}, v {tuple(stored_v.shape)}; "
                             f"got k {tuple(k.shape)}, v {tuple(v.shape)}){hint}")
    if k.dtype != stored_k.dtype:
        raise TypeError(f"{where}: new keys/values have dtype {k.dtype} but the stored ones {stored_k.dtype}{hint}")
    if k.device != stored_k.device:
        raise ValueError(f"{where}: new keys/values are on {k.device} but the stored ones on {stored_k.device}{hint}")


def check_truncate(cache: str, length, stored: int) -> int:
    """``length`` as a valid argument of :meth:`KVCache.truncate` for a cache holding ``stored``."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"{cache}.truncate: length must be an int, got {type(length).__name__}")
    if not 0 <= length <= stored:
        raise ValueError(f"{cache}.truncate: length must be in [0, {stored}] (the tokens stored), got {length}")
    return length
