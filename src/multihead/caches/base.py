"""``KVCache``: what an attention layer needs from a key/value cache, and :class:`CacheRead`, what
one update gives back.

The layer projects only the new tokens, rotates their keys at their positions, then calls
:meth:`KVCache.update` and attends over the slots it returns. Positions are *absolute*: the
``i``-th token of a sequence is at position ``i``, whatever slot of the cache holds it. Queries at
positions ``p`` see the keys at positions ``<= p`` (causal), which is the bottom-right
``causal()`` of the whole sequence (see :mod:`multihead.conventions`)::

    3 cached, 2 new:    k0 k1 k2 k3 k4
                   q3    1  1  1  1  .
                   q4    1  1  1  1  1

Among the caches implementing the interface:

* :class:`~multihead.caches.DynamicKVCache`: slot ``j`` holds position ``j``; grows as needed;
* :class:`~multihead.caches.StaticKVCache`: preallocated ``max_len`` slots (slot ``j`` holds
  position ``j``), each batch row with its own length, fixed shapes for ``torch.compile``;
* :class:`~multihead.caches.SlidingWindowKVCache`: a ring buffer keeping the last ``window``
  tokens, for a ``sliding_window(window)`` attention.

The contract every cache keeps (one meaning per name; ``tests/caches/test_contract.py`` checks it
for every kind):

* :attr:`KVCache.lengths`: a ``(B,)`` ``torch.int64`` tensor on the cache's device, the tokens each
  row has *seen* (the position its next token takes), never a Python list;
  :attr:`KVCache.length`: ``max(lengths)`` as a host int (0 when empty).
* :meth:`KVCache.slots` ``(new)``: exactly the ``S`` slots the next :meth:`KVCache.update` of ``new``
  tokens returns, so a tensor mask built over ``slots(Lq)`` columns fits that read.
* :meth:`KVCache.crop` ``(n)``: each row keeps its first ``n`` tokens; a row holding ``n`` or fewer
  keeps them all (as ``row[:n]``). A ``(B,)`` tensor gives each row its own ``n`` (per-row caches).
* :meth:`KVCache.reorder` ``(indices)``: row ``i`` becomes the old row ``indices[i]``; ``len(indices)``
  is the new batch, so beam search may grow or shrink it on every cache.
* Backpropagation through cached steps works on every cache: an update under autograd never writes
  into keys or values that an earlier step's read returned.
* Masks: a mask object is read at absolute positions, a tensor over the ``(Lq, S)`` slots a read
  returns; in a combined mask (``& | ~``) each part keeps its own frame (:meth:`CacheRead.mask`).

A refused update, crop or reorder raises before anything changes. Every cache checks the
``positions`` of an update with one function, :func:`check_continuation`: the new tokens must
continue each row exactly, since slot ``j`` holds position ``j`` (or ``p % capacity`` in a ring).
A cache that keeps only a window of keys (:attr:`KVCache.window`) refuses, through
:func:`check_reach`, a mask that would let a query see keys it no longer holds: the layer asks
(:meth:`KVCache.check_mask`) before the update, and :meth:`CacheRead.mask` asks again. A mask
passed with a cache means what it means without one, or the call fails; never a narrower attention.
:meth:`KVCache.rollback` undoes the last update (a layer whose attention call fails after the
update calls it).
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from multihead.backends.decode_blocks import KVBlocks
from multihead.blocks import Block, Extent
from multihead.inputs import check_positions, check_tensor
from multihead.masks import BlockState, Mask, at_new_tokens, head_range
from multihead.masks import causal as causal_mask
from multihead.masks.base import UNBOUNDED, And, Not, Or

__all__ = [
    "KVCache",
    "CacheRead",
    "check_kv",
    "check_indices",
    "check_rows",
    "check_writable",
    "check_crop",
    "check_continuation",
    "check_reach",
    "check_mask_parts",
    "check_prefix",
    "under_autograd",
    "EMPTY_POSITION",
]

#: The position of a slot that holds no token: no query position reaches it, so a causal or
#: window mask at absolute positions never shows it.
EMPTY_POSITION = 1 << 62


class CacheRead:
    """What :meth:`KVCache.update` returns: the slots to attend over and where their tokens sit.

    ``keys (B, Hkv, S, D)``, ``values (B, Hkv, S, Dv)``: ``S`` slots, the new tokens included.
    ``query_positions``: ``(Lq,)`` or ``(B, Lq)``, the absolute positions of the new tokens.
    ``key_positions``: ``(S,)`` or ``(B, S)``, the absolute position of the token in each slot
    (:data:`EMPTY_POSITION` for an empty slot); ``None`` when slot ``j`` holds position ``j`` and
    every slot is filled (then the new tokens are the last ``Lq`` slots, rows alike).
    ``window``: the cache keeps only the ``window`` keys before each query: a query sees
    positions ``p - window .. p`` and no older one (``None``: no limit).
    ``blocks``: the same slots as a :class:`~multihead.backends.decode_blocks.KVBlocks` that a
    decode step reads a piece at a time (pages through their block table, quantized slots
    dequantized a piece at a time); then ``keys`` and ``values`` may be left ``None`` and are
    built from it (:meth:`KVBlocks.dense`) the first time they are read.
    ``key_positions`` may also be ``(B, Hkv, S)``: each KV head keeps its own tokens (an eviction
    policy, :mod:`multihead.caches.policies`); the mask then differs per KV head and is given per
    query head through the grouped mapping (:func:`~multihead.conventions.kv_head_of`).
    ``policy_mask``: a mask object at positions that an eviction policy adds to every call's mask
    (sinks + window: ``sliding_window(w) | key_padding(s)``), ``None`` for none.
    ``ordered``: every slot holds a token, in position order, the new tokens last and every other
    one before them (an eviction policy's read with no hole): with no call mask, the causal rule
    over the slots is then ``causal()`` itself, and the read gives that object (fast paths).
    ``held``: a ``range`` of host ints, for a read of one new token at position ``held[-1]``: the
    slots hold exactly these positions, each in one slot (any order), every row alike, the other
    slots empty (``key_positions`` says which slot holds which). A ring sets it, so that
    :meth:`mask` can decide on the host which of them the query sees: every slot (a full ring
    under its window) needs no mask at all, a range of positions two comparisons.
    """

    __slots__ = (
        "_keys",
        "_values",
        "query_positions",
        "key_positions",
        "window",
        "blocks",
        "policy_mask",
        "ordered",
        "held",
    )

    def __init__(
        self,
        keys: Tensor | None,
        values: Tensor | None,
        query_positions: Tensor,
        key_positions: Tensor | None = None,
        window: int | None = None,
        blocks: KVBlocks | None = None,
        policy_mask: Mask | None = None,
        ordered: bool = False,
        held: range | None = None,
    ):
        if (keys is None or values is None) and blocks is None:
            raise ValueError("CacheRead: keys and values may be None only with blocks to build them from")
        self._keys, self._values = keys, values
        self.query_positions, self.key_positions, self.window, self.blocks = (
            query_positions,
            key_positions,
            window,
            blocks,
        )
        self.policy_mask, self.ordered, self.held = policy_mask, ordered, held

    @property
    def keys(self) -> Tensor:
        """``(B, Hkv, S, D)``; with :attr:`blocks` and no keys given, built densely on first use."""
        if self._keys is None:
            assert self.blocks is not None  # __init__ refuses a read with neither
            self._keys, self._values = self.blocks.dense()
        return self._keys

    @property
    def values(self) -> Tensor:
        """``(B, Hkv, S, Dv)``; built with :attr:`keys` when only blocks were given."""
        if self._values is None:
            self.keys  # noqa: B018 - builds both
        assert self._values is not None
        return self._values

    @property
    def batch(self) -> int:
        """``B``, without building dense keys."""
        return self.blocks.shape[0] if self._keys is None and self.blocks is not None else self.keys.shape[0]

    @property
    def slots(self) -> int:
        """``S``, without building dense keys."""
        return self.blocks.shape[2] if self._keys is None and self.blocks is not None else self.keys.shape[2]

    @property
    def contiguous(self) -> bool:
        """Whether slot ``j`` holds position ``j`` (no ``key_positions`` table)."""
        return self.key_positions is None

    def mask(self, mask: Mask | Tensor | None, causal: bool, heads: int = 1) -> Mask | Tensor | None:
        """The mask of the attention over these slots: the call's ``mask``, the causal rule if
        ``causal``, the cache's window, and no empty slot.

        One rule, part by part. A mask object means the same thing whatever the cache: it is read
        on the square attention of the whole sequence, at the tokens' absolute positions. A tensor
        (a bool tensor, or a mask holding one: ``TensorMask``, a tensor read ``.shifted``/``.at``)
        is over the call's ``(Lq, S)`` slots as returned (``S = cache.slots(Lq)``). A combined
        mask (``&``, ``|``, ``~``) applies the rule to each of its parts, so in
        ``document(ids) & t`` the ids are read at positions and ``t`` over the slots: a tensor
        never moves the other parts to the slots. A token tree placed bottom-right
        (:func:`~multihead.masks.tree`) is the call's last ``T`` new tokens in every row
        (:func:`~multihead.masks.at_new_tokens`), however many slots the read has. With a
        ``window``, the parts at positions (and ``causal``) must not let a query see further back
        than the window (:func:`check_reach`): a tensor part cannot bound it. A contiguous read
        keeps mask objects (fast paths see ``causal()``); other reads give a bool tensor
        ``(B|1, heads|1, Lq, S)``, small for the decode steps such caches serve, or ``None`` where
        the read's :attr:`held` positions show on the host that its query sees every slot (a full
        ring under its window; a ring that is not full, or keeps ``extra`` slots, gets its row mask
        from two comparisons of the slots' positions). ``heads`` is ``Hq``, for masks that differ
        per head.
        """
        if isinstance(mask, Mask):  # a token tree's nodes are this call's new tokens, whatever the slots
            mask = at_new_tokens(mask, self.query_positions)
        # the held positions of a one-token read: its query at held[-1], read on the host (eager:
        # a traced step keeps one graph, with the row mask evaluated in it)
        one = self.query_positions.shape[-1] == 1 and not torch.compiler.is_compiling()
        held = self.held if self.held and one else None
        if self.window is not None:  # a ring: refuse a mask reaching keys it no longer holds
            queries = self.query_positions if held is None else [held[-1]]
            check_reach("CacheRead.mask", mask, causal, self.window, queries)
        if self.policy_mask is not None:  # the policy's rule: an approximation the user chose
            mask = self.policy_mask if mask is None else mask & self.policy_mask
        if mask is None and self.ordered and self.window is None:
            return causal_mask() if causal else None  # every earlier slot holds an earlier position
        if self.key_positions is not None and self.key_positions.dim() == 3:
            return self._mask_per_kv_head(mask, causal, heads)
        Lq, S = self.query_positions.shape[-1], self.slots
        whole = _whole_length(mask, S) if isinstance(mask, Mask) else S
        if isinstance(mask, Mask) and _covered(mask) is not None and not torch.compiler.is_compiling():
            # Parts over fewer positions than the tokens (ids, a block_select table for the prompt
            # only) cannot say what the later tokens see. Checked here for every read: a contiguous
            # one (slot j = position j) left it to the attention call's check, which the decode
            # path over a cache's blocks (QuantizedKVCache) skips: its rows read as fully masked.
            reach = S - 1 if self.contiguous else int(self.query_positions.max())
            if reach >= whole:
                raise ValueError(
                    f"mask {mask._describe()} covers {whole} positions, but the cache's new tokens reach "
                    f"position {reach}; build it over the whole sequence"
                )
        if held is not None:  # (causal or not: every slot holds a position up to the query's)
            decided, visible = self._on_host(mask, held, whole, heads)
            if decided:
                return visible
        if self.contiguous:
            if isinstance(mask, Mask) and (S > Lq or whole != S):
                # the sequence's square, at the new tokens (the last Lq slots)
                mask = _place(mask, lambda m: m.shifted(S - Lq, 0, q_len=whole, kv_len=whole))
            if not causal:
                return mask
            return causal_mask() if mask is None else mask & causal_mask()
        key_positions = self.key_positions
        assert key_positions is not None  # not contiguous
        # the batch dim named, not -1: a read of zero new tokens (Lq = 0) has no size to infer it from
        qp = self.query_positions
        q = qp.view(qp.shape[0] if qp.dim() == 2 else 1, 1, Lq, 1)  # (B|1, 1, Lq, 1)
        kv = key_positions.view(key_positions.shape[0] if key_positions.dim() == 2 else 1, 1, 1, S)  # (B|1, 1, 1, S)
        stored = kv != EMPTY_POSITION
        allowed = stored & (kv <= q) if causal else stored
        if self.window is not None:
            allowed = allowed & (kv >= q - self.window)
        if isinstance(mask, Mask):
            kv_read = torch.where(key_positions == EMPTY_POSITION, 0, key_positions)  # empty: hidden, read anywhere
            q_read = self.query_positions
            placed = _place(mask, lambda m: m.at(q_read, kv_read, q_len=whole, kv_len=whole))  # square
            allowed = allowed & placed.materialize(self.batch, heads, Lq, S, q.device)
        elif isinstance(mask, Tensor):
            allowed = allowed & (mask if mask.dtype == torch.bool else mask != float("-inf"))
        return allowed

    def _on_host(self, mask: Mask | Tensor | None, held: range, whole: int, heads: int) -> tuple[bool, Tensor | None]:
        """The mask of the one query of a read with :attr:`held` positions, decided on the host
        where it can be: the query sees the positions from its window's start (or the oldest held)
        to its own when ``mask`` (an object at positions, or none) shows all of them, as its own
        ``block_state`` says (what the backends ask it). Then ``(True, None)`` when that is every
        slot, else ``(True, visible)``, the row mask ``(1, 1, 1, S)`` from two comparisons of the
        slots' positions. ``(False, None)``: evaluate the mask (a tensor part is over the slots;
        a mask that hides part of the range)."""
        if mask is not None and (not isinstance(mask, Mask) or _call_frame(mask)):
            return False, None
        p = held[-1]  # the query's position
        lo = held.start if self.window is None else max(held.start, p - self.window)
        if mask is not None:
            n = max(whole, p + 1)  # the square of the whole sequence the mask is read on
            state = mask.block_state(Extent(self.batch, heads, n, n), Block(p, p + 1, lo, p + 1))
            if state is not BlockState.FULL:
                return False, None
        if lo == held.start and len(held) == self.slots:  # every slot holds one of them
            return True, None
        kp = self.key_positions
        if kp is None or kp.dim() != 1:
            return False, None
        return True, ((kp >= lo) & (kp <= p)).view(1, 1, 1, -1)  # an empty slot's position is past p

    def _mask_per_kv_head(self, mask: Mask | Tensor | None, causal: bool, heads: int) -> Tensor:
        """:meth:`mask` of a read whose KV heads keep their own tokens (``key_positions (B, Hkv,
        S)``): each KV head's mask from its own positions, read by the query heads of its group:
        a bool ``(B, heads, Lq, S)``."""
        key_positions = self.key_positions
        assert key_positions is not None and key_positions.dim() == 3  # the caller checked
        B, Hkv, S = key_positions.shape
        per_kv = [
            CacheRead(self.keys[:, h : h + 1], self.values[:, h : h + 1], self.query_positions, key_positions[:, h])
            for h in range(Hkv)
        ]
        if heads < Hkv or heads % Hkv:
            raise ValueError(
                f"CacheRead.mask: each of the {Hkv} KV heads keeps its own tokens, so heads must be the "
                f"query heads Hq, a multiple of {Hkv}; got heads={heads}"
            )
        group = heads // Hkv  # query heads of one KV head (contiguous groups: kv_head_of)
        parts = []
        for h, read in enumerate(per_kv):
            own: Mask | Tensor | None = mask
            if isinstance(mask, Mask):
                own = head_range(mask, h * group, group, heads)  # this group's query heads
            elif isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1] > 1:
                own = mask[:, h * group : (h + 1) * group]
            allowed = read.mask(own, causal, group)
            assert isinstance(allowed, Tensor)  # not contiguous: a bool tensor
            parts.append(allowed.expand(B, group, allowed.shape[2], S))
        return torch.cat(parts, dim=1)  # (B, Hkv·group, Lq, S)


class KVCache(abc.ABC):
    """One attention layer's keys and values for the tokens seen so far.

    A subclass stores them as it likes but answers the same questions. Every mutating method
    validates its inputs first: a refused call leaves the cache as it was.
    """

    #: The keys a query finds before it: positions ``p - window .. p`` and no older one (``None``:
    #: every earlier key). Only a ring (:class:`~multihead.caches.SlidingWindowKVCache`) sets it.
    window: int | None = None
    #: Whether a row's slots follow its positions (static, sliding, paged: ``update`` places the
    #: tokens by position and a layer hands it the positions it was given). ``False``: the cache
    #: keeps call order, every update after the last (dynamic, latent); a layer then hands the
    #: positions it was given to the rotary embedding only (left-padded prompts, offsets), and
    #: reads masks in call order. Either way ``update(..., positions)`` called directly refuses
    #: positions that do not continue the cache.
    places_by_position: bool = True

    def check_mask(self, mask: object, causal: bool, new: int) -> None:
        """Refuse a ``mask`` (with the causal rule if ``causal``) that would let one of the next
        ``new`` queries see keys older than this cache keeps (:func:`check_reach`). A layer calls
        it before :meth:`update`, so a refused mask changes nothing; a cache without a
        :attr:`window` accepts every mask here. Also refused: a mask object whose own tensors
        (document ids, a ``block_select`` table) cover fewer positions than the next ``new``
        tokens reach; :meth:`CacheRead.mask` refuses it too, but after the update, which a
        rollback restores only as far as reads see."""
        if self.window is not None:
            check_reach(type(self).__name__, mask, causal, self.window, self._reach_positions(new))
        if isinstance(mask, Mask) and new > 0 and not torch.compiler.is_compiling():
            covered = _covered(mask)
            reach = int(self.next_positions(new).max()) if covered is not None else -1
            if covered is not None and reach >= covered:
                raise ValueError(
                    f"{type(self).__name__}: mask {mask._describe()} covers {covered} positions, but the "
                    f"cache's new tokens reach position {reach}; build it over the whole sequence"
                )

    def _reach_positions(self, new: int) -> Tensor | Sequence[int]:
        """The next ``new`` tokens' positions for :func:`check_reach`: a cache knowing them on the
        host (rows alike) gives ints, which spares reading a tensor back."""
        return self.next_positions(new)

    def observe(self, q: Tensor | None, scale: float | None = None) -> None:
        """Hand the cache the rotated queries ``q (B, Hq, Lq, D)`` of the next :meth:`update`
        (and the call's ``scale``, default ``1/sqrt(D)``). A cache whose eviction policy ranks keys
        by the attention they receive (:mod:`multihead.caches.policies`: SnapKV, H2O) needs them; a
        layer calls this before every update, and other caches ignore it. ``None`` drops the
        queries observed: a layer whose update was refused withdraws them, so the refused call
        leaves the cache as it was."""
        return None  # a cache that keeps every token has no use for them

    @property
    @abc.abstractmethod
    def lengths(self) -> Tensor:
        """``(B,)`` ``torch.int64`` on the cache's device: the tokens each row has seen, which is the
        position its next token takes (FlashAttention's ``cache_seqlens``). The same type on every
        cache, so a serving loop reads it without asking which kind it holds, and reading it never
        waits for the device. It is a copy on every cache: writing into it changes nothing (change
        lengths through :meth:`crop`, :meth:`reorder`, :meth:`reset`). A ring
        (:class:`~multihead.caches.SlidingWindowKVCache`) counts the tokens seen, not the ones it
        still holds. ``(0,)`` while a cache that learns its batch from the first update is empty."""

    @property
    def length(self) -> int:
        """``max(lengths)``: the tokens the longest row has seen, a host int (0 when empty). Every
        row holds as many in a cache of one length for all (dynamic, latent, sliding: there
        ``lengths`` is ``length`` repeated). Caches that keep lengths on the device override this
        to avoid reading it back where they know it on the host."""
        lengths = self.lengths
        return int(lengths.max()) if lengths.numel() else 0

    @abc.abstractmethod
    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        """The absolute positions ``(new,)`` or ``(B, new)`` the next ``new`` tokens will take."""

    @abc.abstractmethod
    def slots(self, new: int) -> int:
        """``S``: exactly the number of slots the next :meth:`update` of ``new`` tokens returns
        (``read.keys.shape[2]``), in the mode it will run in; build a tensor mask over
        ``slots(Lq)`` columns for that call."""

    @abc.abstractmethod
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        """Store the keys ``k (B, Hkv, Lnew, D)`` and values ``v (B, Hkv, Lnew, Dv)`` of ``Lnew``
        new tokens at ``positions`` (default :meth:`next_positions`) and return every slot to
        attend over (:class:`CacheRead`)."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """Undo the last :meth:`update` (once): a layer whose attention call fails after it."""

    def check_owner(self, layer: object, where: str) -> None:
        """Refuse ``layer`` writing into this cache while it holds another layer's tokens (the ones
        of the last layer to :meth:`claim` it). One cache passed to every layer of a model has the
        same shapes at each, so nothing else notices: the second layer then attended over the
        first layer's keys as if they were earlier tokens. Eager only; an empty cache (after
        :meth:`reset`, ``crop(0)``) may go to any layer, and so may one whose layer no longer
        exists (a model rebuilt around its caches)."""
        owner = getattr(self, "_owner", None)
        if owner is None or torch.compiler.is_compiling():
            return
        held = owner()
        if held is None or held is layer or not self.length:
            return
        raise ValueError(
            f"{where}: kv_cache holds the keys and values of another layer ({type(held).__name__}), "
            f"{self.length} tokens; each "
            f"attention layer needs a cache of its own (one per layer, e.g. a list of caches); hint: "
            f"reset() it before handing it to another layer"
        )

    def claim(self, layer: object) -> None:
        """Record ``layer`` as the one whose tokens this cache holds (:meth:`check_owner`): a
        layer calls it after each update it keeps. Held by weak reference; eager only, as the check."""
        if torch.compiler.is_compiling():
            return
        owner = getattr(self, "_owner", None)
        if owner is None or owner() is not layer:
            self._owner = weakref.ref(layer)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("_owner", None)  # a weak reference does not pickle; a copy is unclaimed
        return state

    def undo_record(self) -> object:
        """What :meth:`rollback` would undo now (opaque). A caller that updates and then rolls back
        (a layer's ``explain()``, a call that fails after the update) takes it before the update
        and hands it back with :meth:`restore_undo_record` after the rollback, so the cache ends
        as it was, its own last update still undoable. A cache keeping its record in ``_undo``
        (every cache here) needs no override."""
        return getattr(self, "_undo", None)

    def restore_undo_record(self, record: object) -> None:
        """Make ``record``, from :meth:`undo_record` before an update that was rolled back since,
        what :meth:`rollback` undoes again."""
        if hasattr(self, "_undo"):
            self._undo = record

    @abc.abstractmethod
    def crop(self, length: int | Tensor) -> None:
        """Keep each row's first ``length`` tokens and forget the rest: speculative decoding drops
        rejected tokens this way. A row holding ``length`` tokens or fewer keeps them all (as
        ``row[:length]``), so ``crop(n)`` caps every row at ``n`` on every cache, whatever the rows
        hold. A ``(B,)`` integer tensor gives each row its own ``length`` (caches with one length
        per row: static, paged); an int equals that tensor filled with it. Refused before any
        change: a negative length, and going back further than a ring holds."""

    @abc.abstractmethod
    def reorder(self, indices: Tensor) -> None:
        """Batch row ``i`` becomes the old row ``indices[i]`` (beam search); ``indices (B',)``. Every
        cache takes any ``B' >= 1``: the batch grows or shrinks to ``B'`` (one prompt row fanned
        out to beams, finished beams dropped); rows may repeat."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every token."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held for keys, values and bookkeeping (allocated, whether filled or not)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length}, nbytes={self.nbytes})"


