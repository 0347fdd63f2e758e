"""Which positions of a sequence each rank holds: the ``contiguous`` and ``zigzag`` layouts.

A sequence of ``L`` tokens is split over the ``P`` ranks of a group. ``contiguous`` gives rank
``r`` the ``r``-th of ``P`` equal pieces. ``zigzag`` cuts the sequence into ``2P`` chunks and
gives rank ``r`` chunks ``r`` and ``2P-1-r``, so that under a causal mask every rank holds one
early chunk (few keys to see) and one late chunk (many), and does the same work::

    L = 16, P = 4          positions  0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15
    contiguous   rank      0 0   0 0   1 1   1 1   2 2   2  2    3  3    3  3
    zigzag       rank      0 0   1 1   2 2   3 3   3 3   2  2    1  1    0  0

A rank's shard is its chunks in order (zigzag rank 1 above holds positions ``2 3 12 13``).

A layout may also be an object (a :class:`Layout`: which runs of positions each rank holds, for
one length and one number of ranks), such as
:class:`~multihead.distributed.documents.DocumentLayout`, which balances packed documents; every
function here and every sharded attention takes it where it takes a name.
Everything in :mod:`multihead.distributed` reads positions from here: the ring's blocks, the
global position ids RoPE needs (:func:`shard_positions`), :func:`shard_sequence` and
:func:`unshard_sequence`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "LAYOUTS",
    "Layout",
    "Piece",
    "pieces",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
    "check_layout",
    "check_divisible",
]

#: The layouts by name; ``zigzag`` is the default of :func:`~multihead.distributed.ring_attention`.
LAYOUTS = ("zigzag", "contiguous")


class Piece(NamedTuple):
    """A run of consecutive positions held by one rank: local rows ``[local, local + length)`` are
    global positions ``[start, start + length)``."""

    local: int
    start: int
    length: int


class Layout(ABC):
    """A layout as an object: rank ``r`` of ``world`` holds the runs ``pieces(r)`` of a sequence
    of ``length`` positions, ``length / world`` of them per rank, in increasing order of position.
    Subclasses set ``world`` and ``length`` and implement :meth:`pieces`; they compare and hash by
    value (the ring's plans are kept per layout) and describe themselves briefly (``repr``)."""

    world: int
    length: int

    @abstractmethod
    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The runs of positions ``rank`` holds, in the order of its shard."""

    @property
    def shard_len(self) -> int:
        """Positions per rank: ``length / world``."""
        return self.length // self.world


def check_layout(layout, where: str) -> str | Layout:
    if isinstance(layout, Layout):
        return layout
    if layout not in LAYOUTS:
        raise ValueError(
            f"{where}: layout must be one of {LAYOUTS} or a multihead.distributed Layout object, got "
            f"{layout!r}; hint: 'zigzag' balances causal work, 'contiguous' lets a sliding window skip ranks, "
            "document_layout(ids, world) balances packed documents"
        )
    return layout


def chunks_per_rank(layout: str | Layout) -> int:
    return 2 if layout == "zigzag" else 1


def check_divisible(where: str, name: str, length: int, world: int, layout: str | Layout) -> None:
    """A global length ``length`` must split into ``world`` shards of whole chunks (or be the
    length and world a layout object was made for)."""
    if isinstance(layout, Layout):
        if (length, world) != (layout.length, layout.world):
            raise ValueError(
                f"{where}: {name}={length} over {world} ranks, but the layout {layout!r} was made for "
                f"{layout.length} positions over {layout.world} ranks; expected those (the layout holds "
                "the whole sequence's positions)"
            )
        return
    parts = world * chunks_per_rank(layout)
    if length % parts != 0:
        lower, upper = length // parts * parts, (length // parts + 1) * parts
        raise ValueError(
            f"{where}: {name}={length} does not split over {world} ranks in the {layout!r} layout; "
            f"expected a multiple of {parts} ({world} ranks x {chunks_per_rank(layout)} chunks), "
            f"e.g. {lower or parts} or {upper}; hint: pad the sequence and mask the padding with "
            f"key_padding()"
        )


def pieces(shard_len: int, rank: int, world: int, layout: str | Layout) -> tuple[Piece, ...]:
    """The runs of global positions held by ``rank`` when each rank holds ``shard_len`` of them."""
    if isinstance(layout, Layout):
        if (shard_len, world) != (layout.shard_len, layout.world):
            raise ValueError(
                f"pieces: {shard_len} positions per rank over {world} ranks, but the layout {layout!r} holds "
                f"{layout.shard_len} per rank over {layout.world}"
            )
        return layout.pieces(rank)
    if layout == "contiguous":
        return (Piece(0, rank * shard_len, shard_len),)
    c = shard_len // 2  # zigzag: chunks r and 2P-1-r of size c
    return (Piece(0, rank * c, c), Piece(c, (2 * world - 1 - rank) * c, c))


def shard_positions(
    shard_len: int,
    *,
    group=None,
    layout: str | Layout = "zigzag",
    rank: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The global positions ``(shard_len,)`` (int64) of this rank's shard: what RoPE (or any
    position-dependent module) must see instead of ``arange(shard_len)``.

    ``rank`` (default: this process's rank in ``group``) and ``group`` give ``P``; a rank holding
    ``shard_len`` tokens is part of a sequence of ``P * shard_len``."""
    check_layout(layout, "shard_positions")
    world, rank = _world_and_rank(group, rank, "shard_positions")
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(
            f"shard_positions: shard_len={shard_len} is odd; the 'zigzag' layout holds two equal chunks "
            f"per rank, so a shard has an even length"
        )
    runs = [torch.arange(p.start, p.start + p.length, device=device) for p in pieces(shard_len, rank, world, layout)]
    return torch.cat(runs)


def shard_sequence(
    x: Tensor, *, dim: int | None = None, group=None, layout: str | Layout = "zigzag", rank: int | None = None
) -> Tensor:
    """This rank's shard of the whole sequence ``x`` (every rank passes the same ``x``).

    ``dim`` (required) is the sequence dimension: 2 for ``(B, H, L, D)``, 1 for ``(B, L, E)``.
    It has no default: either guess splits the other layout's heads or features without a
    complaint. Returns a tensor of length ``L / P`` along ``dim`` (a view for ``contiguous``, a
    copy for ``zigzag``)."""
    check_layout(layout, "shard_sequence")
    if not isinstance(x, Tensor):
        raise TypeError(f"shard_sequence: x must be a tensor, got {type(x).__name__}")
    dim = _check_dim("shard_sequence", x, dim)
    world, rank = _world_and_rank(group, rank, "shard_sequence")
    check_divisible("shard_sequence", f"x.shape[{dim}]", x.shape[dim], world, layout)
    runs = [x.narrow(dim, p.start, p.length) for p in pieces(x.shape[dim] // world, rank, world, layout)]
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim=dim)


def unshard_sequence(x: Tensor, *, dim: int | None = None, group=None, layout: str | Layout = "zigzag") -> Tensor:
    """The whole sequence from every rank's shard ``x`` (an all-gather; every rank gets it).

    The inverse of :func:`shard_sequence`, with its required ``dim``. Not differentiable: it is
    for checking and for outputs, not for the middle of a model."""
    check_layout(layout, "unshard_sequence")
    if not isinstance(x, Tensor):
        raise TypeError(f"unshard_sequence: x must be a tensor, got {type(x).__name__}")
    dim = _check_dim("unshard_sequence", x, dim)
    world, _ = _world_and_rank(group, None, "unshard_sequence")
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(
            f"unshard_sequence: x.shape[{dim}]={x.shape[dim]} is odd; a 'zigzag' shard holds two equal chunks"
        )
    x = x.detach().contiguous()
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x, group=group)
    S = x.shape[dim]
    out = x.new_empty(x.shape[:dim] + (S * world,) + x.shape[dim + 1 :])
    for r, shard in enumerate(gathered):
        for p in pieces(S, r, world, layout):
            out.narrow(dim, p.start, p.length).copy_(shard.narrow(dim, p.local, p.length))
    return out


def _world_and_rank(group, rank, where: str) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment)"
        )
    world = dist.get_world_size(group)
    if rank is None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"{where}: this process (global rank {dist.get_rank()}) is not a member of group; "
                "call it only on the group's ranks"
            )
    elif not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"{where}: rank must be an int in [0, {world}), got {rank!r}")
    return world, rank


def _check_dim(where: str, x: Tensor, dim) -> int:
    if dim is None:
        raise TypeError(
            f"{where}: dim is required (keyword), the sequence dimension of x {tuple(x.shape)}: dim=2 for "
            "(B, H, L, D) as attention takes it, dim=1 for (B, L, E) as a layer takes it"
        )
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{where}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}"
        )
    return dim % x.dim()
