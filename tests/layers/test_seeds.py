"""Every seed system of ``shared/seeds/``, rebuilt from its math, reproduced by `MultiHeadAttention`.

Each ``Seed*`` class below re-derives one seed's computation from the equations it teaches
(written here, not copied: two of the seeds do not run as written). The test copies its weights
into ``q_proj/k_proj/v_proj/out_proj`` and requires equal outputs in fp64, with and without masks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh

DT = torch.float64


def _copy(layer: mh.MultiHeadAttention, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear):
    """Copy four linear maps into the layer's projections (biases included when present)."""
    with torch.no_grad():
        for dst, src in ((layer.q_proj, q), (layer.k_proj, k), (layer.v_proj, v), (layer.out_proj, o)):
            assert dst.weight.shape == src.weight.shape
            dst.weight.copy_(src.weight)
            assert (dst.bias is None) == (src.bias is None)
            if src.bias is not None:
                dst.bias.copy_(src.bias)


# ------------------------------------------------------------------------------ 000 / 002: labml
class SeedLabml(nn.Module):
    """labml MHA: sequence-first ``[L, B, E]``; ``S_ijbh = sum_d Q_ibhd K_jbhd``, scaled by
    ``1/sqrt(d_k)``; mask ``[Lq|1, Lk, B|1]`` with 0 = blocked; softmax over ``j``;
    ``X_ibhd = sum_j P_ijbh V_jbhd``; heads concatenated; output linear.

    ``value_bias_always=True`` is labml (000: the value projection is biased whatever ``bias``
    says); ``False`` is the Spanish re-implementation (002: ``bias`` applies to the value too).
    """

    def __init__(self, heads, d_model, bias=True, value_bias_always=True):
        super().__init__()
        self.h, self.d_k = heads, d_model // heads
        self.query = nn.Linear(d_model, d_model, bias=bias)
        self.key = nn.Linear(d_model, d_model, bias=bias)
        self.value = nn.Linear(d_model, d_model, bias=bias or value_bias_always)
        self.output = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        Lq, B, _ = query.shape
        q = self.query(query).unflatten(-1, (self.h, self.d_k))  # [Lq, B, h, d_k]
        k = self.key(key).unflatten(-1, (self.h, self.d_k))  # [Lk, B, h, d_k]
        v = self.value(value).unflatten(-1, (self.h, self.d_k))
        s = torch.einsum("ibhd,jbhd->ijbh", q, k) / math.sqrt(self.d_k)
        if mask is not None:
            s = s.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))  # same mask for every head
        p = s.softmax(dim=1)
        x = torch.einsum("ijbh,jbhd->ibhd", p, v)
        return self.output(x.reshape(Lq, B, -1))


def labml_mask_to_multihead(mask: torch.Tensor) -> torch.Tensor:
    """labml ``[Lq|1, Lk, B|1]``, 0 = blocked -> multihead bool ``(B|1, 1, Lq|1, Lk)``, True = attend."""
    return (mask != 0).permute(2, 0, 1).unsqueeze(1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("value_bias_always", [True, False], ids=["000-labml", "002-spanish"])
@pytest.mark.parametrize("mask_kind", ["none", "full", "broadcast_q", "broadcast_b"])
def test_labml_family(bias, value_bias_always, mask_kind):
    torch.manual_seed(0)
    H, E, Lq, Lk, B = 4, 32, 7, 11, 3
    seed = SeedLabml(H, E, bias=bias, value_bias_always=value_bias_always).to(DT)
    layer = mh.MultiHeadAttention(E, H, qkv_bias=(bias, bias, bias or value_bias_always), batch_first=False, dtype=DT)
    _copy(layer, seed.query, seed.key, seed.value, seed.output)
    query, kv = torch.randn(Lq, B, E, dtype=DT), torch.randn(Lk, B, E, dtype=DT)
    shape = {"none": None, "full": (Lq, Lk, B), "broadcast_q": (1, Lk, B), "broadcast_b": (Lq, Lk, 1)}[mask_kind]
    mask = None
    if shape is not None:
        mask = (torch.rand(shape) > 0.4).to(DT)  # 0/1 floats, as in the tutorial
        mask[:, 0] = 1  # every query sees a key: the seed gives NaN otherwise (see the next test)
    expected = seed(query, kv, kv, mask)
    got = layer(query, kv, mask=None if mask is None else labml_mask_to_multihead(mask))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(layer(kv), seed(kv, kv, kv))  # self-attention: the fused-projection path


def test_labml_fully_masked_row_is_finite():
    """The labml seed gives NaN for a query that sees no key; multihead gives attention 0."""
    torch.manual_seed(1)
    H, E, L, B = 2, 16, 5, 2
    seed = SeedLabml(H, E).to(DT)
    layer = mh.MultiHeadAttention(E, H, batch_first=False, dtype=DT)
    _copy(layer, seed.query, seed.key, seed.value, seed.output)
    x = torch.randn(L, B, E, dtype=DT)
    mask = torch.ones(L, L, B, dtype=DT)
    mask[2, :, 1] = 0  # query 2 of batch 1 sees nothing
    assert seed(x, x, x, mask)[2, 1].isnan().all()
    got = layer(x, mask=labml_mask_to_multihead(mask))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[2, 1], layer.out_proj.bias)  # attention 0, then out_proj
    keep = torch.ones(L, B, dtype=torch.bool)
    keep[2, 1] = False
    torch.testing.assert_close(got[keep], seed(x, x, x, mask)[keep])


