"""The layer's seams: ``kv_cache=``, ``positions=`` and an injected ``rope=``, and the one helper
(``attend_heads``) that every layer and model ends with.

The rotary module here is a stand-in with the protocol ``rope(x, positions) -> x`` (the positions
issue ships the real one): it rotates each pair of features ``(2i, 2i+1)`` of a token at position
``p`` by the angle ``p · θ_i``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh
from multihead.caches import DynamicKVCache
from multihead.layers.compat import MultiheadAttention
from multihead.models import CausalDecoder, DecoderConfig

DT = torch.float64


class PairRotation(nn.Module):
    """A stand-in rotary embedding: feature pair ``i`` of a token at position ``p`` turned by ``p · θ_i``.

    Records ``(shape of x, positions)`` of every call, so tests can see where it was applied."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("theta", 10.0 ** (-torch.arange(0, head_dim, 2, dtype=DT) / head_dim), persistent=False)
        self.calls: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def forward(self, x, positions):  # x (B, H, L, D), positions (L,) or (B, L)
        assert positions.dtype == torch.int64  # the protocol
        self.calls.append((tuple(x.shape), positions.clone()))
        angle = positions.to(DT)[..., None] * self.theta  # (L, D/2) or (B, L, D/2)
        if angle.dim() == 3:
            angle = angle[:, None]  # (B, 1, L, D/2): one angle for every head
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)  # (B, H, L, D)


@torch.no_grad()
def reference(layer: mh.MultiHeadAttention, x, positions=None):
    """The causal self-attention layer computed plainly in fp64, the stand-in rotation applied by
    hand at ``positions`` when the layer has a rope. ``x`` in the layer's layout."""
    if not layer.batch_first:
        x = x.transpose(0, 1)
    x = x.double()
    D = layer.head_dim

    def heads(proj, n):
        w, b = proj.weight.double(), None if proj.bias is None else proj.bias.double()
        return F.linear(x, w, b).unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, L, D)

    q, k, v = (
        heads(layer.q_proj, layer.num_heads),
        heads(layer.k_proj, layer.num_kv_heads),
        heads(layer.v_proj, layer.num_kv_heads),
    )
    if layer.rope is not None:
        rope = PairRotation(D)
        positions = torch.arange(x.shape[1]) if positions is None else positions
        q, k = rope(q, positions), rope(k, positions)
    out = mh.reference_attention(q, k, v, mask=mh.causal() if layer.causal else None, compute_dtype=DT).output
    out = F.linear(out.transpose(1, 2).flatten(2), layer.out_proj.weight.double(), layer.out_proj.bias.double())
    return out if layer.batch_first else out.transpose(0, 1)


def _layer(Hq=4, Hkv=None, *, batch_first=True, dtype=DT, rope=False, E=24, **kw):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(
        E,
        Hq,
        num_kv_heads=Hkv,
        causal=True,
        batch_first=batch_first,
        dtype=dtype,
        rope=PairRotation(E // Hq) if rope else None,
        **kw,
    )


def _decode(layer, x, chunks, **kw):
    """Feed ``x`` (layer's layout) through a fresh cache in chunks of the given lengths; the outputs
    concatenated along L, and the cache."""
    cache, outs, t = DynamicKVCache(), [], 0
    seq = 1 if layer.batch_first else 0
    for n in chunks:
        outs.append(layer(x.narrow(seq, t, n), kv_cache=cache, **kw))
        t += n
        assert cache.length == t
    return torch.cat(outs, dim=seq), cache


# ------------------------------------------------------------------------------ the cache seam
SCHEDULES = {"prefill+steps": [5, 1, 1, 1, 1], "chunked": [3, 4, 1, 2], "steps-only": [1] * 9}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["fp32", "fp64"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "sf"])
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_cached_decoding_equals_the_full_causal_forward(Hkv, batch_first, dtype, rope, schedule):
    layer = _layer(4, Hkv, batch_first=batch_first, dtype=dtype, rope=rope).eval()
    chunks = SCHEDULES[schedule]
    L, B = sum(chunks), 2
    x = torch.randn((B, L, 24) if batch_first else (L, B, 24), dtype=dtype)
    with torch.no_grad():
        full = layer(x)
        cached, cache = _decode(layer, x, chunks)
    torch.testing.assert_close(cached, full)  # the default tolerances of the dtype
    assert tuple(cache.keys.shape) == (B, Hkv, L, 6) and cache.length == L
    if dtype == DT:
        torch.testing.assert_close(cached, reference(layer, x))


