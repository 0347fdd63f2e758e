"""Score modifiers and sinks in ring and Ulysses attention, in spawned worlds (issue 33, item 1).

Each check builds the whole-sequence inputs and one modifier (ALiBi, T5's trainable relative
bias, a trainable dense bias tensor over the whole sequence, softcap, trainable sinks, a user
``score_mod`` of absolute positions reading a trainable table, a chain), runs single-process
:func:`multihead.attention` in fp64 on the whole sequence, and compares this rank's rows of the
output and LSE, the gradients of its ``q``, ``k``, ``v`` shards, and the modifier's own gradients
summed over the ranks (each rank holds the share of its queries, as for any shared parameter),
with ``assert_close``. Ring steps read the modifier at each block's absolute positions; Ulysses
ranks read it at their heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import L, assert_sharded_layer, check, inputs, loss_of, make_mask

import multihead as mh
from multihead import masks, scores
from multihead.distributed import ring_attention, shard_sequence, ulysses_attention
from multihead.positions import ALiBi, RelativePositionBias


def modifier(name: str, B: int, Hq: int, Lq: int, Lk: int):
    """``(score_mod, sinks, trainable tensors)`` of a case, the same values on every rank."""
    g = torch.Generator().manual_seed(11)
    if name == "alibi":
        return ALiBi(Hq), None, ()
    if name == "alibi_top_left_softcap":
        return [ALiBi(Hq, align="top_left"), scores.softcap(2.5)], None, ()
    if name == "t5":
        rel = RelativePositionBias(Hq, num_buckets=8, max_distance=16, bidirectional=True, dtype=torch.float64)
        with torch.no_grad():
            rel.weight.copy_(torch.randn(rel.weight.shape, generator=g, dtype=torch.float64))
        return rel(), None, (rel.weight,)
    if name == "bias_tensor":
        t = torch.randn(B, Hq, Lq, Lk, generator=g, dtype=torch.float64).requires_grad_()
        return scores.bias(t), None, (t,)
    if name == "softcap":
        return scores.softcap(1.5), None, ()
    if name == "sinks":
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64).requires_grad_()
        return None, sinks, (sinks,)
    if name == "user_positions":
        table = torch.randn(Lk, generator=g, dtype=torch.float64).requires_grad_()
        slopes = torch.linspace(0.05, 0.3, Hq, dtype=torch.float64)

        def by_position(score, b, h, q_idx, kv_idx):
            return score + table[kv_idx] - slopes[h] * (q_idx - kv_idx).abs() + 0.1 * (q_idx % 5 == 0)

        return by_position, None, (table,)
    if name == "alibi_sinks":
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64).requires_grad_()
        return ALiBi(Hq), sinks, (sinks,)
    raise ValueError(name)


MODIFIERS = (
    "alibi",
    "alibi_top_left_softcap",
    "t5",
    "bias_tensor",
    "softcap",
    "sinks",
    "user_positions",
    "alibi_sinks",
)


def compare_modifier(
    fn, name, *, mask_kind, layout, B=2, Hq=4, Hkv=2, Lq=L, Lk=None, D=8, Dv=6, lse=True, shard=None, **kw
):
    """``fn`` against one process with modifier ``name`` (``None``: no modifier). ``shard``:
    this rank's shard of a whole ``(B, H, L, ·)`` tensor (default: ``shard_sequence`` in ``layout``)."""
    Lk = Lq if Lk is None else Lk
    q, k, v, gout, glse = inputs(B, Hq, Hkv, Lq, Lk, D, Dv, torch.float64, seed=4)
    mask = make_mask(mask_kind, B, Lq, Lk) if isinstance(mask_kind, str) else mask_kind  # a kind, or a mask
    score_mod, sinks, trainable = (None, None, ()) if name is None else modifier(name, B, Hq, Lq, Lk)
    if shard is None:
        shard = lambda t: shard_sequence(t, layout=layout, dim=2)  # noqa: E731

    # one process, the whole sequence
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    res = mh.attention(qf, kf, vf, mask=mask, score_mod=score_mod, sinks=sinks, return_lse=True)
    loss = loss_of(res.output, res.lse, gout, glse) if lse else (res.output * gout).sum()
    want = torch.autograd.grad(loss, (qf, kf, vf, *trainable))
    want_rows = [shard(t) for t in (res.output, res.lse, *want[:3])]

    # sharded
    qs, ks, vs = (shard(t).detach().requires_grad_() for t in (q, k, v))
    if score_mod is not None:
        kw["score_mod"] = score_mod
    if sinks is not None:
        kw["sinks"] = sinks
    got = fn(qs, ks, vs, mask=mask, layout=layout, return_lse=lse, **kw)
    out, out_lse = (got.output, got.lse) if lse else (got, None)
    loss = loss_of(out, out_lse, shard(gout), shard(glse)) if lse else (out * shard(gout)).sum()
    grads = list(torch.autograd.grad(loss, (qs, ks, vs, *trainable), allow_unused=True))
    for i, t in enumerate(trainable):  # this rank's share; the whole gradient is the sum over ranks
        share = torch.zeros_like(t) if grads[3 + i] is None else grads[3 + i].clone()
        dist.all_reduce(share)
        grads[3 + i] = share

    names = ["output", "lse", "dq", "dk", "dv"] + [f"d{name}[{i}]" for i in range(len(trainable))]
    for label, x, y in zip(names, [out, out_lse, *grads[:3]] + grads[3:], want_rows + list(want[3:])):
        if x is None:
            continue
        assert not torch.isnan(x).any(), f"{label}: NaN"
        torch.testing.assert_close(x, y, msg=lambda m: f"{label} ({name}, {mask_kind}, {layout}): {m}")