# ------------------------------------------------------------------------------ 001: LLM book
class SeedBook(nn.Module):
    """The causal MHA of *LLMs from scratch*: batch-first, ``qkv_bias=False``, a biased output
    projection, causal ``triu(..., 1)`` blocking, dropout on the weights. Rebuilt without its
    ``block_size`` buffer: the mask is made at the input's length."""

    def __init__(self, d_in, d_out, num_heads, qkv_bias=False):
        super().__init__()
        self.h, self.hd = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.h, self.hd).transpose(1, 2) for w in (self.W_query, self.W_key, self.W_value))
        s = q @ k.transpose(2, 3)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s / self.hd**0.5, dim=-1)
        return self.out_proj((p @ v).transpose(1, 2).reshape(b, T, -1))


@pytest.mark.parametrize("T", [5, 16, 3 * 16 + 1], ids=lambda t: f"T{t}")
def test_book_causal_beyond_block_size(T):
    """The book registers a ``block_size`` x ``block_size`` mask (16 here), so it fails beyond it;
    ``causal=True`` has no such limit."""
    torch.manual_seed(2)
    d, H = 24, 4
    seed = SeedBook(d, d, H).to(DT)
    layer = mh.MultiHeadAttention(d, H, qkv_bias=False, causal=True, dropout=0.1, dtype=DT).eval()
    _copy(layer, seed.W_query, seed.W_key, seed.W_value, seed.out_proj)
    x = torch.randn(2, T, d, dtype=DT)
    torch.testing.assert_close(layer(x), seed(x))
    # a padding mask on top of causal=True: the book's math with its keys masked too
    lengths = torch.tensor([T, max(1, T // 2)])
    got = layer(x, mask=mh.key_padding(lengths))
    for b in range(2):  # padding keys at the end of a causal sequence do not change earlier rows
        n = int(lengths[b])
        torch.testing.assert_close(got[b, :n], seed(x[b : b + 1, :n])[0])


def test_book_with_d_in_not_d_out():
    """The book allows ``d_in != d_out``: ``head_dim = d_out // H`` and an ``out_proj`` of
    ``d_out -> d_out`` swapped in (the layer only calls it)."""
    torch.manual_seed(3)
    d_in, d_out, H = 12, 8, 2
    seed = SeedBook(d_in, d_out, H, qkv_bias=True).to(DT)
    layer = mh.MultiHeadAttention(d_in, H, head_dim=d_out // H, causal=True, dtype=DT)
    layer.out_proj = nn.Linear(d_out, d_out, dtype=DT)
    _copy(layer, seed.W_query, seed.W_key, seed.W_value, seed.out_proj)
    x = torch.randn(3, 9, d_in, dtype=DT)
    torch.testing.assert_close(layer(x), seed(x))


# ------------------------------------------------------------------------------ 003: plain MHA
class SeedPlain(nn.Module):
    """Minimal batch-first MHA: bias-free ``W_q, W_k, W_v``, a biased ``W_o``, no mask."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.h, self.d_k = num_heads, d_model // num_heads
        self.W_q, self.W_k, self.W_v = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, L, E = x.shape
        Q, K, V = (w(x).view(B, L, self.h, self.d_k).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        P = F.softmax(Q @ K.transpose(-2, -1) / math.sqrt(self.d_k), dim=-1)
        return self.W_o((P @ V).transpose(1, 2).reshape(B, L, E))


def test_plain_mha():
    torch.manual_seed(4)
    seed = SeedPlain(64, 8).to(DT)
    layer = mh.MultiHeadAttention(64, 8, qkv_bias=False, dtype=DT)
    _copy(layer, seed.W_q, seed.W_k, seed.W_v, seed.W_o)
    x = torch.randn(2, 10, 64, dtype=DT)
    torch.testing.assert_close(layer(x), seed(x))
    torch.testing.assert_close(layer(x, x.clone(), x.clone()), seed(x))  # unfused projections


# ------------------------------------------------------------------------------ 004: MHA + MQA
class SeedMasked(nn.Module):
    """MHA with an optional mask (``mask == 0`` blocked, e.g. ``tril(ones)``), all biased; with
    ``multi_query=True``, Multi-Query Attention: ``W_K, W_V: E -> d_k``, one K/V head shared by
    every query head (the seed's MQA code crashes; this is its math)."""

    def __init__(self, d_model, num_heads, multi_query=False):
        super().__init__()
        self.h, self.d_k = num_heads, d_model // num_heads
        kv = self.d_k if multi_query else d_model
        self.kv_heads = 1 if multi_query else num_heads
        self.W_Q, self.W_K = nn.Linear(d_model, d_model), nn.Linear(d_model, kv)
        self.W_V, self.W_O = nn.Linear(d_model, kv), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, L, E = x.shape
        Q = self.W_Q(x).view(B, L, self.h, self.d_k).transpose(1, 2)
        K = self.W_K(x).view(B, L, self.kv_heads, self.d_k).transpose(1, 2)  # broadcasts when 1 head
        V = self.W_V(x).view(B, L, self.kv_heads, self.d_k).transpose(1, 2)
        S = Q @ K.transpose(-1, -2) / math.sqrt(self.d_k)
        if mask is not None:
            S = S.masked_fill(mask == 0, float("-inf"))
        return self.W_O((F.softmax(S, dim=-1) @ V).transpose(1, 2).reshape(B, L, E))


@pytest.mark.parametrize("multi_query", [False, True], ids=["004-mha", "004-mqa"])
@pytest.mark.parametrize("mask_kind", ["none", "tril", "random"])
def test_masked_mha_and_mqa(multi_query, mask_kind):
    torch.manual_seed(5)
    E, H, B, L = 48, 6, 2, 9
    seed = SeedMasked(E, H, multi_query).to(DT)
    if multi_query:
        layer = mh.MultiQueryAttention(E, H, dtype=DT)
        assert layer.k_proj.weight.shape == (E // H, E)
    else:
        layer = mh.MultiHeadAttention(E, H, dtype=DT)
    _copy(layer, seed.W_Q, seed.W_K, seed.W_V, seed.W_O)
    x = torch.randn(B, L, E, dtype=DT)
    mask = {"none": None, "tril": torch.tril(torch.ones(L, L)), "random": (torch.rand(B, 1, L, L) > 0.5).float()}[
        mask_kind
    ]
    if mask_kind == "random":
        mask[..., 0] = 1  # no fully masked rows: the seed would give NaN
    expected = seed(x, mask)
    got = layer(x, mask=None if mask is None else mask != 0)  # the seed's polarity: 0 = blocked
    torch.testing.assert_close(got, expected)
    if mask_kind == "tril":  # the seed's tril mask is exactly causal=True
        causal_layer = mh.MultiHeadAttention(E, H, num_kv_heads=layer.num_kv_heads, causal=True, dtype=DT)
        causal_layer.load_state_dict(layer.state_dict())
        torch.testing.assert_close(causal_layer(x), expected)
