"""The plain pieces of the variants' fp64 equations (``tests/layers/test_variants_*.py``), written
from the papers and the conventions, not from the package: a masked softmax that gives 0 on a row
with no key, RoPE as rotated pairs, an RMSNorm, and the masks as dense tables.

Each function works in the dtype it is given, so the same equations run in fp64 (the oracle) and
in fp32/bf16 (the naive baseline of the relative rule, shared/TESTING.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def linear(x: Tensor, params: dict, name: str) -> Tensor:
    """``x Wᵀ + b`` of the state-dict entries ``name.weight`` (and ``name.bias`` when present)."""
    y = x @ params[f"{name}.weight"].to(x.dtype).T
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias.to(x.dtype)


def softmax_rows(scores: Tensor, allowed: Tensor) -> Tensor:
    """``softmax`` over the keys where ``allowed``; a row with no allowed key is all zeros (and its
    gradient zero: the masked scores are replaced before the softmax, never after)."""
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~has_key, 0.0)


def rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Half-split RoPE of ``x (..., L, D)`` at ``positions (L,)``: pair ``(i, i + D/2)`` turned by
    ``p · base^(-2i/D)``, as GPT-NeoX writes it."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    angle = positions.to(torch.float64)[:, None] * theta  # (L, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + ε) · weight`` over the last dim."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def allowed_table(B: int, Lq: int, Lk: int, *, causal: bool = False, lengths: Tensor | None = None) -> Tensor:
    """``(B, Lq, Lk)`` bool, ``True`` = may attend: bottom-right causal (query ``i`` sees keys
    ``j <= i + Lk - Lq``) and/or keys ``j < lengths[b]``."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    table = torch.ones(B, Lq, Lk, dtype=torch.bool)
    if causal:
        table &= j <= i + (Lk - Lq)
    if lengths is not None:
        table &= j[None] < lengths[:, None, None]
    return table