def test_cached_weights_are_the_rows_of_the_full_weights_and_are_captured():
    layer = _layer(4, 2).eval()
    x = torch.randn(2, 7, 24, dtype=DT)
    _, full = layer(x, need_weights=True)  # (B, Hq, 7, 7)
    cache = DynamicKVCache()
    layer(x[:, :4], kv_cache=cache)
    with mh.capture_attention(layer) as cap:
        out, w = layer(x[:, 4:6], kv_cache=cache, need_weights=True)
    assert w.shape == (2, 4, 2, 6)
    torch.testing.assert_close(w, full[:, :, 4:6, :6])
    torch.testing.assert_close(cap.weights[0], w)


def test_a_call_mask_covers_all_cached_keys():
    """With a cache the call's mask is over ``(B, Hq, Lq, T)``, combined with the bottom-right causal."""
    layer = _layer(4, 2).eval()
    x = torch.randn(2, 8, 24, dtype=DT)
    padding = mh.key_padding(torch.tensor([8, 3]))  # batch 1 ignores keys 3.. everywhere
    full = layer(x, mask=padding)
    cached, _ = _decode(layer, x, [4, 1, 3], mask=padding)
    torch.testing.assert_close(cached, full)
    dense = torch.rand(2, 1, 8, 8) > 0.3  # a tensor mask: each call passes the rows of its queries
    dense[..., 0] = True
    cache, outs = DynamicKVCache(), []
    for q0, q1 in [(0, 5), (5, 6), (6, 8)]:
        outs.append(layer(x[:, q0:q1], kv_cache=cache, mask=dense[:, :, q0:q1, :q1]))
    torch.testing.assert_close(torch.cat(outs, dim=1), layer(x, mask=dense))


def test_without_causal_new_tokens_see_each_other_and_the_cache():
    torch.manual_seed(1)
    layer = mh.MultiHeadAttention(16, 2, dtype=DT).eval()  # causal=False
    x = torch.randn(1, 6, 16, dtype=DT)
    cache = DynamicKVCache()
    layer(x[:, :4], kv_cache=cache)
    out = layer(x[:, 4:], kv_cache=cache)
    torch.testing.assert_close(out, layer(x[:, 4:], x, x))  # queries 4, 5 over all six keys


# ------------------------------------------------------------------------------ the rope seam
def test_rope_rotates_queries_and_keys_at_the_given_positions():
    layer = _layer(4, 2, rope=True).eval()
    x = torch.randn(2, 5, 24, dtype=DT)
    shared = torch.tensor([7, 8, 9, 10, 11])  # (Lq,)
    per_batch = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8]])  # (B, Lq), e.g. left padding in batch 0
    for positions in (shared, per_batch):
        torch.testing.assert_close(layer(x, positions=positions), reference(layer, x, positions))
    # q with Hq heads and the keys with Hkv heads, both at the same positions
    layer.rope.calls.clear()
    layer(x, positions=per_batch)
    (q_shape, q_pos), (k_shape, k_pos) = layer.rope.calls
    assert (q_shape, k_shape) == ((2, 4, 5, 6), (2, 2, 5, 6))
    assert torch.equal(q_pos, per_batch) and torch.equal(k_pos, per_batch)
    # default positions: arange(Lq), so the rotation is seen (the plain layer would differ)
    torch.testing.assert_close(layer(x), reference(layer, x, torch.arange(5)))
    plain = _layer(4, 2).eval()
    assert not torch.allclose(layer(x), plain(x))


