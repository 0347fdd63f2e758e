"""Key padding: each batch element sees only its first ``lengths[b]`` keys (or a bool table).

``key_padding(torch.tensor([3, 5]))`` with ``Lk = 5``::

    batch 0      batch 1
    ███··        █████
    ███··        █████

A bool table given positionally has the polarity of `multihead` (``True`` = a real key that
may be attended), the opposite of ``nn.MultiheadAttention``'s ``key_padding_mask``; that one is
passed by name, ``key_padding(pad=key_padding_mask)`` (``True`` = padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.blocks import Block, Extent
from multihead.masks.base import UNBOUNDED, BlockState, Mask

__all__ = ["key_padding", "prefix_lm", "KeyPadding"]


def key_padding(lengths: int | Sequence[int] | Tensor | None = None, *, pad: Tensor | None = None) -> KeyPadding:
    """Keys ``j < lengths[b]`` are visible, or the keys a bool ``(B, Lk)`` table marks.

    **From PyTorch's** ``key_padding_mask`` (``nn.MultiheadAttention``'s, ``True`` = padding), pass
    it by name: ``key_padding(pad=key_padding_mask)``. A bool table given positionally means the
    opposite, ``True`` = a real key, and PyTorch's would hide the real keys and show the padding.
    The table cannot tell which one it is (PyTorch's right padding reads as left padding), so
    nothing is guessed: the name says it.

    ``lengths``: an int, a sequence of ints or an integer tensor ``(B,)``; or a bool tensor
    ``(B, Lk)`` with ``True`` for keys that may be attended.

    ``pad``: a bool tensor ``(B, Lk)`` with ``True`` for padding, the keys that may not be
    attended; ``key_padding(pad=t)`` is ``key_padding(~t)``. Give ``lengths`` or ``pad``, not both.

    A length may exceed ``Lk``: every key is then visible. This is on purpose: one mask built for
    a whole sequence serves every step of a KV cache, when fewer keys exist yet.
    """
    if pad is not None:
        if lengths is not None:
            raise TypeError(
                "key_padding: got both lengths and pad=; pass one: lengths (B,) or a bool (B, Lk) table with "
                "True = a real key, or pad= a bool (B, Lk) table with True = padding"
            )
        return KeyPadding(valid=~_pad_table(pad))  # a new tensor: the mask is immutable
    if lengths is None:
        raise TypeError(
            "key_padding: expected lengths (B,) or a bool (B, Lk) table with True = a real key, or "
            "pad= a bool (B, Lk) table with True = padding (PyTorch's key_padding_mask); got neither"
        )
    if isinstance(lengths, Tensor) and lengths.dtype == torch.bool:
        if lengths.dim() != 2:
            raise ValueError(f"key_padding: a bool table must have shape (B, Lk), got {tuple(lengths.shape)}")
        return KeyPadding(valid=lengths.clone())  # copied: the mask is immutable
    if isinstance(lengths, bool):
        raise TypeError("key_padding: lengths must be ints or a bool (B, Lk) tensor, got a bool")
    if isinstance(lengths, int):
        lengths = [lengths]
    if isinstance(lengths, Tensor):
        if lengths.dim() == 2 and not (lengths.is_floating_point() or lengths.is_complex()):
            # (B, Lk) of 0/1: a Hugging Face attention_mask, say, whose polarity only the caller knows
            raise TypeError(
                f"key_padding: got an integer {lengths.dtype} tensor of shape {tuple(lengths.shape)}, "
                "read as a (B, Lk) table of keys; expected a bool (B, Lk) table (True = a real key) "
                "or integer lengths of shape (B,). If 1 marks a real token (Hugging Face's "
                "attention_mask), pass key_padding(mask.bool()), or key_padding(mask.sum(-1)) for "
                "right padding; if 1 marks padding (PyTorch's key_padding_mask), key_padding(mask == 0) or "
                "key_padding(pad=mask.bool())"
            )
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dim() > 1:
            raise TypeError(
                f"key_padding: lengths must be an integer tensor of shape (B,), got "
                f"dtype {lengths.dtype} and shape {tuple(lengths.shape)}"
            )
        lengths = lengths.reshape(-1).to(torch.int64, copy=True)  # copied: the mask is immutable
    else:
        try:
            lengths = torch.tensor(list(lengths), dtype=torch.int64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"key_padding: lengths must be ints or a bool (B, Lk) tensor, got {lengths!r}") from exc
    if lengths.numel() == 0:
        raise ValueError("key_padding: lengths is empty; expected one length per batch element")
    # Checked where it costs no host synchronisation and no data-dependent branch (torch.compile and
    # torch.export trace one graph for every value); elsewhere a negative length reads as 0.
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling() and bool((lengths < 0).any()):
        raise ValueError(f"key_padding: lengths must be >= 0, got {lengths.tolist()}")
    return KeyPadding(lengths=lengths)


def prefix_lm(prefix_len: int | Sequence[int] | Tensor, align: str = "bottom_right") -> Mask:
    """Prefix-LM: keys in the prefix are visible to every query; after it, causal.

    ``prefix_len`` is an int or one length per batch element. Equal to
    ``causal(align) | key_padding(prefix_len)``, and built that way.
    """
    from multihead.masks.band import causal

    if prefix_len is None:  # (key_padding's message would offer its pad= here)
        raise TypeError("prefix_lm: prefix_len must be an int or one per batch element, got None")
    if isinstance(prefix_len, bool) or (isinstance(prefix_len, int) and prefix_len < 0):
        raise ValueError(
            f"prefix_lm: prefix_len must be a non-negative int or one per batch element, got {prefix_len!r}"
        )
    try:
        padding = key_padding(prefix_len)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("key_padding: lengths", "prefix_lm: prefix_len")) from None
    return causal(align) | padding


def _pad_table(pad: object) -> Tensor:
    """``pad=`` of :func:`key_padding`: a bool ``(B, Lk)`` table, ``True`` = padding."""
    if not isinstance(pad, Tensor):
        raise TypeError(f"key_padding: pad must be a bool (B, Lk) tensor with True = padding, got {type(pad).__name__}")
    if pad.dtype != torch.bool:
        hint = (
            "pad=mask == float('-inf') for an additive mask whose -inf marks padding"
            if pad.is_floating_point()
            else "pad=mask.bool() if 1 marks padding"
        )
        raise TypeError(
            f"key_padding: pad must be a bool (B, Lk) tensor with True = padding, got dtype {pad.dtype}; hint: {hint}"
        )
    if pad.dim() != 2:
        raise ValueError(f"key_padding: pad must have shape (B, Lk), got {tuple(pad.shape)}")
    return pad


class KeyPadding(Mask):
    """Keys ``j < lengths[b]`` visible (``lengths`` ``(B|1,)``), or the keys a bool table ``valid``
    ``(B|1, Lk)`` marks ``True``: exactly one of the two is set. Built by :func:`key_padding`."""

    kind = "key_padding"
    lengths: Tensor | None  # (B|1,) int64
    valid: Tensor | None  # (B|1, Lk) bool

    def __init__(self, lengths: Tensor | None = None, valid: Tensor | None = None):
        self._set(lengths=lengths, valid=valid)

    def key_lengths(self) -> Tensor | None:
        """Visible keys per batch element ``(B|1,)``, or ``None`` for a bool table (see ``valid``)."""
        return self.lengths

    # Host copies for structural questions, made on first use (never when the mask is built).
    def _min(self) -> int:
        return self._cached("_min_cache", lambda: int(self._lengths().detach().min()))

    def _max(self) -> int:
        return self._cached("_max_cache", lambda: int(self._lengths().detach().max()))

    def _table(self) -> Tensor:
        return self._cached("_table_cache", lambda: self._valid().detach().cpu())

    def _lengths(self) -> Tensor:
        assert self.lengths is not None, "a KeyPadding built from lengths"  # internal: callers check which
        return self.lengths

    def _valid(self) -> Tensor:
        assert self.valid is not None, "a KeyPadding built from a bool table"  # internal: callers check which
        return self.valid

    def _batch(self) -> int:
        return self.lengths.shape[0] if self.lengths is not None else self._valid().shape[0]

    def check(self, extent: Extent) -> None:
        batch, kv_len = extent.batch, extent.kv_len
        n = self._batch()
        # (not `in (1, B)`: dynamo, torch 2.13, answers it False for a symbolic B)
        if n != 1 and n != batch:
            raise ValueError(
                f"key_padding: mask has {n} batch elements but the input has B={batch}; expected 1 or {batch}"
            )
        if self.valid is not None and kv_len is not None and self.valid.shape[1] != kv_len:
            raise ValueError(f"key_padding: bool table has {self.valid.shape[1]} keys but Lk={kv_len}")

    def extent(self) -> tuple[int | None, int | None]:
        return None, (None if self.valid is None else self.valid.shape[1])

    def _mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, q_len: int, kv_len: int) -> Tensor:
        if self.lengths is not None:
            lengths = self.lengths.to(kv.device)
            b = b * 0 if lengths.shape[0] == 1 else b
            return kv < lengths[b]
        valid = self._valid().to(kv.device)
        b = b * 0 if valid.shape[0] == 1 else b
        inside = (kv >= 0) & (kv < valid.shape[1])
        return valid[b, kv.clamp(0, valid.shape[1] - 1)] & inside

    def _describe(self) -> str:
        if self.lengths is not None:
            return f"key_padding(lengths={self.lengths.tolist()})"
        return f"key_padding(valid=<bool {tuple(self._valid().shape)}>)"

    def _key_range(self, extent: Extent, block: Block) -> tuple[int, int]:
        if self.lengths is not None:
            return -UNBOUNDED, self._max()
        columns = self._table().any(0).nonzero()
        return (int(columns.min()), int(columns.max()) + 1) if len(columns) else (0, 0)

    def block_state(self, extent: Extent, block: Block) -> BlockState:
        k0, k1 = block.k0, block.k1
        if self.lengths is None:
            cols = self._table()[:, max(k0, 0) : max(k1, 0)]
            if cols.numel() and bool(cols.all()):
                return BlockState.FULL
            if not bool(cols.any()):
                return BlockState.EMPTY
            return BlockState.PARTIAL
        if k1 <= self._min():
            return BlockState.FULL
        if k0 >= self._max():
            return BlockState.EMPTY
        return BlockState.PARTIAL

    def _empty_rows(self, extent: Extent, device: torch.device | str | None = None) -> Tensor:
        q_len = extent.lengths[0]
        if self.lengths is not None:
            empty = self.lengths.to(device) <= 0
        else:
            empty = ~self._valid().to(device).any(-1)
        return empty.view(-1, 1, 1).expand(-1, 1, q_len)
