"""Fingerprints of a call's arguments that are equal across processes exactly when the values are.

The ranks of a sharded call compare what they were given (:func:`multihead.distributed.checks.agree`)
in one small ``all_gather_object``; a mask takes part in it as one short string. A mask's own value
(:meth:`multihead.Mask._value`) is no use there: it holds a large or device tensor by its address,
which means nothing in another process, so two ranks holding different ids, padding tables or bool
masks of the same shape would look alike. Here every tensor inside a mask counts by its content,
whatever its size and device, through :func:`tensor_fingerprint`: three weighted sums of its values
computed where the tensor lives (no host copy of it), read back as three integers.

Nothing is cached: a tensor can change in place (even through ``.data``, which no version counter
sees), and the sums read each element once, as the attention itself must read the mask.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re

import torch
from torch import Tensor

from multihead.masks import Mask
from multihead.scores import ScoreMod
from multihead.values import Value

__all__ = ["mask_fingerprint", "tensor_fingerprint"]

# Row weights: a fixed table of random weights in [1, 2^15) per position of a row of 2^14 words.
# A word is below 2^32, so a row's weighted sum is below 2^61: exact in int64 with no modulo per
# element, and the same on every device (integer sums do not depend on the order of addition).
_ROW = 1 << 14
_ROWS_PER_PASS = 1 << 8  # 2^22 words at a time: bounds the int64 temporaries
_SUMS = 3
_SMALL = 256  # a host tensor of at most this many words is summed in Python (cheaper than torch there)
# Rows are then combined modulo a prime above 2^32 (so one changed word always changes every sum)
# with row factors in [1, 2^30], whose products with a residue stay below 2^63.
_PRIME = (1 << 32) + 15
_ROW_FACTORS = ((1_000_003, 12_345), (40_503, 97_531), (2_654_435, 7_919))
_TABLES: dict[torch.device, Tensor] = {}  # constants, one copy per device
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DESCRIPTION_CHARS = 120


def mask_fingerprint(mask: Mask | ScoreMod | None) -> str | None:
    """``mask`` as a short string, equal on two processes iff the masks are (but for a chance
    collision, about 1 in 2^64): its description, then a digest of its structure (classes,
    plain fields, each tensor's dtype and shape) and of every tensor's content. A custom
    ``mask_mod`` counts by its name only: a function has no value another process could compare.
    A score modifier (the other :class:`~multihead.values.Value`) is fingerprinted the same way;
    a user's ``score_mod`` function by its name, so the tensors it reads are not compared."""
    if mask is None:
        return None
    tensors: list[Tensor] = []
    structure = _structure(mask, tensors)
    contents = [tensor_fingerprint(t) for t in tensors]
    digest = hashlib.sha1(repr((structure, contents)).encode()).hexdigest()[:16]
    description = mask._describe()
    if len(description) > _DESCRIPTION_CHARS:
        description = description[: _DESCRIPTION_CHARS - 3] + "..."
    return f"{description} [content {digest}]"


def tensor_fingerprint(t: Tensor) -> tuple[int, ...]:
    """Three weighted sums of ``t``'s bits, read as words of at most 32 bits in row-major order,
    modulo a prime: word ``i`` of row ``r`` weighs ``table_k[i] · factor_k(r)``. Computed on
    ``t``'s device, ``2^22`` words at a time, with one host read of three numbers at the end; a
    small host tensor (lengths, a few ids) in Python, which is cheaper there and gives the same
    numbers, so a mask held on the CPU by one rank and on a GPU by another still agrees."""
    with torch.no_grad():
        words = _words(t)  # (N,)
        if words.device.type == "cpu" and words.numel() <= _SMALL:
            return _sums_on_host(words)
        return _sums_on_device(words)


def _sums_on_device(words: Tensor) -> tuple[int, ...]:
    narrow = words.element_size() < 4  # bool, 8- and 16-bit words: int32 products suffice
    dtype = torch.int32 if narrow else torch.int64
    tables = _tables(words.device).to(dtype)  # (3, ROW)
    ones = (1 << (8 * words.element_size())) - 1
    sums = torch.zeros(_SUMS, dtype=torch.int64, device=words.device)
    step = _ROW * _ROWS_PER_PASS
    for start in range(0, words.numel(), step):
        piece = words[start : start + step].to(dtype) & ones  # (m,) unsigned values of the words
        rows = -(-piece.numel() // _ROW)
        piece = torch.nn.functional.pad(piece, (0, rows * _ROW - piece.numel())).view(rows, _ROW)
        row = start // _ROW + torch.arange(rows, dtype=torch.int64, device=words.device)  # (rows,)
        for k, (a, b) in enumerate(_ROW_FACTORS):
            weighted = (piece * tables[k]).sum(1, dtype=torch.int64) % _PRIME  # (rows,)
            factor = (row * a + b) % (1 << 30) + 1  # (rows,) in [1, 2^30]
            sums[k] = (sums[k] + (weighted * factor % _PRIME).sum()) % _PRIME
    return tuple(sums.tolist())


def _sums_on_host(words: Tensor) -> tuple[int, ...]:
    """:func:`_sums_on_device` of at most one row, in Python."""
    ones = (1 << (8 * words.element_size())) - 1
    values = [w & ones for w in words.tolist()]
    tables = _host_tables()
    return tuple(
        sum(w * t for w, t in zip(values, tables[k])) % _PRIME * (b % (1 << 30) + 1) % _PRIME
        for k, (_, b) in enumerate(_ROW_FACTORS)
    )


def _words(t: Tensor) -> Tensor:
    """``t``'s bits as one contiguous row of 8-, 16- or 32-bit integers (a 64-bit element is two
    words, a complex one its real and imaginary parts), so floats count by their bits."""
    flat = t.detach().reshape(-1).contiguous()  # (N,), a device copy only when t is not contiguous
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    size = flat.element_size()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[size])


def _tables(device: torch.device) -> Tensor:
    """``(3, ROW)`` int64 weights in ``[1, 2^15)``, the same on every process (a fixed seed)."""
    table = _TABLES.get(device)
    if table is None:
        g = torch.Generator().manual_seed(0x6D68)
        table = torch.randint(1, 1 << 15, (_SUMS, _ROW), generator=g, dtype=torch.int64).to(device)
        _TABLES[device] = table
    return table


@functools.cache
def _host_tables() -> list[list[int]]:
    return _tables(torch.device("cpu"))[:, :_SMALL].tolist()


def _structure(value: object, tensors: list[Tensor]) -> object:
    """``value`` as plain data with every tensor replaced by its dtype, shape and place in
    ``tensors`` (fingerprinted afterwards): nothing here depends on an address or a device."""
    if isinstance(value, Value):  # a mask or a score modifier
        fields = vars(value)
        # Names starting with "_" are a mask's derived caches, not its value (multihead.masks.base).
        parts = tuple((k, _structure(fields[k], tensors)) for k in sorted(fields) if not k.startswith("_"))
        return (type(value).__qualname__, parts)
    if isinstance(value, Tensor):
        tensors.append(value)
        return ("tensor", str(value.dtype), tuple(value.shape), len(tensors) - 1)
    if isinstance(value, (tuple, list)):
        return tuple(_structure(v, tensors) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return value
    if isinstance(value, type):
        return value.__qualname__
    if callable(value):  # a function has no value across processes: its name
        return getattr(value, "__qualname__", type(value).__qualname__)
    return _ADDRESS.sub("", repr(value))