def published_nsa(params, x, *, Hq, Hkv, D, l, d, ls, n, w, positions=None, visible=None):
    """NSA (Yuan et al., 2025) from the equations, one KV group and one query token at a time
    (``docs/variants.md``): compressed blocks ``φ(K[i·d : i·d + l] + pos)``, their attention over
    the blocks complete at the query, selection blocks scored by the compressed probabilities of
    the blocks overlapping them summed over the group's heads, block 0, the own block and the one
    before it forced, the best others by score (ties: the lower block), ``n`` in all; the sliding
    window of ``w`` keys; the three outputs mixed by ``σ(x W_g)`` per head. ``(B, L, E)``.
    ``visible (B, L, L)`` bool (a call's mask): a compressed block counts for a query only if it
    may see every key of the block, the selected and window branches read the keys it may see,
    and a branch with none gives 0."""
    B, L, _ = x.shape
    G = Hq // Hkv
    q = linear(x, params, "q_proj").unflatten(-1, (Hq, D)).transpose(1, 2)  # (B, Hq, L, D)
    k = linear(x, params, "k_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)  # (B, Hkv, L, D)
    v = linear(x, params, "v_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    if positions is not None:
        q, k = rope(q, positions), rope(k, positions)
    gates = torch.sigmoid(linear(x, params, "gate_proj")).unflatten(-1, (3, Hq))  # (B, L, 3, Hq)
    nC = (L - l) // d + 1 if L >= l else 0
    out = [[None] * Hq for _ in range(B)]
    for b in range(B):
        for g in range(Hkv):
            blocks_k = [
                linear((k[b, g, i * d : i * d + l] + params["compress_pos_k"]).reshape(-1), params, "compress_k")
                for i in range(nC)
            ]
            blocks_v = [
                linear((v[b, g, i * d : i * d + l] + params["compress_pos_v"]).reshape(-1), params, "compress_v")
                for i in range(nC)
            ]
            rows = {h: [] for h in range(g * G, (g + 1) * G)}
            for t in range(L):
                complete = [
                    i
                    for i in range(nC)
                    if i * d + l - 1 <= t and (visible is None or bool(visible[b, t, i * d : i * d + l].all()))
                ]
                o_cmp, p_cmp = {}, {}
                for h in rows:
                    if complete:
                        s = torch.stack([q[b, h, t] @ blocks_k[i] for i in complete]) / math.sqrt(D)
                        p = torch.softmax(s, dim=0)
                        o_cmp[h] = sum(p[j] * blocks_v[i] for j, i in enumerate(complete))
                        p_cmp[h] = {i: float(p[j]) for j, i in enumerate(complete)}
                    else:
                        o_cmp[h], p_cmp[h] = torch.zeros(D, dtype=x.dtype), {}
                own = t // ls
                score = {
                    j: sum(pc[i] for pc in p_cmp.values() for i in pc if i * d < (j + 1) * ls and i * d + l > j * ls)
                    for j in range(own + 1)
                }
                forced = sorted({0, own, own - 1} & set(score))
                others = sorted(set(score) - set(forced), key=lambda j: (-score[j], j))
                chosen = (forced + others)[:n]
                selected = sorted(p for j in chosen for p in range(j * ls, min((j + 1) * ls, t + 1)))
                window = list(range(max(0, t - w + 1), t + 1))
                if visible is not None:
                    selected = [p for p in selected if visible[b, t, p]]
                    window = [p for p in window if visible[b, t, p]]
                for h in rows:
                    o = []
                    for keys in (selected, window):
                        if not keys:
                            o.append(torch.zeros(D, dtype=x.dtype))
                            continue
                        s = k[b, g, keys] @ q[b, h, t] / math.sqrt(D)
                        o.append(torch.softmax(s, dim=0) @ v[b, g, keys])
                    gt = gates[b, t, :, h]
                    rows[h].append(gt[0] * o_cmp[h] + gt[1] * o[0] + gt[2] * o[1])
            for h in rows:
                out[b][h] = torch.stack(rows[h])  # (L, D)
    heads = torch.stack([torch.cat(out[b], dim=-1) for b in range(B)])  # (B, L, Hq·D)
    return linear(heads, params, "out_proj")


def published_topk_of(layer, params, x, rope=True, visible=None):
    """:func:`published_topk` with a ``TopKIndexerAttention``'s sizes (``rope``: positions
    ``0 .. L-1`` rotated, as the layer with a rotary embedding does)."""
    return published_topk(
        params,
        x,
        Hq=layer.num_heads,
        Hkv=layer.num_kv_heads,
        D=layer.head_dim,
        top_k=layer.top_k,
        HI=layer.index_heads,
        dI=layer.index_dim,
        positions=torch.arange(x.shape[1]) if rope else None,
        visible=visible,
    )


def published_topk(params, x, *, Hq, Hkv, D, top_k, HI, dI, positions=None, visible=None):
    """DSA's sparse attention (DeepSeek-V3.2) from the equations, one query token at a time:
    ``I(t, s) = Σ_j w_tj · ReLU(q_I,tj · k_I,s)`` over ``s <= t``, the ``top_k`` keys by ``I``
    (ties: the lower position), every head's softmax over them; ``visible (B, L, L)`` bool: only
    the keys it allows are candidates (a query with none gives 0). Returns ``(y, weights, chosen)``:
    ``(B, L, E)``, ``(B, Hq, L, L)`` and the chosen sets ``[b][t]``."""
    B, L, _ = x.shape
    q = linear(x, params, "q_proj").unflatten(-1, (Hq, D)).transpose(1, 2)  # (B, Hq, L, D)
    k = linear(x, params, "k_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    v = linear(x, params, "v_proj").unflatten(-1, (Hkv, D)).transpose(1, 2)
    if positions is not None:
        q, k = rope(q, positions), rope(k, positions)
    qi = linear(x, params, "index_q").unflatten(-1, (HI, dI))  # (B, L, HI, dI)
    ki = linear(x, params, "index_k")  # (B, L, dI)
    wi = linear(x, params, "index_w")  # (B, L, HI)
    weights = torch.zeros(B, Hq, L, L, dtype=x.dtype)
    heads = torch.zeros(B, Hq, L, D, dtype=x.dtype)
    chosen_all = []
    for b in range(B):
        chosen_b = []
        for t in range(L):
            score = {
                s: float(sum(wi[b, t, j] * torch.relu(qi[b, t, j] @ ki[b, s]) for j in range(HI)))
                for s in range(t + 1)
                if visible is None or bool(visible[b, t, s])
            }
            chosen = sorted(sorted(score, key=lambda s: (-score[s], s))[:top_k])
            chosen_b.append(chosen)
            if not chosen:
                continue
            for h in range(Hq):
                g = h // (Hq // Hkv)
                p = torch.softmax(k[b, g, chosen] @ q[b, h, t] / math.sqrt(D), dim=0)
                weights[b, h, t, chosen] = p
                heads[b, h, t] = p @ v[b, g, chosen]
        chosen_all.append(chosen_b)
    y = linear(heads.transpose(1, 2).flatten(-2), params, "out_proj")
    return y, weights, chosen_all