def test_cached_rope_positions_continue_from_the_cache_length():
    layer = _layer(4, 1, rope=True).eval()
    x = torch.randn(1, 6, 24, dtype=DT)
    _decode(layer, x, [3, 1, 2])
    positions = [p.tolist() for _, p in layer.rope.calls]
    assert positions == [[0, 1, 2]] * 2 + [[3]] * 2 + [[4, 5]] * 2  # q then the new keys, each step
    assert [shape[2] for shape, _ in layer.rope.calls] == [3, 3, 1, 1, 2, 2]  # only the new keys are rotated


def test_explicit_positions_with_a_cache_are_used_as_given():
    """Left-padded prompts: batch 0 has two pads, so its tokens sit at positions 0.. from column 2."""
    layer = _layer(4, 2, rope=True).eval()
    x = torch.randn(2, 6, 24, dtype=DT)
    positions = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    full = layer(x, positions=positions)
    cache, outs = DynamicKVCache(), []
    for q0, q1 in [(0, 4), (4, 5), (5, 6)]:
        outs.append(layer(x[:, q0:q1], kv_cache=cache, positions=positions[:, q0:q1]))
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
    torch.testing.assert_close(full, reference(layer, x, positions))


def test_rope_none_changes_nothing():
    plain = _layer(4, 2).eval()
    x = torch.randn(2, 5, 24, dtype=DT)
    expected = reference(plain, x)
    torch.testing.assert_close(plain(x), expected)
    torch.testing.assert_close(plain(x, positions=torch.tensor([9, 3, 1, 0, 2])), expected)  # unused without rope
    identity = _layer(4, 2, rope=False).eval()
    identity.rope = lambda t, positions: t  # any callable serves
    torch.testing.assert_close(identity(x), expected)
    rotated = _layer(4, 2, rope=True)
    assert set(rotated.state_dict()) == set(plain.state_dict())  # the stand-in's buffer is not persistent
    assert "rope" not in repr(plain) and "(rope): PairRotation()" in repr(rotated)
    assert "rope=<lambda>" in repr(identity)


def test_relative_positions_only():
    """A rotation by position makes scores depend on position differences: shifting every
    position by the same amount changes nothing (a property of RoPE the stand-in shares)."""
    layer = _layer(4, 2, rope=True).eval()
    x = torch.randn(2, 5, 24, dtype=DT)
    torch.testing.assert_close(layer(x, positions=torch.arange(5) + 100), layer(x))


# ------------------------------------------------------------------------------ bad calls
x5 = torch.randn(2, 5, 24, dtype=DT)
x1 = torch.randn(2, 1, 24, dtype=DT)
memory = torch.randn(2, 7, 24, dtype=DT)

