"""The cases and the checks the variant layers' tests share (``tests/layers/test_variants_*.py``,
``test_token_selection.py``): heads (MHA, GQA, MQA), lengths (self-attention, ``Lq != Lk`` both
ways, one query), masks with their dense tables (a row with no key included), the layer's
parameters in fp64, a drawn input, one comparison of outputs and every gradient against the fp64
equations; and decoding through a cache against the full forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import multihead as mh
from multihead.caches import DynamicKVCache, StaticKVCache
from variants_math import allowed_table

# (Hq, Hkv): MHA, GQA, MQA; (Lq, Lk) with Lq == Lk for self-attention; mask kinds.
HEADS = [(6, 6), (6, 2), (6, 1)]
SHAPES = [(13, 13), (7, 11), (11, 7), (1, 9)]
MASKS = ["none", "causal", "padding"]


def mask_case(kind: str, B: int, Lq: int, Lk: int) -> tuple[mh.Mask | None, Tensor]:
    """The call's mask object and the dense table ``(B, Lq, Lk)`` the equations read; ``padding``
    leaves batch row 1 with no key at all (fully masked rows)."""
    if kind == "none":
        return None, allowed_table(B, Lq, Lk)
    if kind == "causal":
        return mh.causal(), allowed_table(B, Lq, Lk, causal=True)
    lengths = torch.tensor([Lk - 2, 0, Lk][:B])
    return mh.key_padding(lengths), allowed_table(B, Lq, Lk, lengths=lengths)


def fp64_params(layer: nn.Module) -> dict[str, Tensor]:
    """The layer's state dict in fp64, detached: what the equations read."""
    return {name: p.detach().double() for name, p in layer.state_dict().items()}


def draw(B: int, L: int, E: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> Tensor:
    """An input ``(B, L, E)`` drawn from its own seeded generator."""
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def assert_gradients_match(layer: nn.Module, out: Tensor, expected: Tensor, inputs: list[Tensor], params: dict) -> None:
    """The gradients of ``out`` (the layer's) and ``expected`` (the equations' on ``params``, leaves
    that require grad) for one random output gradient: of each of ``inputs`` (named ``x``,
    ``memory``) and of every parameter, finite and close."""
    grad = torch.randn_like(out)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad(out, [*inputs, *layer.parameters()], grad)
    want = torch.autograd.grad(expected, [*inputs, *(params[n] for n in names)], grad)
    for name, g, w in zip(["x", "memory"][: len(inputs)] + names, got, want, strict=True):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"gradient of {name}: {m}")


def assert_prefill_and_decode(layer: nn.Module, x: Tensor, full: Tensor, cache: str, Hkv: int, D: int) -> None:
    """A prompt of 6 tokens of ``x (2, 13, E)``, then one token at a time, then a chunk of 4,
    through a ``cache`` (``"dynamic"`` or ``"static"``), equals ``full``: the causal forward of
    all 13 at once."""
    kv = DynamicKVCache() if cache == "dynamic" else StaticKVCache(2, 16, Hkv, D, dtype=torch.float64)
    pieces = [layer(x[:, :6], kv_cache=kv)]
    pieces += [layer(x[:, t : t + 1], kv_cache=kv) for t in range(6, 9)]
    pieces.append(layer(x[:, 9:], kv_cache=kv))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def assert_decode_steps(layer: nn.Module, x: Tensor, prefill: int, step: int, **call: object) -> None:
    """Without autograd: a prefill of ``prefill`` tokens of ``x (B, L, E)``, then chunks of ``step``
    through one :class:`~multihead.caches.DynamicKVCache`, equals the forward of all ``L`` at once;
    ``call``: the same keyword arguments on every call (a mask object at absolute positions)."""
    with torch.no_grad():
        full = layer(x, **call)
        cache = DynamicKVCache()
        outs = [layer(x[:, :prefill], kv_cache=cache, **call)]
        for t in range(prefill, x.shape[1], step):
            outs.append(layer(x[:, t : t + step], kv_cache=cache, **call))
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
