"""The block protocol's two small values: the whole attention (:class:`Extent`) and a rectangle of
it (:class:`Block`).

Every structural question a mask or a score modifier answers about part of an attention takes
these two, in this order, and nothing positional besides (``mask.block_state(extent, block)``,
``mask.materialize_block(extent, block, device)``, ``score_mod.bias_block(extent, block, device,
dtype)``)::

    extent = Extent(B, H, Lq, Lk)             the whole attention: what positions mean
    block  = Block(q0, q1, k0, k1)            queries [q0, q1) x keys [k0, k1) of it

                 k0        k1
            ┌────┬─────────┬────┐
            │    │         │    │  Lq rows, Lk columns: the extent
         q0 ├────┼─────────┤    │
            │    │  block  │    │
         q1 ├────┴─────────┘    │
            └───────────────────┘

A block is positions in the whole attention, never lengths of its own: a mask's meaning does not
depend on the block it is read on (:mod:`multihead.masks.base`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

__all__ = ["Extent", "Block", "check_protocol", "check_head_range"]


@dataclass(frozen=True, slots=True)
class Extent:
    """The whole attention a block belongs to: ``B`` batch elements, ``H`` (query) heads, ``Lq``
    queries and ``Lk`` keys. ``q_len``/``kv_len`` are ``None`` only where a length is not known
    yet (:meth:`multihead.Mask.check` of a mask before the call's lengths are), never for a block.

    Unpacks as ``B, H, Lq, Lk = extent``."""

    batch: int
    heads: int
    q_len: int | None
    kv_len: int | None

    def __iter__(self) -> Iterator[int | None]:
        return iter((self.batch, self.heads, self.q_len, self.kv_len))

    @property
    def lengths(self) -> tuple[int, int]:
        """``(Lq, Lk)``; a ``ValueError`` when one is unknown."""
        q_len, kv_len = self.q_len, self.kv_len
        if q_len is None or kv_len is None:
            raise ValueError(f"{self}: the lengths are not known here (Lq={q_len}, Lk={kv_len}); expected two ints")
        return q_len, kv_len

    def with_lengths(self, q_len: int | None, kv_len: int | None) -> Extent:
        """This extent with other lengths (a block read inside a larger attention)."""
        return replace(self, q_len=q_len, kv_len=kv_len)

    def with_heads(self, heads: int) -> Extent:
        """This extent with another head count (a mask read at a range of heads)."""
        return replace(self, heads=heads)

    def rows(self, q0: int, q1: int) -> Block:
        """Queries ``[q0, q1)`` against every key: ``Block(q0, q1, 0, Lk)``."""
        return Block(q0, q1, 0, self.lengths[1])

    def whole(self) -> Block:
        """The block of every query and key: ``Block(0, Lq, 0, Lk)``."""
        q_len, kv_len = self.lengths
        return Block(0, q_len, 0, kv_len)


@dataclass(frozen=True, slots=True)
class Block:
    """Queries ``[q0, q1)`` x keys ``[k0, k1)`` of an attention, as positions in the whole of it."""

    q0: int
    q1: int
    k0: int
    k1: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.q0, self.q1, self.k0, self.k1))

    @property
    def rows(self) -> int:
        """How many queries: ``q1 - q0``."""
        return self.q1 - self.q0

    @property
    def cols(self) -> int:
        """How many keys: ``k1 - k0``."""
        return self.k1 - self.k0

    @classmethod
    def whole(cls, extent: Extent) -> Block:
        """Every query and key of ``extent``."""
        return extent.whole()

    def shifted(self, dq: int, dk: int) -> Block:
        """The same rectangle ``dq`` queries and ``dk`` keys further (a block read at offsets)."""
        return Block(self.q0 + dq, self.q1 + dq, self.k0 + dk, self.k1 + dk)

    def with_keys(self, k0: int, k1: int) -> Block:
        """The same queries against keys ``[k0, k1)``."""
        return Block(self.q0, self.q1, k0, k1)


def check_head_range(where: str, first: int, count: int, num_heads: int) -> None:
    """Refuse heads ``[first, first + count)`` that are not a range of an extent's ``num_heads``
    query heads (a head-parallel rank's share: ``masks.head_range``, ``scores.head_range``,
    ``scores.sinks_range``), naming ``where``."""
    for name, value in (("first", first), ("count", count), ("num_heads", num_heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if first < 0 or count < 1 or first + count > num_heads:
        raise ValueError(
            f"{where}: heads [{first}, {first + count}) are not a range of the {num_heads} heads; "
            f"expected 0 <= first and 1 <= count with first + count <= {num_heads}"
        )


def check_protocol(cls: type, methods: Mapping[str, tuple[str, ...]]) -> None:
    """Refuse, when ``cls`` is defined, an override of a block-protocol method whose leading
    parameters are not ``methods[name]`` (e.g. ``("extent", "block")``): a subclass written for the
    positional integers of before would otherwise be called with two objects and fail far away."""
    for name, leading in methods.items():
        func = cls.__dict__.get(name)
        if func is None or not callable(func):
            continue
        params = list(inspect.signature(func).parameters)[1 : 1 + len(leading)]
        if tuple(params) != leading:
            got = ", ".join(list(inspect.signature(func).parameters)[1:])
            want = ", ".join(leading)
            raise TypeError(
                f"{cls.__qualname__}.{name}({got}): the block protocol takes ({want}, ...) first, an Extent "
                f"(B, H, Lq, Lk) and a Block (q0, q1, k0, k1) from multihead.blocks, in that order; "
                f"write it as def {name}(self, {want}, ...) and read block.q0, extent.q_len, ..."
            )
