"""Which blocks of a sharded attention each rank computes, at which step, and who sends to whom.

Rank ``r`` holds queries at the positions of its shard and keys at the positions of its shard
(:mod:`multihead.distributed.layout`). At step ``s`` it attends to the keys of rank ``r - s``
(mod ``P``), received directly from that rank; step 0 is its own keys. A step is a few calls of
:func:`multihead.attention`, one per block of (a run of local query rows) x (a run of received
keys), each read from the *global* mask at the block's absolute positions
(``mask.shifted(q_start, kv_start, q_len=Lq, kv_len=Lk)``). The mask's structural answer
(:meth:`Mask.block_state`) decides each block:

* ``EMPTY``: not computed; a pair of ranks with no visible block never communicates;
* ``FULL``: computed with no mask (neighbouring full blocks are joined into one call);
* ``PARTIAL``: computed with the shifted mask.

Causal, zigzag, ``P = 2`` (chunks of 2 positions; rank 0 holds chunks 0 and 3, rank 1 chunks 1
and 2)::

    rank 0, step 0 (own keys 0 1 | 6 7)   rank 0, step 1 (keys of rank 1: 2 3 | 4 5)
    q 0 1  | partial  empty |              q 0 1  | empty  empty |
    q 6 7  | full     partial|             q 6 7  | full   full  |   one call: rows 6 7 x keys 2..5

Every rank computes the same plan for every rank from the same global mask, so the sends and
receives of a step always match without any message about them.

With ``positions=True`` (a score modifier that reads positions, see
:func:`multihead.scores.shifted`) every call is one rectangle of consecutive positions, whose
first row and key are ``Call.q_start`` and ``Call.k_start`` of the whole attention: full blocks
are joined only where their positions are adjacent too (zigzag rank 0's rows ``0 1 | 6 7`` stay
two calls).
"""

from __future__ import annotations

from typing import NamedTuple

from multihead.blocks import Block, Extent
from multihead.distributed.layout import Piece, pieces
from multihead.masks import BlockState, Mask

__all__ = ["Call", "RingPlan", "plan_ring"]


class Call(NamedTuple):
    """One :func:`multihead.attention` call of a step: local query rows ``[q0, q1)`` x rows
    ``[k0, k1)`` of the keys held at that step, read with ``mask`` (``None``: every key visible).
    ``q_start``/``k_start``: the whole attention's positions of rows ``q0`` and ``k0`` when the
    call's rows and keys are each consecutive positions; ``None`` for a call joined across runs
    that are not (only in plans made without ``positions=True``)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Mask | None
    state: BlockState
    q_start: int | None = None
    k_start: int | None = None

    @property
    def elements(self) -> int:
        """Query-key pairs scored (the work of the call)."""
        return (self.q1 - self.q0) * (self.k1 - self.k0)


class RingPlan(NamedTuple):
    """The plan of one rank: ``calls[s]`` (a tuple of :class:`Call`, empty when step ``s`` is
    skipped), ``recv[s]`` (keys are received from rank ``r - s``) and ``send[s]`` (this rank's
    keys go to rank ``r + s``). Step 0 is local: ``recv[0] = send[0] = False``. ``steps``: the
    steps ``s > 0`` at which *any* rank computes, the same on every rank; all ranks walk them in
    the same order, so the messages between any two ranks are posted in the same order on both
    sides (NCCL matches point-to-point messages by order)."""

    world: int
    rank: int
    calls: tuple[tuple[Call, ...], ...]
    recv: tuple[bool, ...]
    send: tuple[bool, ...]
    steps: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Query-key pairs this rank scores in the forward pass."""
        return sum(c.elements for step in self.calls for c in step)

    @property
    def steps_computed(self) -> int:
        """Ring steps whose block is computed (the others are hidden by the mask and skipped)."""
        return sum(1 for step in self.calls if step)

    @property
    def messages(self) -> int:
        """K/V shards this rank receives in the forward pass (the backward receives as many again
        and sends back as many gradients)."""
        return sum(self.recv)


