"""``QuantizedKVCache``: keys and values stored in 8 bits (int8 or fp8) with scales, the first
tokens (sinks) and the most recent ones (the residual window) kept in full precision.

A decode step's cost is reading the cache; 8-bit slots halve a bf16 cache's bytes and quarter an
fp32 one's. Keys carry outlier channels (KIVI), so they are scaled per channel first, then per
token; values per token. A token is quantized only once it leaves the residual window, a group of
``group`` tokens at a time::

    position  0 .. sinks-1 | sinks .. sinks+nq-1                   | ... length-1
              full precision | 8 bits: k = K8 · kc[span] · kt,       | full precision: the residual
              (sinks)        | v = V8 · vt (kc per channel per span, | window, residual ..
                             | kt and vt per token)                  | residual+group-1 tokens

The tail holds between ``residual`` and ``residual + group - 1`` tokens: when it reaches
``residual + group``, its oldest whole groups are quantized together, symmetric (``top`` = 127 for
int8, 448 for fp8 ``e4m3fn``): values ``vt = amax over the token / top``; keys divided by their
span's channel scales ``kc`` (set by the first store into a span of ``span`` tokens: each
channel's amax over the span's tokens in that store, a group or more, at least 1/32 of the
largest channel's, so that a channel quiet there cannot blow up later tokens, divided by the
largest: ``kc`` is in ``[1/32, 1]``, the magnitude is the tokens'), then
``kt = amax over the token / top``. A token whose channels outgrow ``kc`` is never clipped (its
``kt`` grows). The factors are one per channel per span and one per token, not one per channel
per group as in KIVI, so that a decode step can move them onto the query and the attention
weights and multiply the int8 slots as they are (:mod:`multihead.backends.decode_int8`). The
last ``residual`` tokens written are always exact, and so are the first ``sinks``.

Every read returns what the cache holds: slot ``j`` is position ``j`` (one length for every row),
quantized slots as ``K8 · kc · kt`` and ``V8 · vt`` in ``dtype``. A decode step reads
them through ``CacheRead.blocks``: int8 slots through multihead's CPU decode kernel
(:mod:`multihead.backends.cpu_kernels`: each slot converted in registers, its scales applied as it
is read) or, without it, integer GEMMs over the stored bytes (fp16/bf16/fp32 compute); fp8 (and
fp64 compute) dequantized a piece at a time into a buffer that stays in cache
(:mod:`multihead.backends.decode_blocks`); a prefill, weights or autograd read ``CacheRead.keys``,
the whole read dequantized once. Quantized slots carry no gradient (rounding has none); the
full-precision ones do, as in the other caches.

:meth:`crop` into the quantized region dequantizes the kept part of the last group back into the
tail (its values are the ones reads returned, so nothing a query sees changes) and keeps the other
groups with their scales; :meth:`rollback` restores the counts and the tail; :meth:`reorder` moves
every row's slots and scales together. Error against the fp32 cache: ``docs/inference.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from multihead.backends import cpu_kernels
from multihead.backends.decode import _attend
from multihead.backends.decode_blocks import KVBlocks
from multihead.backends.decode_int8 import digits_for, int8_attention
from multihead.caches.base import (
    CacheRead,
    KVCache,
    check_continuation,
    check_crop,
    check_indices,
    check_kv,
    check_prefix,
    under_autograd,
)

__all__ = ["QuantizedKVCache", "FORMATS"]

#: format -> (storage dtype name, largest magnitude stored)
FORMATS = {"int8": ("int8", 127.0), "fp8": ("float8_e4m3fn", 448.0)}
#: Score elements of one int8 partial (``B·Hkv·G·Lq`` rows x slots, fp32): bounds its buffers.
_INT8_SCORES = 1 << 22
#: A key channel's scale is at least this share of the largest channel's in its span's first group.
_CHANNEL_FLOOR = 1 / 32


#: the cache's buffers of keys, and of values (with ``values_in_keys``: views of the keys' buffers)
_KEY_BUFFERS = ("sink_k", "q_k", "k_channel", "k_token", "tail_k")
_VALUE_BUFFERS = ("sink_v", "q_v", "v_scale", "tail_v")
_KEYS_OF = {"sink_v": "sink_k", "q_v": "q_k", "v_scale": "k_token", "tail_v": "tail_k"}


class _Values:
    """A value buffer of :class:`QuantizedKVCache`: its own tensor, or with ``values_in_keys`` the
    first ``value_dim`` features of the matching key buffer (``v_scale``: the keys' per-token scale),
    derived on every read, so that no change of a key buffer can leave it stale."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.own, self.keys = "_" + name, _KEYS_OF[name]

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        if cache is None:
            return self
        if cache.values_in_keys:
            keys = getattr(cache, self.keys)
            return keys if self.keys == "k_token" else keys[..., : cache.value_dim]
        return cache.__dict__[self.own]

    def __set__(self, cache: Any, value: Tensor) -> None:
        if cache.values_in_keys:  # a bug: nothing holds these values apart from the keys
            raise AttributeError(f"QuantizedKVCache: {self.own[1:]} is a view of the keys (values_in_keys)")
        cache.__dict__[self.own] = value


class QuantizedKVCache(KVCache):
    """``B`` rows of up to ``max_len`` tokens, one length for every row, stored in 8 bits.

    Args:
        batch_size, max_len, num_kv_heads, head_dim: ``B``, the tokens a row may hold, ``Hkv``, ``D``;
            ``value_dim``: ``Dv`` (default ``D``; MLA latent rows: the latent width).
        bits: 8 (int8 and fp8 ``e4m3fn`` are both 8-bit formats; no other width is implemented).
        format: ``"int8"`` (symmetric, round to nearest) or ``"fp8"`` (``torch.float8_e4m3fn``).
        residual: the most recent tokens always kept in full precision.
        sinks: the first tokens always kept in full precision (attention sinks).
        group: tokens quantized together (they leave the residual window together).
        span: tokens sharing one row of per-channel key scales (rounded down to a multiple of
            ``group``, at least one group, at most the 8-bit region: the whole groups of
            ``max_len - sinks - residual`` tokens, all that can ever be quantized); a decode step
            multiplies each span's int8 keys with one integer GEMM per KV head.
        values_in_keys: the values are the first ``value_dim`` features of the keys (MLA's latent
            rows ``[c_kv | k_rope]``, whose values are ``c_kv``), stored once: the values read the
            keys' codes with the keys' per-token scale (``vt = kt``), so the keys' channel scales
            are 1 on those features (a per-token scale for the latent) and scale only the rest
            (the rotary part); half the bytes of storing them twice. ``update`` then wants
            ``v = k[..., :value_dim]``.
        dtype, device: the compute dtype (what reads return, what new keys must have) and device.
    """

    sink_v, q_v, v_scale, tail_v = _Values(), _Values(), _Values(), _Values()

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        bits: int = 8,
        format: str = "int8",
        residual: int = 64,
        sinks: int = 4,
        group: int = 32,
        span: int = 4096,
        values_in_keys: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        name = "QuantizedKVCache"
        value_dim = head_dim if value_dim is None else value_dim
        for arg, value, low in (
            ("batch_size", batch_size, 1),
            ("max_len", max_len, 1),
            ("num_kv_heads", num_kv_heads, 1),
            ("head_dim", head_dim, 1),
            ("value_dim", value_dim, 1),
            ("residual", residual, 0),
            ("sinks", sinks, 0),
            ("group", group, 1),
            ("span", span, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {arg} must be an int >= {low}, got {value!r}")
        if not isinstance(values_in_keys, bool):
            raise TypeError(f"{name}: values_in_keys must be a bool, got {values_in_keys!r}")
        if values_in_keys and isinstance(value_dim, int) and isinstance(head_dim, int) and value_dim > head_dim:
            raise ValueError(
                f"{name}: with values_in_keys the values are the first value_dim features of the keys, so "
                f"value_dim <= head_dim; got value_dim={value_dim}, head_dim={head_dim}"
            )
        if not isinstance(format, str) or format not in FORMATS:  # not a bare `in`: a list raised "unhashable"
            raise ValueError(f"{name}: format must be one of {sorted(FORMATS)}, got {format!r}")
        if isinstance(bits, bool) or not isinstance(bits, int) or bits != 8:  # 8.0 passed as 8 before
            raise ValueError(f"{name}: bits must be 8 (int8 and fp8 e4m3fn are 8-bit formats), got {bits!r}")
        storage = getattr(torch, FORMATS[format][0], None)
        if storage is None:
            raise ValueError(f"{name}: format='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise TypeError(f"{name}: dtype must be a floating-point torch.dtype of 16 bits or more, got {dtype!r}")
        self.format, self.bits, self.residual, self.sinks, self.group = format, bits, residual, sinks, group
        self.max_len = max_len
        B, Hkv, D, Dv = batch_size, num_kv_heads, head_dim, value_dim
        # Buffers for what max_len can hold, not for the sizes asked: residual >= max_len (no token
        # ever quantized) allocated residual + group full-precision slots and the 8-bit region of
        # max_len besides: docs/inference.md, QuantizedKVCache.
        # A store always leaves `residual` tokens in the tail, so at most the whole groups of
        # max_len - sinks - residual tokens are ever quantized.
        groups = max(0, max_len - sinks - residual) // group
        sink_slots, tail_slots = min(sinks, max_len), min(residual + group, max(0, max_len - sinks))
        # At most the 8-bit region: an int8 step pads its slots to whole spans, so a span past
        # max_len made every step allocate and scan span-sized buffers (out of memory for a large
        # one) for slots that can never exist.
        self.span = min(max(1, span // group), max(1, groups)) * group
        spans = -(-groups * group // self.span)
        full: dict[str, Any] = dict(dtype=dtype, device=device)
        self.values_in_keys, self.value_dim = values_in_keys, Dv
        self.sink_k = torch.zeros(B, Hkv, sink_slots, D, **full)
        self.q_k = torch.zeros(B, Hkv, groups * group, D, dtype=storage, device=device)
        self.k_channel = torch.ones(B, Hkv, spans, D, **full)  # per channel, per span of tokens
        self.k_token = torch.ones(B, Hkv, groups * group, 1, **full)  # per token
        self.tail_k = torch.zeros(B, Hkv, tail_slots, D, **full)
        if not values_in_keys:
            self.sink_v = torch.zeros(B, Hkv, sink_slots, Dv, **full)
            self.q_v = torch.zeros(B, Hkv, groups * group, Dv, dtype=storage, device=device)
            self.v_scale = torch.ones(B, Hkv, groups * group, 1, **full)  # per token
            self.tail_v = torch.zeros(B, Hkv, tail_slots, Dv, **full)
        self._length = 0  # tokens per row
        self._quantized = 0  # tokens in the 8-bit region (a multiple of group)
        self._undo: tuple[Any, ...] | None = None

    def _buffers(self, *names: str) -> tuple[str, ...]:
        """Of ``names``, the buffers this cache holds (with ``values_in_keys`` the value buffers are
        views of the keys')."""
        return tuple(name for name in names if not (self.values_in_keys and name in _VALUE_BUFFERS))

    def _write(self, part: str, at: slice, k: Tensor, v: Tensor) -> None:
        """Slots ``at`` of the full-precision ``part`` (``"sink"`` or ``"tail"``): keys, and values where
        they are held apart (else they are the keys just written)."""
        getattr(self, part + "_k")[:, :, at] = k
        if not self.values_in_keys:
            getattr(self, part + "_v")[:, :, at] = v

    # ------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        return self._length

    @property
    def lengths(self) -> Tensor:
        return torch.full((self.batch_size,), self._length, dtype=torch.int64, device=self.tail_k.device)

    @property
    def batch_size(self) -> int:
        """``B``: the rows held (:meth:`reorder` may change it)."""
        return self.tail_k.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what reads return and what new keys and values must have."""
        return self.tail_k.dtype

    @property
    def nbytes(self) -> int:
        held = (getattr(self, name) for name in self._buffers(*_KEY_BUFFERS, *_VALUE_BUFFERS))
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def _tail(self) -> int:
        """Tokens in the full-precision tail."""
        return max(0, self._length - self.sinks - self._quantized)

    def next_positions(self, new: int, device: torch.device | str | None = None) -> Tensor:
        return torch.arange(self._length, self._length + new, device=device)

    def slots(self, new: int) -> int:
        return self._length + new

    def _held(self) -> str:
        B, Hkv, _, D = self.tail_k.shape
        return (
            f"QuantizedKVCache(batch_size={B}, max_len={self.max_len}, num_kv_heads={Hkv}, head_dim={D}, "
            f"format={self.format!r}{', values_in_keys=True' if self.values_in_keys else ''}, dtype={self.dtype})"
        )

    # ------------------------------------------------------------------------------ changes
    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheRead:
        name = type(self).__name__
        B, Hkv, _, D = self.tail_k.shape
        check_kv(
            name,
            k,
            v,
            batch=B,
            heads=Hkv,
            head_dim=D,
            value_dim=self.tail_v.shape[3],
            dtype=self.dtype,
            device=self.tail_k.device,
            held=self._held(),
            stored=self.tail_k,
        )
        if self.values_in_keys:
            check_prefix(name, k, v)
        new = k.shape[2]
        expected = self.next_positions(new, k.device)
        if positions is not None:
            check_continuation(name, positions, expected, B)
        if self._length + new > self.max_len:
            raise ValueError(
                f"{name}.update: writing {new} tokens after the {self._length} stored would pass "
                f"max_len={self.max_len}; hint: allocate a larger cache or crop it first"
            )
        into_sinks = max(0, min(new, self.sinks - self._length))
        rest_k, rest_v = k[:, :, into_sinks:], v[:, :, into_sinks:]
        tail, rest = self._tail, k.shape[2] - into_sinks
        over = tail + rest - self.residual
        count = (over // self.group) * self.group if over >= self.group else 0  # whole groups leave the window
        copies = under_autograd(k, v, self.sink_k, self.sink_v, self.tail_k, self.tail_v)
        # What a rollback needs: the counts, since every write lands past them (sink and tail slots
        # not yet held, the 8-bit slots and scales past `_quantized`: a later store into a span
        # sets its channel scales again), and the tail's tokens when a store moves them.
        full = self._buffers("sink_k", "sink_v", "tail_k", "tail_v")  # the full-precision buffers held
        originals = {name: getattr(self, name) for name in full} if copies else None
        saved = None
        if count and not copies:
            saved = (self.tail_k[:, :, :tail].clone(), self.tail_v[:, :, :tail].clone())
        self._undo = (self._length, self._quantized, originals, saved)
        if copies:  # earlier steps saved these buffers for their backward: write into copies
            for name in full:
                setattr(self, name, getattr(self, name).clone())
        if into_sinks:
            self._write(
                "sink", slice(self._length, self._length + into_sinks), k[:, :, :into_sinks], v[:, :, :into_sinks]
            )
        if count:
            held_k = torch.cat([self.tail_k[:, :, :tail], rest_k], dim=2)  # (B, Hkv, tail + rest, D)
            held_v = torch.cat([self.tail_v[:, :, :tail], rest_v], dim=2)
            self._store(held_k[:, :, :count].detach(), held_v[:, :, :count].detach())
            kept = held_k.shape[2] - count
            self._write("tail", slice(0, kept), held_k[:, :, count:], held_v[:, :, count:])
        elif rest:  # the window has room (tail + rest < residual + group): written in place
            self._write("tail", slice(tail, tail + rest), rest_k, rest_v)
        self._length += new
        return CacheRead(None, None, expected, blocks=_QuantizedBlocks(self))

    def _store(self, k: Tensor, v: Tensor) -> None:
        """Quantize ``count`` tokens (whole groups) after the 8-bit region. A span's channel scales
        are set by the first store into it (and kept by later stores into the span); the
        scales are rounded to ``dtype`` before use, so that what reads return is ``K8 · kc · kt``."""
        B, Hkv, count, D = k.shape
        top = FORMATS[self.format][1]
        n0, span = self._quantized, self.span
        work = torch.promote_types(self.dtype, torch.float32)
        # A non-finite entry (NaN, ±inf) would make its channel's scale NaN or inf for the whole
        # span, so every token of it would read back as NaN or garbage, and rows that never see
        # the bad token would get NaN. The scales are taken over finite entries only, a bad entry
        # is stored as 0, and the bad token's value scale is NaN: the token's value reads back as
        # NaN (its key finite), so exactly the rows that read it get NaN (int8 has no NaN to store
        # in the slot itself; docs/inference.md, "Non-finite keys and values").
        finite_k, finite_v = torch.isfinite(k), torch.isfinite(v)
        bad = ~(finite_k.all(dim=-1) & finite_v.all(dim=-1))  # (B, Hkv, count): tokens holding one
        k = k.where(finite_k, 0.0).to(work)
        v = v.where(finite_v, 0.0).to(work)
        for j in range(-(-n0 // span), (n0 + count - 1) // span + 1):  # spans that start in this store
            amax = k[:, :, j * span - n0 : (j + 1) * span - n0].abs().amax(dim=2)  # (B, Hkv, D): >= a group
            largest = amax.amax(dim=2, keepdim=True)  # (B, Hkv, 1)
            # Relative to the span's largest channel, in [1/32, 1]: kc carries the channels' shape
            # (KIVI's outliers), kt each token's magnitude (the codes K8 are the same for any
            # constant factor of kc). An absolute kc set by a quiet first group (zero keys: padding)
            # made kt = amax(k / kc) / top of every later key of the span overflow (inf, then NaN
            # reads) in fp16 from keys of 10, in bf16 and fp32 from any key after an all-zero group.
            if self.values_in_keys:  # the values' features keep 1 (vt = kt); the rest relative to them, <= 1
                largest = amax[..., : self.value_dim].amax(dim=2, keepdim=True)
            relative = torch.maximum(amax, largest * _CHANNEL_FLOOR) / largest.masked_fill(largest == 0, 1.0)
            if self.values_in_keys:
                relative = relative.clamp_(max=1.0)
                relative[..., : self.value_dim] = 1.0
            self.k_channel[:, :, j] = relative.masked_fill_(largest == 0, 1.0).to(self.dtype)
        channel = self._channel_scales(n0, n0 + count).to(work)  # (B, Hkv, count, D)
        k_token = _stored_scale((k / channel).abs().amax(dim=3, keepdim=True) / top, self.dtype)
        q_k = _quantize(k / (channel * k_token.to(work)), self.q_k.dtype, top)
        if self.values_in_keys:  # the values are these codes, with kt: a bad token's key reads NaN
            self.k_token[:, :, n0 : n0 + count] = k_token.masked_fill(bad.unsqueeze(-1), float("nan"))
            self.q_k[:, :, n0 : n0 + count] = q_k
        else:
            v_scale = _stored_scale(v.abs().amax(dim=3, keepdim=True) / top, self.dtype)  # (B, Hkv, count, 1)
            q_v = _quantize(v / v_scale.to(work), self.q_v.dtype, top)
            self.k_token[:, :, n0 : n0 + count] = k_token
            self.v_scale[:, :, n0 : n0 + count] = v_scale.masked_fill(bad.unsqueeze(-1), float("nan"))
            self.q_k[:, :, n0 : n0 + count] = q_k
            self.q_v[:, :, n0 : n0 + count] = q_v
        self._quantized += count

    def _channel_scales(self, a: int, b: int) -> Tensor:
        """``kc`` of the 8-bit slots ``[a, b)``, one row per slot: ``(B, Hkv, b - a, D)``."""
        spans = torch.arange(a, b, device=self.k_channel.device) // self.span
        return self.k_channel.index_select(2, spans)

    def dequantized(self, a: int, b: int) -> tuple[Tensor, Tensor]:
        """The 8-bit slots ``[a, b)`` of the quantized region as ``(keys, values)`` in ``dtype``:
        ``K8 · kc · kt`` and ``V8 · vt`` (each product rounded to ``dtype``: a conversion and one
        pass per factor, since this is what a piece of an fp8 read costs)."""
        keys = self.q_k[:, :, a:b].to(self.dtype)
        for j in range(a // self.span, (b - 1) // self.span + 1 if b > a else a // self.span):
            lo, hi = max(a, j * self.span), min(b, (j + 1) * self.span)
            keys[:, :, lo - a : hi - a].mul_(self.k_channel[:, :, j : j + 1])
        # kc (<= 1) before kt: K8 · kt alone reaches 32 times a key of a quiet channel (fp16: inf)
        keys.mul_(self.k_token[:, :, a:b])
        values = self.q_v[:, :, a:b].to(self.dtype).mul_(self.v_scale[:, :, a:b])
        return keys, values

    def rollback(self) -> None:
        if self._undo is None:
            raise RuntimeError(f"{type(self).__name__}.rollback: no update to undo (once per update)")
        self._length, self._quantized, originals, saved = self._undo
        if originals is not None:
            for name, buffer in originals.items():
                setattr(self, name, buffer)
        elif saved is not None:  # a store moved the tail's tokens
            self._write("tail", slice(0, saved[0].shape[2]), *saved)
        self._undo = None

    def crop(self, length: int | Tensor) -> None:
        name = type(self).__name__
        length = check_crop(name, length, None, per_row=False)
        assert isinstance(length, int)  # per_row=False refuses tensors
        n = min(length, self._length)
        first = self.sinks + self._quantized  # the tail's first position
        if self.sinks < n < first:  # inside the 8-bit region: its last, partial group back to the tail
            kept = n - self.sinks
            whole = (kept // self.group) * self.group
            if kept > whole:
                keys, values = self.dequantized(whole, kept)
                if under_autograd(None, None, self.tail_k, self.tail_v):
                    for name in self._buffers("tail_k", "tail_v"):
                        setattr(self, name, getattr(self, name).detach().clone())
                self._write("tail", slice(0, kept - whole), keys, values)
            self._quantized = whole
        elif n <= self.sinks:
            self._quantized = 0
        self._length, self._undo = n, None

    def reorder(self, indices: Tensor) -> None:
        """Row ``i`` becomes the old row ``indices[i]`` (slots and scales together); ``B' = len(indices)``."""
        indices = check_indices(type(self).__name__, indices, self.batch_size, self.tail_k.device)
        for attr in self._buffers(*_KEY_BUFFERS, *_VALUE_BUFFERS):
            setattr(self, attr, getattr(self, attr).index_select(0, indices))
        self._undo = None

    def reset(self) -> None:
        for attr in self._buffers("sink_k", "sink_v", "tail_k", "tail_v"):
            if getattr(self, attr).requires_grad:  # let go of the last sequence's graph
                setattr(self, attr, getattr(self, attr).detach().clone())
        self._length, self._quantized, self._undo = 0, 0, None

    def __repr__(self) -> str:
        return f"{self._held()[:-1]}, length={self._length}, quantized={self._quantized}, nbytes={self.nbytes})"


def _stored_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """A per-token scale (``amax / top`` in the working dtype) as stored in ``dtype``: at least the
    smallest positive subnormal of ``dtype`` (never 0: fp16 rounded a fixed 1e-30 to 0, and an
    all-zero token stored 0 / 0 = NaN) and never below ``scale`` (rounded up where the conversion
    rounded it down, so that ``x / stored`` stays within ``top``). A floor at the smallest *normal*
    made that floor the step of every small fp16 token, far coarser than 8 bits of its amax
    (docs/inference.md, "Small and quiet tokens")."""
    info = torch.finfo(dtype)
    scale = scale.clamp(min=info.tiny * info.eps)  # tiny · eps: the smallest subnormal
    stored = scale.to(dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[stored.element_size()]
    up = (stored.view(bits) + 1).view(dtype)  # the next float up (scales are positive and finite)
    return torch.where(stored.to(scale.dtype) < scale, up, stored)


def _quantize(x: Tensor, storage: torch.dtype, top: float) -> Tensor:
    """``x`` (already divided by its scale, so within ``[-top, top]``) in the storage dtype."""
    if storage == torch.int8:
        return x.round_().clamp_(-top, top).to(torch.int8)
    return x.clamp_(-top, top).to(storage)


class _QuantizedBlocks(KVBlocks):
    """The slots of a read: sinks and tail as views, the 8-bit region dequantized a piece (whole
    groups) at a time. Holds the cache's buffers and counts as they were at the read."""

    def __init__(self, cache: QuantizedKVCache):
        B, Hkv, _, D = cache.tail_k.shape
        self.cache = cache
        self.sink_k, self.sink_v, self.tail_k, self.tail_v = cache.sink_k, cache.sink_v, cache.tail_k, cache.tail_v
        self.sinks = min(cache.sinks, cache.length)
        self.quantized, self.tail = cache._quantized, cache._tail
        self.shape = (B, Hkv, cache.length, D, cache.tail_v.shape[3])
        self.dtype, self.device = cache.dtype, cache.tail_k.device
        self.grad = torch.is_grad_enabled()  # dense() records autograd as the update would have

    def pieces(self, lo: int, hi: int, size: int) -> Iterator[tuple[int, Tensor, Tensor]]:
        s, nq = self.sinks, self.quantized
        if lo < s:
            yield lo, self.sink_k[:, :, lo : min(hi, s)], self.sink_v[:, :, lo : min(hi, s)]
        g = self.cache.group
        step = max(g, (size // g) * g)
        a0, b0 = max(lo, s) - s, min(hi, s + nq) - s  # within the 8-bit region
        start = (a0 // g) * g
        for a in range(start, b0, step):
            b = min(a + step, b0)
            keys, values = self.cache.dequantized(a, b)
            cut = max(a0 - a, 0)
            yield s + a + cut, keys[:, :, cut:], values[:, :, cut:]
        t0 = max(lo, s + nq)
        if t0 < hi:
            yield t0, self.tail_k[:, :, t0 - s - nq : hi - s - nq], self.tail_v[:, :, t0 - s - nq : hi - s - nq]

    def partials(
        self, qg: Tensor, lo: int, hi: int, blocked: Tensor | None, scale: float, G: int, Lq: int
    ) -> list[tuple[Tensor, Tensor]] | None:
        """Sinks and tail as views (the decode path's chunk), the 8-bit region (int8 or fp8) through
        the CPU decode kernel in one call, or without it, for int8, through integer GEMMs over the
        stored bytes (:func:`~multihead.backends.decode_int8.int8_attention`), a few spans at a
        time. ``None`` (dequantized pieces) for fp8 without the kernel, for fp64 compute and off the
        CPU (CUDA's ``_int_mm`` wants more than 16 rows and sizes in multiples of 8)."""
        digits = digits_for(self.dtype)
        if digits is None or self.device.type != "cpu":
            return None
        cache, s, nq = self.cache, self.sinks, self.quantized
        kernel = cpu_kernels.supports(qg, cache.q_k, cache.q_v, blocked)
        if cache.format != "int8" and not kernel:
            return None
        acc = torch.promote_types(self.dtype, torch.float32)
        half = acc != self.dtype

        def cut(a: int, b: int) -> Tensor | None:
            return None if blocked is None else blocked[..., a - lo : b - lo]

        a0, b0 = max(lo, s) - s, min(hi, s + nq) - s  # within the 8-bit region
        t0 = max(lo, s + nq)  # the residual window from here
        if kernel:
            # multihead's CPU kernel, one call: each 8-bit slot read once and converted in registers,
            # the scales applied as it goes, the full-precision sinks and window read beside them, the
            # three joined by their LSE inside the call (docs/inference.md)
            kt, vt = cache.k_token[..., 0], cache.v_scale[..., 0]
            segments = []
            if lo < s:
                segments.append(
                    cpu_kernels.Segment(
                        self.sink_k[:, :, lo : min(hi, s)], self.sink_v[:, :, lo : min(hi, s)], cut(lo, min(hi, s))
                    )
                )
            if a0 < b0:
                scales = cpu_kernels.Int8Scales(cache.k_channel, kt, vt, a0, cache.span)
                qk, qv = cache.q_k[:, :, a0:b0], cache.q_v[:, :, a0:b0]
                segments.append(cpu_kernels.Segment(qk, qv, cut(s + a0, s + b0), scales=scales))
            if t0 < hi:
                k, v = self.tail_k[:, :, t0 - s - nq : hi - s - nq], self.tail_v[:, :, t0 - s - nq : hi - s - nq]
                segments.append(cpu_kernels.Segment(k, v, cut(t0, hi)))
            return [cpu_kernels.decode_joined(qg, segments, scale, G, Lq)] if segments else []
        parts = []
        if lo < s:  # sinks
            b = min(hi, s)
            k, v = self.sink_k[:, :, lo:b], self.sink_v[:, :, lo:b]
            parts.append(_attend(qg, k, v, cut(lo, b), scale, acc, G, Lq, half, True))
        B, Hkv, R = qg.shape[0], qg.shape[1], qg.shape[2]
        step = max(1, _INT8_SCORES // (B * Hkv * R * cache.span)) * cache.span  # whole spans per partial
        a = a0
        while a < b0:
            b = min((a // cache.span) * cache.span + step, b0)
            parts.append(
                int8_attention(
                    qg,
                    scale,
                    cache.q_k[:, :, a:b],
                    cache.k_channel,
                    cache.k_token[:, :, a:b, 0],
                    cache.q_v[:, :, a:b],
                    cache.v_scale[:, :, a:b, 0],
                    a,
                    cache.span,
                    cut(s + a, s + b),
                    G,
                    Lq,
                    digits,
                )
            )
            a = b
        if t0 < hi:  # the residual window
            k, v = self.tail_k[:, :, t0 - s - nq : hi - s - nq], self.tail_v[:, :, t0 - s - nq : hi - s - nq]
            parts.append(_attend(qg, k, v, cut(t0, hi), scale, acc, G, Lq, half, True))
        return [(out, lse) for out, lse in parts if lse is not None]

    def describe(self, rows: int) -> str | None:
        D, Dv = self.shape[3], self.shape[4]
        storage, name = self.cache.q_k.dtype, self.cache.format
        if self.device.type != "cpu" or digits_for(self.dtype) is None or cpu_kernels.kernel() is None:
            return None
        if cpu_kernels.tiles(storage, rows, D, Dv, False):
            return f"{name} slots on the AMX tiles, converted to bf16 as read (exact), the query in three bf16 terms"
        if name == "int8" and cpu_kernels.int8_tiles(rows, D):
            values = "and P V " if rows <= 4 and Dv % 64 == 0 and Dv <= 256 else ""
            return (
                f"int8 slots' scores {values}on the AMX int8 tiles: the codes multiplied as stored, the query in "
                "three int8 terms" + (", the weights in four 7-bit digits" if values else "") + " (fp32's precision)"
            )
        return f"{name} slots converted to fp32 in registers, on the FMA path"

    def dense(self) -> tuple[Tensor, Tensor]:
        s, nq, t = self.sinks, self.quantized, self.tail
        keys, values = self.cache.dequantized(0, nq) if nq else (self.tail_k[:, :, :0], self.tail_v[:, :, :0])
        with torch.set_grad_enabled(self.grad):
            return (
                torch.cat([self.sink_k[:, :, :s], keys, self.tail_k[:, :, :t]], dim=2),
                torch.cat([self.sink_v[:, :, :s], values, self.tail_v[:, :, :t]], dim=2),
            )