BAD = [  # (name, layer options, call(layer, cache), error, message); the cache holds 5 tokens of _layer(4, 2)
    (
        "positions float",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=torch.tensor([5.0])),
        TypeError,
        r"positions must be None or an integer tensor \(Lq,\) = \(1,\) .*\(torch.int64\), got dtype torch.float32",
    ),
    (
        "positions bool",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=torch.tensor([True])),
        TypeError,
        r"positions must be None or an integer tensor .*\(torch.int64\), got dtype torch.bool",
    ),
    (
        "positions list",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=[5]),
        TypeError,
        r"positions must be None or an integer tensor \(Lq,\) = \(1,\) or \(B, Lq\) = \(2, 1\) .*got list",
    ),
    (
        "positions length",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=torch.tensor([5, 6])),
        ValueError,
        r"positions must have shape \(Lq,\) = \(1,\) or \(B, Lq\) = \(2, 1\), got \(2,\)",
    ),
    (
        "positions batch",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=torch.tensor([[5]])),
        ValueError,
        r"positions must have shape .* got \(1, 1\)",
    ),
    (
        "positions 3-D",
        {},
        lambda m, c: m(x1, kv_cache=c, positions=torch.zeros(2, 1, 1, dtype=torch.long)),
        ValueError,
        r"positions must have shape .* got \(2, 1, 1\)",
    ),
    (
        "cross-attention",
        {},
        lambda m, c: m(x1, memory, kv_cache=c),
        ValueError,
        r"kv_cache is only valid for self-attention \(key=None or key=query\)"
        r".*got a separate key of shape \(2, 7, 24\)",
    ),
    (
        "cross-attention, key is a copy",
        {},
        lambda m, c: m(x1, x1.clone(), kv_cache=c),
        ValueError,
        r"kv_cache is only valid for self-attention",
    ),
    (
        "not a cache",
        {},
        lambda m, c: m(x1, kv_cache={"k": None}),
        TypeError,
        r"kv_cache must be None or a multihead.caches.KVCache \(for example DynamicKVCache\(\)\), got dict",
    ),
    (
        "cache of other kv heads",
        {"Hkv": 4},
        lambda m, c: m(x1, kv_cache=c),
        ValueError,
        r"DynamicKVCache.update: new keys/values have Hkv=4 but the cache holds Hkv=2 \(5 tokens",
    ),
    (
        "cache of other batch",
        {},
        lambda m, c: m(torch.randn(3, 1, 24, dtype=DT), kv_cache=c),
        ValueError,
        r"DynamicKVCache.update: new keys/values have B=3 but the cache holds B=2",
    ),
    (
        "cache of other dtype",
        {"dtype": torch.float32},
        lambda m, c: m(x1.float(), kv_cache=c),
        TypeError,
        r"DynamicKVCache.update: new keys/values have dtype torch.float32 but the cache holds torch.float64",
    ),
    (
        "mask over cached keys only",
        {},
        lambda m, c: m(x1, kv_cache=c, mask=torch.ones(2, 1, 1, 5, dtype=torch.bool)),
        ValueError,
        r"\(2, 1, 1, 5\) is not broadcastable to \(B, H, Lq, Lk\) = \(2, 4, 1, 6\)",
    ),
    (
        "rope with cross-attention",
        {"rope": True},
        lambda m, c: m(x5, memory),
        ValueError,
        r"rope rotates the keys at the query positions, so it needs self-attention .* shape \(2, 7, 24\)",
    ),
    (
        "rope of the wrong shape",
        {},
        lambda m, c: _with_rope(m, lambda t, p: t[..., :2])(x1, kv_cache=c),
        ValueError,
        r"rope must return a tensor of the shape it was given; for the query heads \(B, H, L, D\) = "
        r"\(2, 4, 1, 6\) it returned \(2, 4, 1, 2\)",
    ),
]


def _with_rope(layer, rope):
    layer.rope = rope
    return layer


@pytest.mark.parametrize("options, call, error, pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_call_leaves_the_cache_unchanged(options, call, error, pattern):
    cache = DynamicKVCache()
    _layer(4, 2).eval()(x5, kv_cache=cache)  # 5 tokens of a GQA layer with 2 KV heads, fp64
    keys, values = cache.keys.clone(), cache.values.clone()
    options = {"Hkv": 2, **options}
    layer = _layer(4, options.pop("Hkv"), **options).eval()
    with pytest.raises(error, match=pattern):
        call(layer, cache)
    assert cache.length == 5 and torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


def test_constructor_refuses_a_rope_that_is_not_callable():
    with pytest.raises(TypeError, match=r"rope must be None or a callable rope\(x, positions\) -> x .* got int 3"):
        mh.MultiHeadAttention(16, 2, rope=3)
    with pytest.raises(ValueError, match=r"to_torch: this layer rotates queries and keys .* needs rope=None"):
        mh.MultiHeadAttention(16, 2, rope=PairRotation(8)).to_torch()


# ------------------------------------------------------------------------------ one helper for every caller
def test_layers_and_models_share_one_attention_call(monkeypatch):
    """``MultiHeadAttention``, the ``nn.MultiheadAttention`` drop-in and the decoder's cached path all
    reach :func:`multihead.attention` through ``layers.heads.attend_heads`` (a call with weights
    or hooks through ``hooks.observed_attention``, which it calls)."""
    callers = []
    real = mh.layers.heads.attention

    def spy(q, k, v, **kwargs):
        callers.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(mh.layers.heads, "attention", spy)
    monkeypatch.setattr(mh.hooks, "attention", spy)
    x = torch.randn(2, 3, 16)
    mh.MultiHeadAttention(16, 2)(x)
    MultiheadAttention(16, 2, batch_first=True)(x, x, x)
    model = CausalDecoder(DecoderConfig(vocab_size=11, max_len=8, d_model=16, num_layers=2, num_heads=2)).eval()
    cache = model.new_cache()
    model(torch.randint(11, (1, 4)), cache)
    model(torch.randint(11, (1, 1)), cache)
    assert (
        callers
        == [((2, 2, 3, 8), (2, 2, 3, 8))] * 2 + [((1, 2, 4, 8), (1, 2, 4, 8))] * 2 + [((1, 2, 1, 8), (1, 2, 5, 8))] * 2
    )


def test_capture_records_the_drop_in_per_head_weights():
    torch.manual_seed(2)
    module = MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 3, 16)
    with mh.capture_attention(module) as cap:
        _, weights = module(x, x, x, need_weights=True, average_attn_weights=False)
    assert cap.names == ["MultiheadAttention"]
    torch.testing.assert_close(cap.weights[0], weights)  # (B, H, L, S)