def plan_ring(
    *,
    world: int,
    rank: int,
    batch: int,
    heads: int,
    q_shard: int,
    kv_shard: int,
    mask: Mask | None,
    layout: str,
    positions: bool = False,
) -> RingPlan:
    """The :class:`RingPlan` of ``rank`` for queries ``(B, Hq, q_shard)`` and keys ``kv_shard``
    per rank, under the global ``mask`` (``None``: everything visible). ``positions``: every call
    covers consecutive positions (module docstring). Pure: no communication."""
    Lq, Lk = q_shard * world, kv_shard * world
    blocks = {}
    reach: dict[Piece, tuple[int, int]] = {}  # a run of queries -> the keys it may see (Mask.key_range)

    def keys_of(q: Piece) -> tuple[int, int]:
        if q not in reach:
            extent = Extent(batch, heads, Lq, Lk)
            reach[q] = (0, Lk) if mask is None else mask.key_range(extent, extent.rows(q.start, q.start + q.length))
        return reach[q]

    def between(rq: int, rk: int) -> tuple[Call, ...]:
        if (rq, rk) not in blocks:
            blocks[(rq, rk)] = _calls(
                pieces(q_shard, rq, world, layout),
                pieces(kv_shard, rk, world, layout),
                mask,
                Lq,
                Lk,
                batch,
                heads,
                positions,
                keys_of,
            )
        return blocks[(rq, rk)]

    calls, recv, send = [], [], []
    for s in range(world):
        calls.append(between(rank, (rank - s) % world))
        recv.append(s > 0 and bool(calls[-1]))
        send.append(s > 0 and bool(between((rank + s) % world, rank)))
    steps = tuple(s for s in range(1, world) if any(between(r, (r - s) % world) for r in range(world)))
    return RingPlan(world, rank, tuple(calls), tuple(recv), tuple(send), steps)


def _calls(
    qp: tuple[Piece, ...],
    kp: tuple[Piece, ...],
    mask: Mask | None,
    Lq: int,
    Lk: int,
    batch: int,
    heads: int,
    positions: bool,
    keys_of,
) -> tuple[Call, ...]:
    """The calls covering queries ``qp`` x keys ``kp``: full blocks joined where they form a
    rectangle of consecutive local rows (and, with ``positions``, consecutive positions),
    partial blocks one call each."""
    joinable = _adjacent if positions else _consecutive
    # A pair outside the keys a run of queries may see is empty without asking the block: with
    # many runs (packed documents, document_layout) most pairs are, and a block's answer costs more.
    state = [[_state(mask, q, k, Lq, Lk, batch, heads, keys_of(q)) for k in kp] for q in qp]
    visible = [(i, j) for i in range(len(qp)) for j in range(len(kp)) if state[i][j] is not BlockState.EMPTY]
    if not visible:
        return ()
    rows = sorted({i for i, _ in visible})
    cols = sorted({j for _, j in visible})
    if (
        len(visible) == len(rows) * len(cols)
        and all(state[i][j] is BlockState.FULL for i, j in visible)
        and joinable(qp, rows)
        and joinable(kp, cols)
    ):
        return (_joined(qp, kp, rows, cols),)
    out = []
    for i in rows:
        js = [j for j in range(len(kp)) if state[i][j] is not BlockState.EMPTY]
        if all(state[i][j] is BlockState.FULL for j in js) and joinable(kp, js):
            out.append(_joined(qp, kp, [i], js))
            continue
        for j in js:
            q, k = qp[i], kp[j]
            shifted = (
                None
                if state[i][j] is BlockState.FULL or mask is None
                else mask.shifted(q.start, k.start, q_len=Lq, kv_len=Lk)
            )
            out.append(
                Call(q.local, q.local + q.length, k.local, k.local + k.length, shifted, state[i][j], q.start, k.start)
            )
    return tuple(out)


def _state(mask, q: Piece, k: Piece, Lq, Lk, batch, heads, reach: tuple[int, int]) -> BlockState:
    if mask is None:
        return BlockState.FULL
    if k.start >= reach[1] or k.start + k.length <= reach[0]:
        return BlockState.EMPTY
    return mask.block_state(
        Extent(batch, heads, Lq, Lk), Block(q.start, q.start + q.length, k.start, k.start + k.length)
    )


def _joined(qp, kp, rows, cols) -> Call:
    q0, q1 = qp[rows[0]].local, qp[rows[-1]].local + qp[rows[-1]].length
    k0, k1 = kp[cols[0]].local, kp[cols[-1]].local + kp[cols[-1]].length
    q_start = qp[rows[0]].start if _adjacent(qp, rows) else None
    k_start = kp[cols[0]].start if _adjacent(kp, cols) else None
    return Call(q0, q1, k0, k1, None, BlockState.FULL, q_start, k_start)


def _consecutive(_pieces, indices) -> bool:
    """Pieces ``indices`` are consecutive local rows."""
    return all(b == a + 1 for a, b in zip(indices, indices[1:]))


def _adjacent(pieces_, indices) -> bool:
    """Pieces ``indices`` are consecutive local rows *and* consecutive positions."""
    return _consecutive(pieces_, indices) and all(
        pieces_[b].start == pieces_[a].start + pieces_[a].length for a, b in zip(indices, indices[1:])
    )