# ------------------------------------------------------------------------------------ checks
def check_kv(
    cache: str,
    k: Tensor,
    v: Tensor,
    *,
    batch: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    value_dim: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    held: str = "",
    stored: Tensor | None = None,
    sized_by_updates: bool = False,
) -> None:
    """Refuse keys/values the cache could not store. ``k (B, Hkv, Lnew, D)``, ``v (B, Hkv, Lnew, Dv)``
    must be 4-D tensors of one dtype and device agreeing on ``B, Hkv, Lnew``, and agree with what
    the cache holds where given (``held`` describes it for messages). ``stored``: the buffer the
    update writes into, refused while it is an inference tensor and inference mode is off.
    ``sized_by_updates``: the cache takes its shapes, dtype and device from the first update after
    a ``reset()`` (dynamic caches), so the hint may say so; a cache allocated up front keeps them
    through ``reset()``, and the hint says what to change instead."""
    where = f"{cache}.update"
    check_writable(where, stored)
    for name, t, last in (("k", k, "D"), ("v", v, "Dv")):
        check_tensor(name, t, f"(B, Hkv, Lnew, {last})", where=where)
        if t.dim() != 4:
            raise ValueError(
                f"{where}: {name} must have 4 dims (B, Hkv, Lnew, {last}), got shape {tuple(t.shape)}; "
                f"hint: split the heads first, (B, Lnew, Hkv·{last}) -> (B, Hkv, Lnew, {last})"
            )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{where}: k and v must agree on (B, Hkv, Lnew), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.dtype != v.dtype:
        raise TypeError(f"{where}: k and v must share a dtype, got {k.dtype} and {v.dtype}")
    if k.device != v.device:
        raise ValueError(f"{where}: k and v must be on one device, got {k.device} and {v.device}")
    if sized_by_updates:
        hint = "; hint: use one cache per layer, and reset() it before a sequence of another shape, dtype or device"
    else:  # reset() empties an allocated cache but keeps its buffers: their shape, dtype and device
        hint = (
            "; hint: use one cache per layer; this cache was allocated with that shape, dtype and device, and "
            "reset() keeps them: build a new cache for another shape"
        )
    for what, got, expected in (
        ("B", k.shape[0], batch),
        ("Hkv", k.shape[1], heads),
        ("D", k.shape[3], head_dim),
        ("Dv", v.shape[3], value_dim),
    ):
        if expected is not None and got != expected:
            raise ValueError(
                f"{where}: new keys/values have {what}={got} but the cache holds {what}={expected} "
                f"({held}; got k {tuple(k.shape)}, v {tuple(v.shape)}){hint}"
            )
    if dtype is not None and k.dtype != dtype:
        to = f"pass k.to({dtype}) and v.to({dtype})"
        raise TypeError(
            f"{where}: new keys/values have dtype {k.dtype} but the cache holds {dtype} ({held}); hint: "
            + (
                f"{to}, or reset() the cache: its next update sets the dtype"
                if sized_by_updates
                else f"{to}, or build the cache with dtype={k.dtype} (reset() keeps the dtype it was built with)"
            )
        )
    if device is not None and k.device != torch.device(device):
        to = f"pass k.to({str(device)!r}) and v.to({str(device)!r})"
        raise ValueError(
            f"{where}: new keys/values are on {k.device} but the cache is on {device} ({held}); hint: "
            + (
                f"{to}, or reset() the cache: its next update sets the device"
                if sized_by_updates
                else f"{to}, or build the cache with device={str(k.device)!r} (reset() keeps its device)"
            )
        )