# ------------------------------------------------------------------------------ the attend seam
class HalvedKeys(mh.layers.heads.Attend):
    """Another way of attending: keys halved before the default attention; refuses need_weights and
    rotary layers, and records the mask lengths and positions it was asked for."""

    def __init__(self):
        self.asked = []

    def check_layer(self, layer, options):
        self.asked.append(("layer", sorted(k for k, v in options.items() if v)))

    def check_call(self, layer, *, self_attention, kv_cache, need_weights, score_mod, dropout):
        if need_weights:
            raise ValueError(f"{layer}: HalvedKeys takes no need_weights")

    def positions(self, Lq, device):
        self.asked.append(("positions", Lq))
        return torch.arange(10, 10 + Lq, device=device)

    def attend_heads(self, layer, q, k, v, **options):
        return super().attend_heads(layer, q, k / 2, v, **options)


def test_a_layer_attends_through_its_attend_seam_with_its_refusals():
    torch.manual_seed(0)
    seam = HalvedKeys()
    rope = PairRotation(6)
    layer = mh.MultiHeadAttention(24, 4, causal=True, dropout=0.1, rope=rope, attend=seam, dtype=DT).eval()
    plain = mh.MultiHeadAttention(24, 4, causal=True, rope=PairRotation(6), dtype=DT).eval()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, 24, dtype=DT)
    assert seam.asked == [("layer", ["dropout"])]
    # halving every key halves every score: the plain layer's queries halved instead
    plain.q_proj.weight.data /= 2
    plain.q_proj.bias.data /= 2
    torch.testing.assert_close(layer(x), plain(x, positions=torch.arange(10, 15)))
    assert seam.asked[-1] == ("positions", 5) and rope.calls[-1][1].tolist() == list(range(10, 15))
    assert "attend=HalvedKeys()" in repr(layer) and layer.context_parallel is None
    with pytest.raises(ValueError, match=r"MultiHeadAttention: HalvedKeys takes no need_weights"):
        layer(x, need_weights=True)


def test_the_attend_seam_is_an_attend_and_not_given_with_context_parallel():
    from multihead.distributed import ContextParallel, ContextParallelAttend

    with pytest.raises(TypeError, match=r"attend must be None or a multihead.layers.heads.Attend .*got function"):
        mh.MultiHeadAttention(16, 2, attend=lambda *a, **k: None)
    with pytest.raises(TypeError, match=r"give attend or context_parallel, not both"):
        mh.MultiHeadAttention(16, 2, attend=mh.layers.heads.Attend(), context_parallel=ContextParallel())
    cp = ContextParallel(layout="contiguous")
    layer = mh.MultiHeadAttention(16, 2, context_parallel=cp)
    assert isinstance(layer.attend, ContextParallelAttend) and layer.context_parallel is cp
    assert type(mh.MultiHeadAttention(16, 2).attend) is mh.layers.heads.Attend
