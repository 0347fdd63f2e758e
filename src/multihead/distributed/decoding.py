"""``ShardedKVCache``: decoding a long context whose keys and values are sharded across ranks.

The serving side of context parallelism. Each rank keeps the keys and values of some positions
of the sequence (memory per rank ∝ ``L/P``); a decode step attends to all of them with one small
exchange instead of gathering the cache::

    prefill   this rank's prompt shard (B, H, L/P, ·)  --ring_attention-->  its rows of the output;
              its k, v stay here, at their global positions (shard_positions)
    step      q (B, Hq, n, D)  --broadcast from src-->  every rank
              k, v of the n new tokens  --src to the owner-->  the rank holding the fewest tokens
              every rank: attention(q, its keys, mask read at absolute positions) -> (o_r, lse_r)
              all-gather of (o_r, lse_r)  -->  merge_partials  -->  the same output on every rank

Positions are absolute and the mask is the whole sequence's, read at each rank's positions
(:meth:`multihead.Mask.at`), causal always (a decode step is a continuation). A rank that holds
no key a query can see contributes ``lse = -inf``, which :func:`multihead.merge_partials` weighs
exactly 0. Every step checks its arguments on every rank and agrees on them in one small
``all_gather_object`` before anything moves (:func:`multihead.distributed.checks.agree`), so one
bad input raises on every rank instead of leaving the others waiting.

Each rank stores its keys in a :class:`~multihead.caches.DynamicKVCache` (growth by doubling,
writes in place) beside a table of the global position of each slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.attention import attention
from multihead.blocks import Extent
from multihead.caches import DynamicKVCache
from multihead.conventions import lse_dtype
from multihead.distributed.checks import agree, check_group, check_qkv, check_scale
from multihead.distributed.fingerprint import mask_fingerprint
from multihead.distributed.layout import check_layout, shard_positions
from multihead.distributed.ring import ring_attention
from multihead.masks import Mask, causal
from multihead.merge import merge_partials

__all__ = ["ShardedKVCache", "StepTraffic"]

_WHERE = "ShardedKVCache"


@dataclass(frozen=True)
class StepTraffic:
    """Payload bytes of one decode step (what the collectives carry, not gloo's or NCCL's wire
    protocol): ``query`` broadcast from ``src`` to every other rank, ``kv`` sent from ``src`` to
    the rank that stores the new tokens (0 when that is ``src``), and ``partial``, the
    ``(output, lse)`` each rank contributes to the all-gather. A rank receives at most
    ``query + kv + (P - 1)·partial``; none of it grows with the context."""

    query: int
    kv: int
    partial: int
    world: int

    @property
    def received_per_rank(self) -> int:
        """The most any rank receives in the step."""
        return self.query + self.kv + (self.world - 1) * self.partial


class ShardedKVCache:
    """One attention layer's keys and values for a sequence sharded by position over ``group``.

    Args:
        group: the process group sharing the sequence (default: the whole world).
        layout: how :meth:`prefill` shards the prompt: ``"zigzag"`` (balanced causal prefill) or
            ``"contiguous"`` (:mod:`multihead.distributed.layout`).
        capacity: slots this rank allocates at its first update (at least the tokens it brings);
            later growth doubles (:class:`~multihead.caches.DynamicKVCache`). Pass about
            ``(prompt + new tokens) / P`` to allocate once.

    ``prefill`` once (or not at all), then ``step`` for each new token or group of tokens::

        cache = ShardedKVCache(layout="zigzag")
        out = cache.prefill(q_shard, k_shard, v_shard)        # (B, Hq, L/P, Dv): this rank's rows
        y = cache.step(q, k, v)                               # (B, Hq, 1, Dv): the same on every rank
        cache.length, cache.local_length, cache.last_traffic  # L + 1, ~ (L + 1)/P, bytes moved

    Every rank of ``group`` makes the same calls. Inference only: a backward through the
    exchange is not defined (tensors that need a gradient under grad mode are refused).
    """

    def __init__(self, *, group=None, layout: str = "zigzag", capacity: int = 256):
        check_layout(layout, _WHERE)
        self.world, self.rank = check_group(group, _WHERE)
        self.group, self.layout = group, layout
        self._local = DynamicKVCache(capacity)
        self._positions: Tensor | None = None  # (local_length,) int64: the global position of each slot
        self._counts = [0] * self.world  # tokens each rank holds: the same list on every rank
        self.last_traffic: StepTraffic | None = None

    # ------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Tokens of the whole sequence so far (all ranks together): the next token's position."""
        return sum(self._counts)

    @property
    def local_length(self) -> int:
        """Tokens whose keys this rank holds."""
        return self._counts[self.rank]

    @property
    def counts(self) -> tuple[int, ...]:
        """Tokens held by each rank, in rank order."""
        return tuple(self._counts)

    @property
    def positions(self) -> Tensor | None:
        """``(local_length,)`` int64: the global position of each key this rank holds."""
        return self._positions

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for keys, values and the position table."""
        table = 0 if self._positions is None else self._positions.numel() * self._positions.element_size()
        return self._local.nbytes + table

    def owner(self) -> int:
        """The rank that stores the next step's tokens: the one holding the fewest, lowest on ties,
        so every rank holds within one step of ``length / P`` tokens."""
        return min(range(self.world), key=lambda r: (self._counts[r], r))

    def reset(self) -> None:
        """Forget every token (on this rank: call it on every rank)."""
        self._local.reset()
        self._positions = None
        self._counts = [0] * self.world
        self.last_traffic = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length}, counts={self.counts}, layout={self.layout!r})"

    # ------------------------------------------------------------------------------ prefill
    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | None = None,
        scale: float | None = None,
        backend: str = "auto",
    ) -> Tensor:
        """Attend over a prompt sharded in :attr:`layout` and keep this rank's keys and values.

        ``q (B, Hq, S, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``: this rank's shard of an
        ``L = P·S`` token prompt (:func:`~multihead.distributed.shard_sequence`). Causal, with
        ``mask`` (a mask object of the whole sequence) besides. Returns this rank's rows of the
        output, ``(B, Hq, S, Dv)``, from :func:`~multihead.distributed.ring_attention`. Only on an
        empty cache: a later prompt is a series of steps."""
        error, rule = None, causal() if mask is None else causal() & mask
        try:
            if self.length:
                raise ValueError(
                    f"{_WHERE}.prefill: the cache already holds {self.length} tokens; expected an empty "
                    "cache (prefill once, then step(); reset() to start again)"
                )
            _check_mask_object(f"{_WHERE}.prefill", mask)
            _check_inference(f"{_WHERE}.prefill", q, k, v)
            if isinstance(q, Tensor) and q.dim() == 4:
                L = q.shape[2] * self.world
                whole = _whole_length(f"{_WHERE}.prefill", mask, L)
                if whole > L:  # a mask of a longer sequence (the steps to come): its first L positions
                    rule = rule.shifted(0, 0, q_len=whole, kv_len=whole)
        except (TypeError, ValueError) as e:
            error = e
        # every rank learns of a bad input here; ring_attention then checks shapes, mask and more
        agree(f"{_WHERE}.prefill", self.group, self.rank, error, {"length": self.length})
        out = ring_attention(q, k, v, group=self.group, mask=rule, layout=self.layout, scale=scale, backend=backend)
        S = k.shape[2]
        self._local.update(k, v)
        self._positions = shard_positions(S, group=self.group, layout=self.layout, device=k.device)
        self._counts = [S] * self.world
        assert isinstance(out, Tensor)  # (no LSE asked for)
        return out

    # ------------------------------------------------------------------------------ decode
    def step(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | None = None,
        scale: float | None = None,
        src: int = 0,
        backend: str = "auto",
    ) -> Tensor:
        """One decode step of ``n`` new tokens at positions ``length .. length + n - 1``.

        Args:
            q: ``(B, Hq, n, D)``: the new tokens' queries. Rank ``src``'s are broadcast; the
                other ranks pass a tensor of the same shape and dtype (their values are not read).
            k: ``(B, Hkv, n, D)``; v: ``(B, Hkv, n, Dv)``: the new tokens' keys and values, read
                on rank ``src`` likewise and stored by :meth:`owner`.
            mask: a mask object of the whole sequence, read at absolute positions, besides the
                causal rule (``sliding_window(w)``, ``key_padding(lengths)``, ``document(ids)``
                with ids covering the positions...).
            scale: multiplies ``q k^T``; default ``1 / sqrt(D)``.
            src: the rank whose ``q``, ``k``, ``v`` the step uses.
            backend: the :func:`multihead.attention` backend of each rank's local call.

        Returns:
            ``(B, Hq, n, Dv)`` in the dtype of ``q``, the same on every rank: attention of the new
            queries over every key of the sequence. :attr:`last_traffic` then holds the bytes the
            step moved.
        """
        where = f"{_WHERE}.step"
        error, summary, whole = None, {}, 0
        try:
            shards = check_qkv(where, q, k, v, 1)
            if shards.Sq != shards.Sk:
                raise ValueError(
                    f"{where}: q holds {shards.Sq} new tokens but k holds {shards.Sk}; expected the "
                    "queries, keys and values of the same new tokens"
                )
            if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world:
                raise ValueError(f"{where}: src must be a rank in [0, {self.world}), got {src!r}")
            _check_inference(where, q, k, v)
            _check_mask_object(where, mask)
            scale = check_scale(where, scale, shards.D)
            total = self.length + shards.Sq
            whole = _whole_length(where, mask, total)
            if mask is not None:
                mask.check(Extent(shards.B, shards.Hq, whole, whole))
            held, held_v = self._local.keys, self._local.values
            if (
                held is not None
                and held_v is not None
                and (
                    held.shape[:2] != k.shape[:2]
                    or (held.shape[3], held_v.shape[3]) != (k.shape[3], v.shape[3])
                    or held.dtype != k.dtype
                    or held.device != k.device
                )
            ):
                raise ValueError(
                    f"{where}: k {tuple(k.shape)}, v {tuple(v.shape)} ({k.dtype}, {k.device}) do not continue "
                    f"the cache's (B, Hkv, ·, D) = ({held.shape[0]}, {held.shape[1]}, ·, {held.shape[3]}) and "
                    f"Dv = {held_v.shape[3]} ({held.dtype}, {held.device}); hint: one cache per layer, reset() "
                    "for a new sequence"
                )
            summary = {
                "q": tuple(q.shape),
                "k": tuple(k.shape),
                "v": tuple(v.shape),
                "dtype": str(q.dtype),
                "mask": mask_fingerprint(mask),
                "scale": scale,
                "src": src,
                "backend": backend,
                "length": self.length,  # a rank that missed a step holds another length
            }
        except Exception as e:  # any failure here must reach the other ranks
            error = e
        agree(where, self.group, self.rank, error, summary)

        n, owner = q.shape[2], self.owner()
        q, k, v = self._share(q, k, v, src, owner)
        start = self.length
        if self.rank == owner:
            self._local.update(k, v)
            new = torch.arange(start, start + n, device=k.device)
            self._positions = new if self._positions is None else torch.cat([self._positions, new])
        self._counts[owner] += n
        output, lse = self._partial(q, v.shape[3], mask, start, whole, scale, backend)
        out, _ = self._merge(output, lse)
        self.last_traffic = StepTraffic(
            query=_nbytes(q),
            kv=0 if owner == src else _nbytes(k) + _nbytes(v),
            partial=_nbytes(output) + _nbytes(lse),
            world=self.world,
        )
        return out

    def _share(self, q: Tensor, k: Tensor, v: Tensor, src: int, owner: int) -> tuple[Tensor, Tensor, Tensor]:
        """Rank ``src``'s ``q`` on every rank, its ``k``, ``v`` on ``owner`` (others keep theirs)."""
        if self.world == 1:
            return q, k, v
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        q = q.contiguous() if self.rank == src else torch.empty_like(q, memory_format=torch.contiguous_format)
        dist.broadcast(q, global_src, group=self.group)
        if owner != src:
            if self.rank == src:
                dst = dist.get_global_rank(self.group, owner) if self.group is not None else owner
                dist.send(k.contiguous(), dst, group=self.group)
                dist.send(v.contiguous(), dst, group=self.group)
            elif self.rank == owner:
                k = torch.empty_like(k, memory_format=torch.contiguous_format)
                v = torch.empty_like(v, memory_format=torch.contiguous_format)
                dist.recv(k, global_src, group=self.group)
                dist.recv(v, global_src, group=self.group)
        return q, k, v

    def _partial(
        self, q: Tensor, Dv: int, mask: Mask | None, start: int, whole: int, scale: float | None, backend: str
    ) -> tuple[Tensor, Tensor]:
        """This rank's attention of ``q (B, Hq, n, D)`` over the keys it holds: ``(output
        (B, Hq, n, Dv), lse (B, Hq, n))``; output 0 and LSE ``-inf`` where it holds none a query
        can see. Every rank's pair has the same shapes and dtypes (they are gathered as bytes)."""
        keys, values = self._local.keys, self._local.values
        B, Hq, n, _ = q.shape
        acc = lse_dtype(q.dtype)
        if keys is None:  # nothing held here yet
            return q.new_zeros(B, Hq, n, Dv), torch.full((B, Hq, n), float("-inf"), dtype=acc, device=q.device)
        assert self._positions is not None and values is not None  # set with the first keys
        rule = causal() if mask is None else causal() & mask
        q_positions = torch.arange(start, start + n, device=q.device)
        local = rule.at(q_positions, self._positions, q_len=whole, kv_len=whole)  # the whole mask at our keys
        res = attention(q, keys, values, mask=local, scale=scale, return_lse=True, backend=backend)
        assert res.lse is not None  # asked for
        return res.output.to(q.dtype), res.lse.to(acc)

    def _merge(self, output: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's ``(output, lse)`` on every rank, in one all-gather, joined by
        :func:`multihead.merge_partials`."""
        if self.world == 1:
            return output, lse
        # One message per rank: the output's bytes, then the LSE's (dtypes differ).
        mine = torch.cat([output.contiguous().view(-1).view(torch.uint8), lse.contiguous().view(-1).view(torch.uint8)])
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        split = output.numel() * output.element_size()
        outputs = [g[:split].view(output.dtype).view(output.shape) for g in gathered]
        lses = [g[split:].view(lse.dtype).view(lse.shape) for g in gathered]
        return merge_partials(outputs, lses)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _check_mask_object(where: str, mask: object) -> None:
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"{where}: mask must be None or a multihead mask object of the whole sequence (read at "
            f"absolute positions), got {type(mask).__name__}; hint: a tensor has no position frame "
            "once the keys are spread over ranks: use key_padding(...), document(...), "
            "sliding_window(...)"
        )


def _check_inference(where: str, *tensors: Tensor) -> None:
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        raise ValueError(
            f"{where}: q, k or v requires grad, but a sharded decode is inference only (its "
            "exchange has no backward); hint: run it under torch.no_grad() or torch.inference_mode()"
        )


def _whole_length(where: str, mask: Mask | None, total: int) -> int:
    """The length of the square the mask is read in: what its tensors cover (document ids,
    padding tables over the whole sequence), else the tokens so far. Refuses a mask that ends
    before the new tokens."""
    extents = [e for e in (mask.extent() if mask is not None else ()) if e is not None]
    whole = max(extents, default=0) or total
    if whole < total:
        raise ValueError(
            f"{where}: mask {mask._describe() if mask is not None else ''} covers {whole} positions, but "
            f"the new tokens reach position {total - 1}; expected a mask of the whole sequence "
            f"(at least {total} positions)"
        )
    return whole
