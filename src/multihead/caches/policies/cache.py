"""``PolicyKVCache``: a call-order cache that keeps what its eviction policy says.

``DynamicKVCache(policy=p)`` builds one. Each KV head holds its own kept tokens, as a rectangle
``(B, H, n, ·)`` in position order, with each token's absolute position beside it (``EMPTY`` pads a
head that holds fewer, after a crop)::

    update(k, v):   candidates = held + new            (B, H, n + Lnew, ·)
                    read       = the candidates         attention over them (CacheRead)
                    keep       = policy.keep(...)       bool (B, H, n + Lnew)
                    held       = candidates[keep]       gathered, position order kept

So every update's attention reads the tokens held before it plus the new ones, and eviction
happens after it: attention over the kept tokens equals full attention with the evicted keys
masked. Until the policy first evicts, the held tokens are every position in order and a read is
contiguous (fast paths see ``causal()``, as with :class:`~multihead.caches.DynamicKVCache`). Once
the heads keep different tokens, a read names each head's positions (``key_positions (B, H, S)``)
and :meth:`~multihead.caches.CacheRead.mask` gives each query head its KV head's mask.

An update writes only past the held tokens (into the room of its storage, which doubles when
full, as :class:`~multihead.caches.DynamicKVCache` grows), and eviction gathers into new tensors,
so a read stays valid after later updates, :meth:`rollback` restores references and the held
count, and under autograd (where updates concatenate) backpropagation through cached steps
works. A policy that ranks keys by attention gets the update's queries from :meth:`observe` (a
layer calls it) and computes the weights a block of query rows at a time
(:func:`~multihead.caches.policies.mass.attention_mass`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead.caches.base import (
    EMPTY_POSITION,
    CacheRead,
    KVCache,
    check_continuation,
    check_crop,
    check_indices,
    check_kv,
    under_autograd,
)
from multihead.caches.policies.base import CachePolicy, Candidates, group_pool
from multihead.caches.policies.mass import attention_mass
from multihead.conventions import repeat_kv
from multihead.inputs import check_tensor

__all__ = ["PolicyKVCache"]

_STATE = ("_k", "_v", "_pos", "_ins", "_score", "_room", "_length", "_prompt_length", "_contiguous")


class PolicyKVCache(KVCache):
    """One layer's kept keys ``(B, H, n, D)`` and values ``(B, H, n, Dv)``, ``H = Hkv`` (or ``Hq``
    for a policy that selects per query head), chosen by ``policy``
    (:class:`~multihead.caches.policies.CachePolicy`).

    Rows share one length (tokens seen); shapes, dtype and device come from the first update.
    :attr:`kept_positions` reports what each head holds.
    """

    places_by_position = False

    def __init__(self, policy: CachePolicy):
        if not isinstance(policy, CachePolicy):
            raise TypeError(
                f"PolicyKVCache: policy must be a multihead.caches.policies.CachePolicy (SinksAndWindow, "
                f"SnapKV, H2O), got {type(policy).__name__}"
            )
        self.policy = policy
        self._clear()

    def _clear(self) -> None:
        """Every field empty, the policy kept."""
        self._k: Tensor | None = None  # (B, H, n, D)
        self._v: Tensor | None = None  # (B, H, n, Dv)
        self._pos: Tensor | None = None  # (B, H, n) absolute positions, EMPTY_POSITION for a hole
        self._ins: Tensor | None = None  # (B, H, n) the slot each key was rotated at (positions="cache")
        self._score: Tensor | None = None  # (B, H, n) accumulated attention (H2O)
        # Storage with room after the held tokens (k, v, pos, ins; capacity >= n), whose first n
        # slots the four above are views of: a step that evicts nothing writes its tokens there
        # in place, as DynamicKVCache does, instead of copying the cache. None: no room (after an
        # eviction, or under autograd).
        self._room: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self._length = 0  # tokens seen
        self._prompt_length = 0  # tokens of the first update (0: none yet)
        self._contiguous = True  # held = positions 0 .. length-1 in order, in every head
        self._heads_in: int | None = None  # Hkv of the updates
        self._queries: tuple[Tensor, float | None] | None = None
        self._undo: tuple[object, ...] | None = None

    # ------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        return self._length

    @property
    def lengths(self) -> Tensor:
        if self._k is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.full((self._k.shape[0],), self._length, dtype=torch.int64, device=self._k.device)

    @property
    def held(self) -> int:
        """Slots held between updates (the widest head's kept tokens)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def kept_positions(self) -> Tensor | None:
        """``(B, H, n)`` int64: the absolute positions each head keeps, ascending, ``-1`` for a
        hole (a head holding fewer); ``None`` before the first update."""
        if self._pos is None:
            return None
        return torch.where(self._pos == EMPTY_POSITION, -1, self._pos)

    @property
    def nbytes(self) -> int:
        held = self._room if self._room is not None else (self._k, self._v, self._pos, self._ins)
        return sum(t.nbytes for t in (*held, self._score) if t is not None)

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        # positions="cache": the slots the new tokens take after the held ones
        start = self.held if self.policy.reassigns_positions else self._length
        return torch.arange(start, start + new, device=device)

    def slots(self, new: int) -> int:
        return self.held + new

    def observe(self, q: Tensor | None, scale: float | None = None) -> None:
        """The queries of the next :meth:`update`, checked against what the cache holds before
        they are kept (a refused call keeps the queries observed before it); ``None`` drops them
        (a layer whose update was refused: the queries were for that update only)."""
        where = "PolicyKVCache.observe"
        if q is None:
            self._queries = None
            return
        check_tensor("q", q, "(B, Hq, Lq, D)", where=where)
        if q.dim() != 4:
            raise ValueError(f"{where}: q must be the queries (B, Hq, Lq, D), got shape {tuple(q.shape)}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
        ):
            raise TypeError(f"{where}: scale must be None (1/sqrt(D)) or a finite number, got {scale!r}")
        if self._k is not None and self._heads_in is not None:
            B, _, _, D = self._k.shape
            Hkv = self._heads_in
            if q.shape[0] != B or q.shape[3] != D or q.shape[1] % Hkv:
                raise ValueError(
                    f"{where}: q must be (B, Hq, Lq, D) = ({B}, a multiple of {Hkv}, Lq, {D}) for the "
                    f"{self._length} tokens held, got {tuple(q.shape)}"
                )
            if q.device != self._k.device:
                raise ValueError(f"{where}: q is on {q.device} but the cache is on {self._k.device}")
        self._queries = (q.detach(), scale)

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        queries = self._check_update(k, v, positions)
        B, _, new, _ = k.shape
        Hq = k.shape[1] if queries is None else queries[0].shape[1]
        heads = Hq if self.policy.per_query_head else k.shape[1]
        k_new, v_new = (repeat_kv(t, heads) if heads != t.shape[1] else t for t in (k, v))  # (B, H, new, ·)
        n, start, device = self.held, self._length, k.device
        new_pos = torch.arange(start, start + new, device=device).expand(B, heads, new)
        new_ins = torch.arange(n, n + new, device=device).expand(B, heads, new)
        # Taken before _candidates, which may replace the room: a rollback restores the room too
        undo = (*(getattr(self, name) for name in _STATE), self._heads_in, self._queries)
        cand_k, cand_v, cand_pos, cand_ins = self._candidates((k_new, v_new, new_pos, new_ins))
        read = self._read(cand_k, cand_v, cand_pos, cand_ins, n, new)
        mass = None
        if queries is not None:
            q, scale = queries
            read_mask = read.mask(None, True, Hq)

            def mass(r0: int, r1: int) -> Tensor:  # (B, Hq, S): attention of rows [r0, r1) per key
                return attention_mass(q, read.keys, read_mask, r0, r1, scale)

        scores = None
        if self.policy.accumulates:
            assert mass is not None  # accumulates implies needs_queries
            earlier = torch.zeros(B, heads, 0, device=device) if self._score is None else self._score
            gained = group_pool(mass(0, new), heads)  # (B, H, S)
            scores = torch.cat([earlier.to(gained.dtype), gained.new_zeros(B, heads, new)], dim=2) + gained
        prompt = start == 0
        prompt_length = new if prompt else self._prompt_length
        candidates = Candidates(cand_pos, start + new, new, prompt, prompt_length, scores, mass, Hq)
        keep = self.policy.keep(candidates)

        self._undo = undo
        self._k, self._v, self._pos, self._ins, self._score = cand_k, cand_v, cand_pos, cand_ins, scores
        self._length, self._prompt_length, self._heads_in, self._queries = start + new, prompt_length, k.shape[1], None
        if not bool(keep.all()):
            self._compact(keep)
            self._contiguous = False
        return read

    def _candidates(self, new: tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
        """The held tokens followed by ``new`` (keys, values, positions, slots): written into the
        room after the held ones when there is room, else into new storage with room to grow
        (doubling); under autograd concatenated (no held tensor is written)."""
        held = (self._k, self._v, self._pos, self._ins)
        n, count = self.held, new[0].shape[2]
        if self._k is None or under_autograd(new[0], new[1], *(t for t in held if t is not None)):
            self._room = None
            return tuple(x if old is None else torch.cat([old, x], dim=2) for old, x in zip(held, new))
        if self._room is None or self._room[0].shape[2] < n + count:
            capacity = max(16, 2 * (n + count))
            room = []
            for old in held:
                assert old is not None  # the cache holds tokens (checked above)
                buffer = old.new_empty(*old.shape[:2], capacity, *old.shape[3:])
                buffer[:, :, :n] = old
                room.append(buffer)
            self._room = (room[0], room[1], room[2], room[3])
        for buffer, x in zip(self._room, new):
            buffer[:, :, n : n + count] = x  # past every earlier read's slots
        return tuple(buffer[:, :, : n + count] for buffer in self._room)

    def _read(self, keys: Tensor, values: Tensor, positions: Tensor, inserted: Tensor, n: int, new: int) -> CacheRead:
        """The candidates as a :class:`CacheRead`: contiguous while nothing was evicted; else each
        key's position (one row for all when every head holds the same ones), with the policy's
        mask; under ``positions="cache"`` the positions are slots and moved keys are rotated."""
        reassign = self.policy.reassigns_positions
        query_positions = torch.arange(n, n + new, device=keys.device) if reassign else positions[0, 0, n:]
        if self._contiguous:
            return CacheRead(keys, values, query_positions, None, policy_mask=self.policy.policy_mask())
        S = keys.shape[2]
        first = positions[0, 0]
        if reassign:  # one set for every head (SinksAndWindow): slots are the positions
            slots = torch.arange(S, device=keys.device)
            keys = self.policy.rotate(keys, slots - inserted[0, 0])
            key_positions = slots
        else:
            key_positions = first if bool((positions == first).all()) else positions
        # Held tokens come before the new ones, in position order: with no hole, and a policy mask
        # that hides nothing from the new queries, causal() says it all.
        policy_mask = self.policy.policy_mask()
        if policy_mask is not None and new and self.policy.hides_nothing(query_positions, key_positions):
            policy_mask = None
        ordered = policy_mask is None and bool((positions != EMPTY_POSITION).all())
        return CacheRead(keys, values, query_positions, key_positions, policy_mask=policy_mask, ordered=ordered)

    def _compact(self, keep: Tensor) -> None:
        """Keep the ``keep (B, H, n)`` entries of every held tensor, in position order, padded
        with holes to the widest head."""
        assert self._pos is not None and self._k is not None and self._v is not None and self._ins is not None
        order_key = torch.where(keep, self._pos, EMPTY_POSITION)
        sorted_key, order = torch.sort(order_key, dim=-1, stable=True)
        width = int(keep.sum(-1).max()) if keep.numel() else 0
        order = order[..., :width]  # (B, H, width)

        def take(t: Tensor) -> Tensor:
            index = order if t.dim() == 3 else order.unsqueeze(-1).expand(*order.shape, t.shape[-1])
            return t.gather(2, index)

        self._k, self._v, self._ins = take(self._k), take(self._v), take(self._ins)
        self._pos = sorted_key[..., :width]
        self._room = None  # fresh tensors, exactly the kept tokens
        if self._score is not None:
            self._score = take(self._score)

    def _check_update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> tuple[Tensor, float | None] | None:
        """Refuse what the cache could not store, positions that do not continue it and missing
        queries, before anything changes; the observed queries when the policy reads them."""
        name = type(self).__name__
        if self._k is None or self._v is None:
            check_kv(name, k, v, sized_by_updates=True)
        else:
            B, _, n, D = self._k.shape
            check_kv(
                name,
                k,
                v,
                batch=B,
                heads=self._heads_in,
                head_dim=D,
                value_dim=self._v.shape[3],
                dtype=self._k.dtype,
                device=self._k.device,
                held=f"{self._length} tokens seen, {n} kept, policy {self.policy!r}",
                sized_by_updates=True,
            )
        if positions is not None:
            check_continuation(name, positions, self.next_positions(k.shape[2], k.device), k.shape[0])
        if not self.policy.needs_queries:
            return None
        if self._queries is None:
            raise ValueError(
                f"{name}.update: {self.policy!r} ranks keys by the attention the queries give them, but no "
                f"queries were observed for this update; hint: call cache.observe(q) with the update's "
                f"(rotated) queries (B, Hq, Lnew, D) first (MultiHeadAttention does)"
            )
        q = self._queries[0]
        B, Hkv, new, D = k.shape
        if q.shape[0] != B or q.shape[2] != new or q.shape[3] != D or q.shape[1] % Hkv:
            raise ValueError(
                f"{name}.update: the observed queries {tuple(q.shape)} do not match the update's keys "
                f"{tuple(k.shape)}: expected (B, Hq, Lnew, D) = ({B}, a multiple of {Hkv}, {new}, {D})"
            )
        if q.device != k.device:
            raise ValueError(f"{name}.update: the observed queries are on {q.device}, the keys on {k.device}")
        held_heads = None if self._k is None else self._k.shape[1]
        if self.policy.per_query_head and held_heads is not None and held_heads != q.shape[1]:
            raise ValueError(
                f"{name}.update: the cache holds {held_heads} heads, one per query head, but the observed "
                f"queries have Hq={q.shape[1]}"
            )
        return self._queries

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        *state, heads_in, queries = self._undo
        self._heads_in, self._queries = heads_in, queries  # type: ignore[assignment]
        for name, value in zip(_STATE, state):
            setattr(self, name, value)
        self._undo = None

    def crop(self, length: int | Tensor) -> None:
        """Keep, of the held tokens, those at positions ``< length``; :attr:`length` becomes
        ``min(length, self.length)`` (a policy that evicted keeps what it had of them)."""
        length = check_crop(type(self).__name__, length, None, per_row=False)
        assert isinstance(length, int)  # per_row=False refuses tensors
        self._undo = None
        if length >= self._length or self._pos is None:
            return
        self._compact((self._pos < length) & (self._pos != EMPTY_POSITION))
        self._length = length
        if length == 0:  # the next update is a prompt again (a prefix of 0 .. n-1 stays in order)
            self._prompt_length, self._contiguous = 0, True

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes the old row ``indices[i]``; the batch becomes ``len(indices)``."""
        if self._k is None:
            raise ValueError(f"{type(self).__name__}.reorder: the cache is empty; nothing to reorder")
        indices = check_indices(type(self).__name__, indices, self._k.shape[0], self._k.device)
        for name in ("_k", "_v", "_pos", "_ins", "_score"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, indices))
        self._undo = self._queries = self._room = None

    def reset(self) -> None:
        self._clear()

    def __repr__(self) -> str:
        return f"PolicyKVCache({self.policy!r}, length={self._length}, held={self.held}, nbytes={self.nbytes})"