# zigzag in the default tier; contiguous in the slow one (the same code with other blocks)
for _layout, _tier in (("zigzag", ""), ("contiguous", "slow-")):
    for _name in MODIFIERS:

        def _ring(rank, world, name=_name, layout=_layout):
            for kind in ("causal", "none", "documents"):
                compare_modifier(ring_attention, name, mask_kind=kind, layout=layout)

        check(f"{_tier}ring-{_layout}-score-{_name}")(_ring)

        def _ulysses(rank, world, name=_name, layout=_layout):
            for kind in ("causal", "window_small"):
                compare_modifier(ulysses_attention, name, mask_kind=kind, layout=layout, Hq=3 * world, Hkv=world)

        check(f"{_tier}ulysses-{_layout}-score-{_name}")(_ulysses)


@check("ring-score-lengths-and-backends")
def _ring_lengths(rank, world):
    """Lq != Lk (bottom-right ALiBi binds Lk - Lq of the whole attention, not a block's), no LSE
    in the loss, and the reference backend for every block."""
    for lq, lk in ((L, 2 * L), (2 * L, L)):
        compare_modifier(ring_attention, "alibi", mask_kind="causal", layout="zigzag", Lq=lq, Lk=lk)
        compare_modifier(ring_attention, "t5", mask_kind="none", layout="contiguous", Lq=lq, Lk=lk)
    compare_modifier(ring_attention, "user_positions", mask_kind="window_small", layout="zigzag", lse=False)
    compare_modifier(ring_attention, "alibi_sinks", mask_kind="causal", layout="zigzag", backend="reference")
    compare_modifier(ring_attention, "t5", mask_kind="padding", layout="zigzag", Hq=4, Hkv=1)


@check("ulysses-score-replicated-kv")
def _ulysses_replicated(rank, world):
    """Hkv = 1 < P (the KV head replicated) with per-head modifiers."""
    for name in ("alibi_sinks", "t5", "bias_tensor"):
        compare_modifier(ulysses_attention, name, mask_kind="causal", layout="zigzag", Hq=2 * world, Hkv=1)


@check("context-parallel-layer-score-mods")
def _layer_modifiers(rank, world):
    """``MultiHeadAttention(context_parallel=cp)`` with T5's trainable relative bias, softcap and
    trainable sinks (GQA, RoPE, causal) on a sharded input: its output rows and every parameter's
    gradient (summed over ranks) equal the layer on the whole sequence."""
    from multihead.distributed import ContextParallel
    from multihead.positions import RotaryEmbedding

    E, H, Hkv = 16, 2 * world, world
    torch.manual_seed(0)
    rel = RelativePositionBias(H, num_buckets=8, max_distance=16)
    options = dict(num_kv_heads=Hkv, rope=RotaryEmbedding(4), causal=True, sinks=True, softcap=4.0)
    layer = mh.MultiHeadAttention(E, H, score_mod=rel, head_dim=4, **options).double()
    with torch.no_grad():
        layer.sinks.copy_(torch.linspace(-1, 1, H))
    x = torch.randn(2, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    window = masks.sliding_window(7)
    want = layer(x, mask=window)
    want_grads = torch.autograd.grad((want * want).sum(), list(layer.parameters()))
    for method in ("ring", "ulysses"):
        cp = ContextParallel(layout="zigzag", method=method)
        sharded = mh.MultiHeadAttention(
            E,
            H,
            score_mod=RelativePositionBias(H, num_buckets=8, max_distance=16),
            head_dim=4,
            context_parallel=cp,
            **options,
        ).double()
        sharded.load_state_dict(layer.state_dict())
        out = sharded(cp.shard(x, dim=1), mask=window)  # (B, L/P, E)
        assert_sharded_layer(sharded, out, cp, want, want_grads, f"layer {method} ")


@check("score-mods-bad-input-raises-everywhere")
def _bad_modifiers(rank, world):
    """Ranks that disagree on a modifier, on the sinks, or on whether the modifier's tensors need a
    gradient, and one rank's modifier that does not fit the whole attention, raise the same error
    on every rank before anything moves; the group still works afterwards."""
    import pytest

    B, Hq, S = 1, 2 * world, L // world
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, S, 8, generator=g, dtype=torch.float64)
    kv = q[:, :world]
    last = rank == world - 1
    for fn in (ring_attention, ulysses_attention):
        where = fn.__name__
        with pytest.raises(ValueError, match=rf"{where}: ranks disagree on score_mod"):
            fn(q, kv, kv, score_mod=scores.softcap(2.0 if last else 3.0))
        sinks = torch.zeros(Hq, dtype=torch.float64) + (1.0 if last else 0.0)
        with pytest.raises(ValueError, match=rf"{where}: ranks disagree on sinks"):
            fn(q, kv, kv, sinks=sinks)
        table = torch.zeros(L, dtype=torch.float64).requires_grad_(last)
        with pytest.raises(ValueError, match=rf"{where}: ranks disagree on requires_grad"):
            fn(q, kv, kv, score_mod=scores.bias(table.view(1, L)))
        bad = ALiBi(Hq + 1 if last else Hq)
        with pytest.raises(
            ValueError, match=rf"{where}: (rank {world - 1} received bad input.*)?score_mod does not fit the whole"
        ):
            fn(q, kv, kv, score_mod=bad)
    compare_modifier(ring_attention, "alibi_sinks", mask_kind="causal", layout="zigzag")  # still usable