def check_kv_held(
    cache: str, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, *, held: str, sized_by_updates: bool = False
) -> None:
    """:func:`check_kv` against what a cache holds, read from its buffers: ``keys (B, Hkv, S, D)``,
    the buffer the update writes into, and ``values (B, Hkv, S, Dv)`` (the one reading of a cache's
    shapes, dtype and device that every cache of one rectangle per row shares)."""
    B, Hkv, _, D = keys.shape
    check_kv(
        cache,
        k,
        v,
        batch=B,
        heads=Hkv,
        head_dim=D,
        value_dim=values.shape[3],
        dtype=keys.dtype,
        device=keys.device,
        held=held,
        stored=keys,
        sized_by_updates=sized_by_updates,
    )


def check_writable(where: str, stored: Tensor | None) -> None:
    """Refuse to write into ``stored``, a cache's buffer, while it is an inference tensor and
    inference mode is off. PyTorch refuses the write itself, but only when it comes: after a
    cache has started changing (pages claimed, the undo record replaced, keys written and values
    not). A cache calls this before any change."""
    if (
        stored is not None
        and not torch.compiler.is_compiling()
        and stored.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        raise RuntimeError(
            f"{where}: the cache's buffers were allocated under torch.inference_mode(), and PyTorch "
            f"allows no in-place write to them outside it (inference mode is off here); "
            f"hint: make every call that updates this cache under torch.inference_mode(), or use "
            f"torch.no_grad() for all of them (a cache created and first updated outside "
            f"inference mode may be used inside it)"
        )


def check_readable(where: str, name: str, t: Tensor, expected: str) -> None:
    """Refuse a tensor whose values must be read (indices, lengths, rows) on the ``meta`` device: it
    has a shape and no values, and PyTorch's own error ("Tensor.item() cannot be called on meta
    tensors") names neither the argument nor what to pass."""
    if t.device.type == "meta":
        raise ValueError(
            f"{where}: {name} is on the meta device (a shape without values), got {t.dtype} of shape "
            f"{tuple(t.shape)}; expected {expected} with values (on the CPU or the cache's device)"
        )


def check_indices(cache: str, indices: object, batch: int, device: torch.device | str | None) -> Tensor:
    """``indices`` of :meth:`KVCache.reorder`: a 1-D integer tensor (or list) of rows in ``[0, batch)``."""
    where = f"{cache}.reorder"
    if isinstance(indices, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise TypeError(f"{where}: indices must be ints, got {indices!r}")
        indices = torch.tensor(indices, dtype=torch.int64)
    if (
        not isinstance(indices, Tensor)
        or indices.is_floating_point()
        or indices.dtype == torch.bool
        or indices.is_complex()
        or indices.dim() != 1
    ):
        got = (
            f"dtype {indices.dtype}, shape {tuple(indices.shape)}"
            if isinstance(indices, Tensor)
            else type(indices).__name__
        )
        raise TypeError(f"{where}: indices must be a 1-D integer tensor of batch rows (beam search), got {got}")
    check_readable(where, "indices", indices, "a 1-D integer tensor of batch rows")
    if indices.numel() == 0:
        raise ValueError(f"{where}: indices select no row; expected at least one row in [0, {batch})")
    if not torch.compiler.is_compiling():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= batch:
            raise ValueError(f"{where}: indices must be rows in [0, {batch}), got values in [{low}, {high}]")
    return indices.to(device=device, dtype=torch.int64)


def check_rows(where: str, rows: object, batch: int) -> list[int]:
    """Batch rows named by the caller (``PagedKVCache.release``): an int, a sequence of ints or a
    0-/1-D integer tensor, each in ``[0, batch)``; none is allowed. A bool tensor or list is
    refused, not read as indices: ``tensor([False, True])`` would name rows 0 and 1, the opposite of
    the row a "finished" mask means."""
    hint = "hint: pass the rows' indices, e.g. finished.nonzero().flatten() for a bool mask"
    if isinstance(rows, Tensor):
        if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex() or rows.dim() > 1:
            raise TypeError(
                f"{where}: rows must be an int, a sequence of ints or a 1-D integer tensor, got a tensor "
                f"of dtype {rows.dtype}, shape {tuple(rows.shape)}; {hint}"
            )
        check_readable(where, "rows", rows, "the rows' indices")
        ids = [int(r) for r in rows.reshape(-1).tolist()]
    elif isinstance(rows, (str, bytes)) or isinstance(rows, bool) or not isinstance(rows, (int, list, tuple, range)):
        raise TypeError(f"{where}: rows must be an int, a sequence of ints or a 1-D integer tensor, got {rows!r}")
    else:
        given = [rows] if isinstance(rows, int) else list(rows)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in given):
            raise TypeError(f"{where}: rows must be ints, got {rows!r}; {hint}")
        ids = given
    bad = [r for r in ids if not 0 <= r < batch]
    if bad:
        raise ValueError(f"{where}: rows must be in [0, {batch}), got {bad}")
    return ids


def check_crop(cache: str, length: object, batch: int | None, *, per_row: bool = True) -> int | Tensor:
    """``length`` of :meth:`KVCache.crop`: a non-negative int, or (``per_row``: a cache with one
    length per row) a ``(B,)`` integer tensor."""
    where = f"{cache}.crop"
    if isinstance(length, bool) or not isinstance(length, (int, Tensor)):
        expected = "an int or a (B,) integer tensor" if per_row else "an int"
        raise TypeError(f"{where}: length must be {expected}, got {type(length).__name__}")
    if isinstance(length, Tensor) and not per_row:
        raise TypeError(
            f"{where}: every row has the same length here, so length must be an int, got a tensor of shape "
            f"{tuple(length.shape)}; hint: crop(n) caps every row at n (StaticKVCache and PagedKVCache "
            f"take one length per row)"
        )
    if isinstance(length, int):
        if length < 0:
            raise ValueError(f"{where}: length must be >= 0, got {length}")
        return length
    if (
        length.is_floating_point()
        or length.dtype == torch.bool
        or length.dim() != 1
        or (batch is not None and length.shape[0] != batch)
    ):
        raise TypeError(
            f"{where}: a length tensor must be integers of shape (B,) = ({batch},), got dtype "
            f"{length.dtype}, shape {tuple(length.shape)}"
        )
    check_readable(where, "length", length, f"a (B,) = ({batch},) integer tensor")
    if not torch.compiler.is_compiling() and length.numel() and int(length.min()) < 0:
        raise ValueError(f"{where}: lengths must be >= 0, got {length.tolist()}")
    return length


def _call_frame(mask: Mask) -> bool:
    """A mask holding a dense tensor somewhere (over the call's slots in some part)."""
    return "tensor" in mask.kinds()


def _place(mask: Mask, at_positions: Callable[[Mask], Mask]) -> Mask:
    """``mask`` with each part free of tensors replaced by ``at_positions(part)`` (read at the
    tokens' positions) and each part holding a tensor left over the slots; ``&``, ``|``, ``~`` are
    split so that every part keeps its own frame."""
    if not _call_frame(mask):
        return at_positions(mask)
    if isinstance(mask, And):
        return And(*(_place(p, at_positions) for p in mask.parts))
    if isinstance(mask, Or):
        return Or(*(_place(p, at_positions) for p in mask.parts))
    if isinstance(mask, Not):
        return Not(_place(mask.inner, at_positions))
    return mask  # a tensor (TensorMask, or one read .shifted/.at): over the slots


def _position_parts(mask: Mask) -> list[Mask]:
    """The largest parts of ``mask`` holding no tensor: the ones read at positions."""
    if not _call_frame(mask):
        return [mask]
    if isinstance(mask, (And, Or)):
        return [q for p in mask.parts for q in _position_parts(p)]
    if isinstance(mask, Not):
        return _position_parts(mask.inner)
    return []


def _slot_parts(mask: Mask) -> list[Mask]:
    """The parts of ``mask`` holding a tensor: the ones over the call's slots."""
    if not _call_frame(mask):
        return []
    if isinstance(mask, (And, Or)):
        return [q for p in mask.parts for q in _slot_parts(p)]
    if isinstance(mask, Not):
        return _slot_parts(mask.inner)
    return [mask]


def _reach_bound(mask: Mask) -> Mask | None:
    """A mask at positions that lets every query see at least what ``mask`` lets it see (a tensor
    part may open any slot), or ``None`` when nothing at positions bounds it."""
    if not _call_frame(mask):
        return mask
    if isinstance(mask, And):
        bounds = [b for b in (_reach_bound(p) for p in mask.parts) if b is not None]
        return None if not bounds else bounds[0] if len(bounds) == 1 else And(*bounds)
    if isinstance(mask, Or):
        parts = [_reach_bound(p) for p in mask.parts]
        return None if any(b is None for b in parts) else Or(*(b for b in parts if b is not None))
    return None  # a tensor, or the complement of a mask holding one: unbounded


def _covered(mask: Mask) -> int | None:
    """The positions the parts of ``mask`` at positions cover by their own tensors (document ids,
    a block_select table), ``None`` where none has a length of its own."""
    extents = [e for part in _position_parts(mask) for e in part.extent() if e is not None]
    return max(extents) if extents else None


def _whole_length(mask: Mask, slots: int) -> int:
    """The length of the whole sequence the parts of a mask at positions are read in: what their
    own tensors cover (document ids, ...), else the slots (a square; bottom-right then reads as
    top-left). Tensor parts are over the slots and do not count."""
    extents = [e for part in _position_parts(mask) for e in part.extent() if e is not None]
    return max(extents, default=0) or slots


def check_mask_parts(layer: str, mask: Mask, batch: int, heads: int, q_len: int, slots: int) -> None:
    """A layer's check of a call mask with a cache, part by part (:meth:`CacheRead.mask`'s rule):
    tensor parts against the read's ``(B, H, Lq, S)``, parts at positions against ``B`` and ``H``
    only (the whole sequence's lengths are theirs)."""
    for part in _position_parts(mask):
        part.check(Extent(batch, heads, None, None))
    for part in _slot_parts(mask):
        try:
            part.check(Extent(batch, heads, q_len, slots))
        except ValueError as exc:
            raise ValueError(
                f"{layer}: with a cache, a tensor in the mask is over the (Lq, S) = ({q_len}, {slots}) "
                f"slots the cache returns, not at positions: {exc}; hint: build it over "
                f"cache.slots(Lq) columns before the call, or use a mask object (read at positions)"
            ) from exc


def check_continuation(cache: str, positions: object, expected: Tensor, batch: int) -> None:
    """The ``positions`` given to :meth:`KVCache.update`, checked the same way by every cache: an
    integer tensor ``(new,)`` or ``(B, new)`` that continues each row exactly, i.e. equals
    ``expected`` ``(new,)`` or ``(B, new)`` (the cache's :meth:`~KVCache.next_positions`). Slot
    ``j`` holds position ``j`` (a ring: ``j % capacity``), so a position that skips would leave an
    empty slot and one that goes back would overwrite a kept token (and rotary keys would sit at
    one position, stored at another). The value comparison reads the tensors: eager only."""
    new = expected.shape[-1]
    positions = check_positions(
        f"{cache}.update",
        positions,
        ((new,), (batch, new)),
        None,  # (compared on the cache's device below)
        expected=f"({new},) or ({batch}, {new}) (one per new token)",
        hint="leave positions=None and the cache continues each row itself",
    )
    if torch.compiler.is_compiling():
        return
    want = expected.expand(batch, new)
    given = positions.to(expected.device).expand(batch, new)
    if not torch.equal(given, want):
        raise ValueError(
            f"{cache}.update: positions must continue each row: expected {_rows(want)} (after the "
            f"tokens stored), got {_rows(given)}; going back needs crop() first, and a gap would "
            f"leave an empty slot"
        )


def _rows(positions: Tensor) -> str:
    """``(B, new)`` positions for a message: each row as ``a..b`` when consecutive."""
    rows = []
    for row in positions.tolist():
        if row and row == list(range(row[0], row[0] + len(row))):
            rows.append(f"{row[0]}..{row[-1]}" if len(row) > 1 else f"{row[0]}")
        else:
            rows.append(str(row if len(row) <= 8 else row[:8] + ["..."]))
    if len(set(rows)) == 1:
        return f"[{rows[0]}] in every row" if len(rows) > 1 else f"[{rows[0]}]"
    shown = "; ".join(f"row {b}: [{r}]" for b, r in enumerate(rows[:4]))
    return shown + ("; ..." if len(rows) > 4 else "")


def check_reach(where: str, mask: object, causal: bool, window: int, positions: Tensor | Sequence[int]) -> None:
    """Refuse a mask that lets a query see further back than a cache keeps.

    A cache keeping only the ``window`` keys before each query (a ring) holds positions
    ``p - window .. p`` for the query at ``p``. ``mask`` (a mask object read at absolute
    positions), combined with ``causal()`` when ``causal``, must not let any query at
    ``positions`` (``(new,)`` or ``(B, new)``, or host ints) see a key older than that: otherwise the attention
    would be narrower than the mask says, with no error. ``sliding_window(w)`` with ``w <= window``
    fits (alone or combined with other masks); ``causal()`` alone, no mask, and a tensor mask (over
    the slots, not at positions: it cannot bound how far back a position looks) do not. Eager only
    (reads the positions)."""
    if torch.compiler.is_compiling():
        return
    if mask is not None and not isinstance(mask, (Mask, Tensor)):
        return  # not a mask: refused with its own reason where the mask is read
    at_positions = _reach_bound(mask) if isinstance(mask, Mask) else None
    parts = [m for m in (at_positions, causal_mask() if causal else None) if m is not None]
    hint = f"hint: pass a mask that fits, mask=sliding_window(w) with w <= {window}"
    if not parts:
        what = _describe_call_mask(mask, causal)
        raise ValueError(
            f"{where}: {what} lets a query see every earlier key, but this cache keeps only the "
            f"window={window} keys before each query: the attention would silently narrow to "
            f"sliding_window({window}); {hint}, or use a cache that keeps every key (DynamicKVCache, "
            f"StaticKVCache)"
        )
    combined = parts[0] if len(parts) == 1 else parts[0] & parts[1]
    queries = positions.reshape(-1).unique().tolist() if isinstance(positions, Tensor) else sorted(set(positions))
    if not queries:
        return
    extent = _whole_length(combined, 0)
    if extent and queries[-1] >= extent:
        return  # the mask is too short for these positions: CacheRead.mask says so
    n = max(extent, queries[-1] + 1)  # the square of the whole sequence the mask is read on
    for p in queries:
        lo, hi = combined._key_range(Extent(1, 1, n, n), Block(p, p + 1, 0, n))
        if lo >= hi or lo >= p - window:
            continue  # sees nothing, or nothing older than the cache holds
        if lo <= -UNBOUNDED // 2:
            sees = "every earlier key (no window)"
            wider = "use a cache that keeps every key (DynamicKVCache, StaticKVCache)"
        else:
            sees = f"the {p - lo} keys before it" + (f" (position {p} sees back to {lo})" if lo >= 0 else "")
            wider = f"create the cache with window >= {p - lo}"
        what = _describe_call_mask(mask, causal)
        raise ValueError(
            f"{where}: {what} lets a query see {sees}, but this cache keeps only the window={window} "
            f"keys before each query: the attention would silently narrow to sliding_window({window}); "
            f"{hint}, or {wider}"
        )


def _describe_call_mask(mask: object, causal: bool) -> str:
    if mask is None:
        call = "no mask"
    elif isinstance(mask, Mask) and not _call_frame(mask):
        call = f"mask {mask._describe()}"
    elif isinstance(mask, Mask) and _position_parts(mask):
        call = f"mask {mask._describe()} (its tensor parts are over the slots, not at positions)"
    else:
        call = "a tensor mask (over the slots returned, not at positions)"
    return f"{call} with causal=True" if causal else f"{call} with causal=False"


def check_prefix(name: str, k: Tensor, v: Tensor) -> None:
    """``v`` must be ``k[..., :Dv]``: a view of it (free to check), or equal to it."""
    Dv = v.shape[3]
    if Dv > k.shape[3]:
        raise ValueError(
            f"{name}.update: v must be the first Dv features of k (the latent, stored once), so "
            f"Dv <= D; got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if v.data_ptr() == k.data_ptr() and v.stride() == k.stride():
        return
    if not torch.equal(v, k[..., :Dv]):
        raise ValueError(
            f"{name}.update: v must equal k[..., :{Dv}] (the latent, stored once and read back as a "
            f"view of k), got a different tensor; hint: pass rows = cat([latent, k_rope], -1) and "
            f"rows[..., :{Dv}]"
        )


def under_autograd(k: Tensor | None, v: Tensor | None, *held: Tensor) -> bool:
    """Whether a cache write must leave the ``held`` buffers as they are: they belong to a graph
    (an earlier step's backward may read them, even if this step runs under ``no_grad``), or the
    new ``k``/``v`` are being recorded by autograd now. Such a write goes into copies."""
    new = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (k, v))
    return new or any(t.requires_grad for t in held)
