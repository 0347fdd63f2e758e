"""Multi-head latent attention (MLA) and its cache.

* the layer equals the published equations, re-implemented plainly below (per-head loops, fp64,
  DeepSeek's complex-number RoPE), in both modes, with and without ``q_lora_rank``;
* ``naive`` == ``absorbed``: outputs, weights and the gradient of every parameter (fp64 tight;
  fp32 by the relative rule of ``shared/TESTING.md`` against the fp64 equations);
* prefill + decode steps (one token, chunks) with a ``LatentKVCache`` == the full forward, both
  modes, a cache filled in one mode and continued in the other, masks at absolute positions;
* the cache stores ``C + R`` features per token once; crop, reorder, rollback, reset; refusals
  that change nothing;
* bad configurations and inputs: one table of (call, exception, message).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from helpers import assert_relative
from multihead.caches import DynamicKVCache, PagedKVCache, StaticKVCache
from multihead.caches.latent import LatentKVCache
from multihead.layers.latent import MODES, MultiHeadLatentAttention
from multihead.positions import RotaryEmbedding

# Small, odd on purpose: E, H, C (kv_lora_rank), Cq (q_lora_rank), N (nope), R (rope), V.
E, H, C, CQ, N, R, V = 40, 4, 20, 14, 6, 8, 10
L = 13


def _layer(q_lora_rank=CQ, mode="naive", dtype=torch.float64, seed=0, bias=True, **kw):
    torch.manual_seed(seed)
    layer = MultiHeadLatentAttention(
        E,
        H,
        kv_lora_rank=C,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=N,
        qk_rope_head_dim=R,
        v_head_dim=V,
        mode=mode,
        bias=bias,
        dtype=dtype,
        **kw,
    )
    with torch.no_grad():  # RMSNorm weights start at 1; make them matter
        for p in layer.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    return layer


def _x(B=2, Lx=L, dtype=torch.float64, seed=1):
    return torch.randn(B, Lx, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------- the published equations
def published_mla(
    params: dict,
    x,
    *,
    heads,
    kv_lora_rank,
    nope,
    rope,
    v_dim,
    positions=None,
    base=10000.0,
    eps=1e-6,
    scale=None,
    causal=True,
):
    """DeepSeek-V2 section 2.1 (decoupled RoPE, low-rank Q and KV) computed plainly, one head at
    a time, from a state dict with Hugging Face's names. Written from the equations, not from the
    layer: its own RMSNorm, its own RoPE (pairs (2i, 2i+1) as complex numbers, as DeepSeek's
    ``apply_rotary_emb``), an explicit per-head loop and an explicit causal rule."""
    B, T, _ = x.shape
    pos = torch.arange(T) if positions is None else positions

    def linear(name, t):
        out = t @ params[f"{name}.weight"].T
        return out + params[f"{name}.bias"] if f"{name}.bias" in params else out

    def rms_norm(name, t):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * params[f"{name}.weight"]

    def rotate(t):  # t (B, T, rope): pair i = features (2i, 2i+1) turned by pos * base^(-2i/rope)
        theta = base ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)  # (rope/2,)
        turn = torch.polar(torch.ones(T, rope // 2, dtype=torch.float64), pos[:, None].double() * theta)  # (T, rope/2)
        z = torch.view_as_complex(t.reshape(B, T, rope // 2, 2).contiguous())
        return torch.view_as_real(z * turn.to(z.dtype)).reshape(B, T, rope)  # angles in fp64, then t's precision

    if "q_proj.weight" in params:
        q = linear("q_proj", x)  # q_t = W^Q h_t
    else:
        q = linear("q_b_proj", rms_norm("q_a_layernorm", linear("q_a_proj", x)))  # c^Q = W^DQ h, q = W^UQ c^Q
    kv_a = linear("kv_a_proj_with_mqa", x)
    c_kv = rms_norm("kv_a_layernorm", kv_a[..., :kv_lora_rank])  # c^KV_t = W^DKV h_t
    k_rope = rotate(kv_a[..., kv_lora_rank:])  # k^R_t = RoPE(W^KR h_t), shared by every head
    kv_b = linear("kv_b_proj", c_kv)  # [k^C_t ; v^C_t] = W^UK c^KV_t, W^UV c^KV_t
    scale = 1 / math.sqrt(nope + rope) if scale is None else scale
    heads_out = []
    for h in range(heads):
        q_h = q[..., h * (nope + rope) : (h + 1) * (nope + rope)]
        q_h = torch.cat([q_h[..., :nope], rotate(q_h[..., nope:])], -1)  # q_{t,i} = [q^C_{t,i} ; q^R_{t,i}]
        block = kv_b[..., h * (nope + v_dim) : (h + 1) * (nope + v_dim)]
        k_h = torch.cat([block[..., :nope], k_rope], -1)  # k_{t,i} = [k^C_{t,i} ; k^R_t]
        v_h = block[..., nope:]
        scores = torch.einsum("btd,bsd->bts", q_h, k_h) * scale
        if causal:
            scores = scores.masked_fill(pos[None, :, None] < pos[None, None, :], float("-inf"))
        heads_out.append(torch.einsum("bts,bsd->btd", scores.softmax(-1), v_h))  # o_{t,i}
    return linear("o_proj", torch.cat(heads_out, -1))  # u_t = W^O [o_{t,1}; ...; o_{t,H}]


def _published(layer, x, **kw):
    params = {name: p for name, p in layer.named_parameters()}
    return published_mla(params, x, heads=H, kv_lora_rank=C, nope=N, rope=R, v_dim=V, **kw)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [CQ, None], ids=["q_lora", "q_full"])
def test_the_layer_computes_the_published_equations(mode, q_lora_rank):
    layer, x = _layer(q_lora_rank, mode), _x()
    torch.testing.assert_close(layer(x), _published(layer, x))


def test_the_parameters_carry_the_published_names_in_both_layouts():
    low = {
        "q_a_proj.weight",
        "q_a_proj.bias",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_proj_with_mqa.bias",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
        "o_proj.bias",
    }
    assert set(_layer().state_dict()) == low
    full = low - {"q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight"} | {
        "q_proj.weight",
        "q_proj.bias",
    }
    assert set(_layer(None).state_dict()) == full
    assert set(_layer(bias=False).state_dict()) == {k for k in low if not k.endswith(".bias")}
    shapes = {k: tuple(v.shape) for k, v in _layer().state_dict().items()}
    assert shapes["kv_a_proj_with_mqa.weight"] == (C + R, E) and shapes["kv_b_proj.weight"] == (H * (N + V), C)
    assert shapes["q_b_proj.weight"] == (H * (N + R), CQ) and shapes["o_proj.weight"] == (E, H * V)


def test_explicit_positions_and_the_scale_follow_the_equations():
    layer, x = _layer(scale=0.21), _x()
    positions = torch.arange(L) * 3 + 5  # any increasing positions: rotation and causality follow them
    torch.testing.assert_close(layer(x, positions=positions), _published(layer, x, positions=positions, scale=0.21))
    layer.mode = "absorbed"
    torch.testing.assert_close(layer(x, positions=positions), _published(layer, x, positions=positions, scale=0.21))
    # A shift of every position changes no score (RoPE is relative).
    torch.testing.assert_close(layer(x, positions=torch.arange(L) + 100), layer(x))


def test_softmax_scale_is_the_old_spelling_of_scale_and_warns():
    with pytest.warns(
        DeprecationWarning, match=r"MultiHeadLatentAttention\(softmax_scale=...\) is now .*\(scale=...\)"
    ):
        old = _layer(softmax_scale=0.21)
    assert old.scale == 0.21 and "scale=0.21" in repr(old)
    with pytest.warns(DeprecationWarning, match=r"MultiHeadLatentAttention.softmax_scale is now .*\.scale"):
        assert old.softmax_scale == 0.21
    new, x = _layer(scale=0.21), _x()
    new.load_state_dict(old.state_dict())
    torch.testing.assert_close(old(x), new(x))
    with pytest.raises(TypeError, match=r"give scale, not softmax_scale \(its old spelling\) as well"):
        _layer(scale=0.2, softmax_scale=0.2)


def test_a_rotary_embedding_with_another_base_is_passed_in_or_built_from_rope_base():
    x = _x()
    built = _layer(rope_base=500.0)
    injected = _layer(rope=RotaryEmbedding(R, base=500.0, interleaved=True))
    torch.testing.assert_close(built(x), injected(x))
    torch.testing.assert_close(built(x), _published(built, x, base=500.0))


# ---------------------------------------------------------------------------- naive == absorbed
def _grads(layer, x, out_grad):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    (layer(x) * out_grad).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    assert len(grads) == len(list(layer.parameters())) and all(g is not None for g in grads.values())
    return grads, x.grad


@pytest.mark.parametrize("q_lora_rank", [CQ, None], ids=["q_lora", "q_full"])
def test_naive_and_absorbed_agree_in_fp64_on_outputs_weights_and_every_gradient(q_lora_rank):
    layer, x = _layer(q_lora_rank), _x()
    g = torch.randn(2, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out_n, weights_n = layer(x, need_weights=True)
    grads_n, dx_n = _grads(layer, x, g)
    layer.mode = "absorbed"
    out_a, weights_a = layer(x, need_weights=True)
    grads_a, dx_a = _grads(layer, x, g)
    torch.testing.assert_close(out_a, out_n)
    torch.testing.assert_close(weights_a, weights_n)
    torch.testing.assert_close(dx_a, dx_n)
    for name in grads_n:
        torch.testing.assert_close(grads_a[name], grads_n[name], msg=lambda m, name=name: f"{name}: {m}")


def _published_grads(layer, x, out_grad):
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    x = x.clone().requires_grad_(True)
    out = published_mla(params, x, heads=H, kv_lora_rank=C, nope=N, rope=R, v_dim=V)
    (out * out_grad).sum().backward()
    return out.detach(), {n: p.grad for n, p in params.items()}, x.grad


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_fp32_by_the_relative_rule_against_the_fp64_equations(mode):
    """err(layer fp32) <= F · err(the equations computed plainly in fp32) + floor, for the output and
    every parameter's gradient; F = 10 as for fp32 backends (an online softmax and the absorbed
    mode's reassociated matmuls round differently from the plain loop)."""
    layer32, x32 = _layer(mode=mode, dtype=torch.float32), _x(dtype=torch.float32)
    layer64 = _layer(mode=mode, dtype=torch.float64)
    layer64.load_state_dict({k: v.double() for k, v in layer32.state_dict().items()})  # the same rounded weights
    g32 = torch.randn(2, L, E, generator=torch.Generator().manual_seed(5))
    ref_out, ref_grads, ref_dx = _published_grads(layer64, x32.double(), g32.double())
    base_out, base_grads, base_dx = _published_grads(layer32, x32, g32)
    out = layer32(x32)
    grads, dx = _grads(layer32, x32, g32)
    assert_relative(out, ref_out, base_out, 10, "output")
    assert_relative(dx, ref_dx, base_dx, 10, "grad x")
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name in grads:
        assert_relative(grads[name], ref_grads[name], base_grads[name], 10, f"grad {name}", magnitude=scale)


# ---------------------------------------------------------------------------- the latent cache
def _decode(layer, x, cache, chunks, **kw):
    """Prefill ``chunks[0]`` tokens, then the rest in chunks of the given sizes."""
    outs, t = [], 0
    for n in chunks:
        outs.append(layer(x[:, t : t + n], kv_cache=cache, **kw))
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, 1)


STEPS = {"one token": [5] + [1] * (L - 5), "chunks": [4, 3, 1, 5], "one token from empty": [1] * L}


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("mode", ["naive", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [CQ, None], ids=["q_lora", "q_full"])
def test_prefill_and_decode_with_the_latent_cache_equal_the_full_forward(mode, q_lora_rank, steps):
    layer, x = _layer(q_lora_rank, mode), _x()
    with torch.no_grad():
        full = layer(x)
        cache = LatentKVCache(capacity=2)  # grows several times
        out = _decode(layer, x, cache, STEPS[steps])
    torch.testing.assert_close(out, full)
    assert cache.length == L and cache.keys.shape == (2, 1, L, C + R)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_gradients_through_cached_steps_equal_the_full_forward(mode):
    """Backpropagating through prefill and steps of a LatentKVCache (under autograd it concatenates,
    like DynamicKVCache, instead of writing into rows an earlier step saved) gives the full forward's
    gradients."""
    layer, x = _layer(mode=mode), _x().requires_grad_()
    out = _decode(layer, x, LatentKVCache(capacity=2), [4, 1, 3, 1, 4])
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    want = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_cache_filled_in_one_mode_serves_the_other():
    layer, x = _layer(), _x()
    with torch.no_grad():
        full = layer(x)
        cache = LatentKVCache()
        head = layer(x[:, :7], kv_cache=cache)  # naive prefill (cheaper for long prompts)
        layer.mode = "absorbed"
        tail = [layer(x[:, t : t + 1], kv_cache=cache) for t in range(7, L)]  # absorbed decoding
    torch.testing.assert_close(torch.cat([head, *tail], 1), full)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_mask_objects_with_a_cache_mean_what_they_mean_without(mode):
    layer, x = _layer(mode=mode), _x()
    lengths = torch.tensor([L, 9])
    for mask in (mh.sliding_window(3), mh.key_padding(lengths), mh.sliding_window(4) & mh.key_padding(lengths)):
        with torch.no_grad():
            full = layer(x, mask=mask)
            out = _decode(layer, x, LatentKVCache(), [6, 1, 2, 1, 3], mask=mask)
        torch.testing.assert_close(out, full, msg=lambda m, mask=mask: f"{mask}: {m}")


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_other_caches_work_through_the_interface(mode):
    """Any KVCache stores the rows (a DynamicKVCache, StaticKVCache or PagedKVCache keeps the latent
    twice); the static cache's rows of different lengths continue at their own positions."""
    layer, x = _layer(mode=mode), _x()
    with torch.no_grad():
        full = layer(x)
        torch.testing.assert_close(_decode(layer, x, DynamicKVCache(), [5, 1, 7]), full)
        static = StaticKVCache(2, 16, 1, C + R, value_dim=C, dtype=torch.float64)
        torch.testing.assert_close(_decode(layer, x, static, [5, 1, 7]), full)
        paged = PagedKVCache(8, 4, 1, C + R, value_dim=C, batch_size=2, dtype=torch.float64)
        torch.testing.assert_close(_decode(layer, x, paged, [5, 1, 7]), full)
        # Rows of different prompt lengths: row 1 holds only 4 tokens and continues at position 4.
        static = StaticKVCache(2, 16, 1, C + R, value_dim=C, dtype=torch.float64)
        layer(x[:, :6], kv_cache=static)
        static.crop(torch.tensor([6, 4]))
        step = torch.stack([x[0, 6], x[1, 4]])[:, None]  # (2, 1, E)
        out = layer(step, kv_cache=static)
    torch.testing.assert_close(out[0], full[0, 6:7])
    torch.testing.assert_close(out[1], layer(x[1:, :5])[0, 4:5])


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_a_paged_cache_with_values_in_keys_stores_the_latent_once(mode):
    """PagedKVCache(values_in_keys=True) keeps the rows [c_kv | k_rope] once in its pages and reads the
    latent back as a view: the same outputs as the full forward, half-full pages, crop and reorder,
    with the pool's bytes those of the keys alone."""
    layer, x = _layer(mode=mode), _x()
    shared = PagedKVCache(8, 4, 1, C + R, value_dim=C, values_in_keys=True, batch_size=2, dtype=torch.float64)
    twice = PagedKVCache(8, 4, 1, C + R, value_dim=C, batch_size=2, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        torch.testing.assert_close(_decode(layer, x, shared, [5, 1, 7]), full)
        assert shared.value_pages.data_ptr() == shared.key_pages.data_ptr()
        assert shared.nbytes == shared.key_pages.nbytes == twice.nbytes * (C + R) // (2 * C + R)
        shared.crop(9)
        shared.reorder(torch.tensor([1, 1]))  # row 1 twice: its pages are copied, latent included
        out = layer(x[1:, 9:10].expand(2, 1, E), kv_cache=shared)
    torch.testing.assert_close(out, full[1:, 9:10].expand(2, 1, E))


def test_a_paged_cache_with_values_in_keys_refuses_values_that_are_not_the_key_prefix():
    cache = PagedKVCache(4, 4, 1, C + R, value_dim=C, values_in_keys=True, dtype=torch.float64)
    k = torch.randn(1, 1, 3, C + R, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"v must equal k\[\.\.\., :{C}\]"):
        cache.update(k, torch.zeros(1, 1, 3, C, dtype=torch.float64))
    assert cache.lengths.tolist() == [0] and len(cache.free) == 4
    with pytest.raises(ValueError, match=r"value_dim <= head_dim; got value_dim=9, head_dim=8"):
        PagedKVCache(4, 4, 1, 8, value_dim=9, values_in_keys=True)
    with pytest.raises(TypeError, match=r"values_in_keys must be a bool, got 1"):
        PagedKVCache(4, 4, 1, 8, values_in_keys=1)


def test_the_cache_stores_each_token_once_as_latent_and_rotary_key():
    layer, x = _layer(), _x()
    cache = LatentKVCache(capacity=16)
    with torch.no_grad():
        layer(x, kv_cache=cache)
    assert cache.nbytes == 2 * 16 * (C + R) * 8  # B · capacity · (C + R) · fp64: nothing else
    assert cache.bytes_per_token() == 2 * (C + R) * 8 == 2 * layer.cache_bytes_per_token()
    assert cache.values.data_ptr() == cache.keys.data_ptr()  # the latent is a view of the rows
    assert cache.rope_keys.shape == (2, 1, L, R) and cache.latent.shape == (2, 1, L, C)
    with torch.no_grad():  # what is stored: RMSNorm(c_kv) and the rotated k_rope
        kv_a = layer.kv_a_proj_with_mqa(x)
        torch.testing.assert_close(cache.latent[:, 0], layer.kv_a_layernorm(kv_a[..., :C]))
        torch.testing.assert_close(cache.rope_keys, layer.rope(kv_a[..., C:].unsqueeze(1), torch.arange(L)))
    gqa = mh.DynamicKVCache()
    with torch.no_grad():
        mh.MultiHeadAttention(E, H, num_kv_heads=2, head_dim=N + R, causal=True, dtype=torch.float64)(x, kv_cache=gqa)
    assert gqa.keys.shape[2] == L and gqa.nbytes > 0


def test_cache_growth_crop_reorder_rollback_and_reset():
    cache = LatentKVCache(capacity=3)
    rows = torch.randn(2, 1, 5, C + R, dtype=torch.float64)
    read = cache.update(rows, rows[..., :C])
    assert cache.capacity == 5 and torch.equal(read.keys, rows) and torch.equal(read.values, rows[..., :C])
    step = torch.randn(2, 1, 1, C + R, dtype=torch.float64)
    read = cache.update(step, step[..., :C].clone())  # an equal copy is accepted too
    assert cache.capacity == 10 and cache.length == 6 and read.query_positions.tolist() == [5]
    cache.rollback()
    assert cache.length == 5 and torch.equal(cache.keys, rows)
    with pytest.raises(RuntimeError, match=r"no update to undo"):
        cache.rollback()
    cache.crop(3)
    assert torch.equal(cache.keys, rows[:, :, :3]) and cache.next_positions(2).tolist() == [3, 4]
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.keys.shape[0] == 3 and torch.equal(cache.keys[2], rows[0, :, :3])
    cache.reset()
    assert cache.length == 0 and cache.keys is None and cache.nbytes == 0


REFUSED = [
    ("v not the prefix of k", lambda r: (r, r[..., :C] + 1), ValueError, r"v must equal k\[\.\.\., :20\]"),
    (
        "other heads",
        lambda r: (r.expand(2, 2, 1, C + R), r.expand(2, 2, 1, C + R)[..., :C]),
        ValueError,
        r"Hkv=2 but the cache holds Hkv=1",
    ),
    ("other latent size", lambda r: (r, r[..., : C - 2]), ValueError, r"Dv=18 but the cache holds Dv=20"),
    ("other rows size", lambda r: (r[..., :-2], r[..., :C]), ValueError, r"D=26 but the cache holds D=28"),
    ("other batch", lambda r: (r[:1], r[:1, ..., :C]), ValueError, r"B=1 but the cache holds B=2"),
    (
        "other dtype",
        lambda r: (r.float(), r.float()[..., :C]),
        TypeError,
        r"dtype torch.float32 but the cache holds torch.float64",
    ),
]


@pytest.mark.parametrize("name, make, error, pattern", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_update_changes_nothing(name, make, error, pattern):
    cache = LatentKVCache()
    rows = torch.randn(2, 1, 4, C + R, dtype=torch.float64)
    cache.update(rows, rows[..., :C])
    before = cache.keys.clone()
    with pytest.raises(error, match=pattern):
        cache.update(*make(torch.randn(2, 1, 1, C + R, dtype=torch.float64)))
    assert cache.length == 4 and torch.equal(cache.keys, before)


def test_a_call_that_fails_after_the_update_rolls_the_cache_back():
    layer, x = _layer(), _x()
    cache = LatentKVCache()
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache)
        with pytest.raises(ValueError, match="not broadcastable"):
            layer(x[:, 5:6], kv_cache=cache, mask=torch.ones(1, 3, dtype=torch.bool))  # (Lq, S) is (1, 6)
    assert cache.length == 5


# ---------------------------------------------------------------------------- weights changed in place
def _copy_data(p, new):
    p.data.copy_(new)  # an EMA update: through .data, no version counter moves


def _assign_data(p, new):
    p.data = new  # another storage


def _copy_no_grad(p, new):
    with torch.no_grad():
        p.copy_(new)


IN_PLACE_UPDATES = {"data.copy_": _copy_data, "data=": _assign_data, "no_grad copy_": _copy_no_grad}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("param", ["q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"])
@pytest.mark.parametrize("update", list(IN_PLACE_UPDATES))
def test_a_weight_changed_in_place_is_seen_by_the_next_no_grad_call_and_decode_step(update, param, mode):
    """However a weight is changed in place (through ``.data`` or under ``no_grad``), the next
    no-grad call and cached decode step (a DynamicKVCache and a LatentKVCache) compute what a layer
    built with the new weights computes (absorbed mode reads ``kv_b_proj.weight`` through views:
    nothing derived from it may be kept)."""
    layer, x = _layer(mode=mode), _x()

    def run(m):
        out = [m(x)]
        for cache in (DynamicKVCache(), LatentKVCache()):
            m(x[:, :-1], kv_cache=cache)
            out.append(m(x[:, -1:], kv_cache=cache))  # one decode step
        return out

    with torch.no_grad():
        before = run(layer)
        p = layer.get_parameter(param)
        IN_PLACE_UPDATES[update](p, torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(5)))
        after = run(layer)
        fresh = _layer(mode=mode, seed=7)
        fresh.load_state_dict(layer.state_dict())  # the new weights, in a layer that never saw the old
        want = run(fresh)
    for name, got, expected in zip(["call", "DynamicKVCache step", "LatentKVCache step"], after, want):
        torch.testing.assert_close(got, expected, msg=lambda m: f"{update} on {param} ({mode}), {name}: {m}")
    assert not torch.allclose(after[0], before[0]) and not torch.allclose(after[1], before[1])


# ---------------------------------------------------------------------------- explain, capture
def test_explain_names_the_shapes_of_each_mode_and_leaves_the_cache_as_it_was():
    layer, x = _layer(), _x()
    cache = LatentKVCache()
    with torch.no_grad():
        layer(x[:, :8], kv_cache=cache)
    before = cache.keys.clone()
    naive = layer.explain(x[:, 8:9], kv_cache=cache)
    assert naive.shape == (2, H, H, 1, 9, N + R, V)  # (B, Hq, Hkv, Lq, Lk, D, Dv): MHA over up-projected K/V
    layer.mode = "absorbed"
    absorbed = layer.explain(x[:, 8:9], kv_cache=cache)
    assert absorbed.shape == (2, H, 1, 1, 9, C + R, C)  # MQA over the latent rows
    assert "Dv=20" in str(absorbed) and absorbed.backend in mh.available_backends()
    assert cache.length == 8 and torch.equal(cache.keys, before)
    assert layer.explain(x).shape == (2, H, 1, L, L, C + R, C)


def test_capture_records_the_same_weights_in_both_modes():
    layer, x = _layer(), _x()
    with torch.no_grad(), mh.capture_attention(layer) as naive:
        layer(x)
    layer.mode = "absorbed"
    with torch.no_grad(), mh.capture_attention(layer) as absorbed:
        layer(x)
    torch.testing.assert_close(absorbed.weights[0], naive.weights[0])
    assert naive.weights[0].shape == (2, H, L, L)


# ---------------------------------------------------------------------------- bad input
def _mla(**kw):
    args = dict(kv_lora_rank=C, qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=V)
    args.update(kw)
    return MultiHeadLatentAttention(E, H, **args)


def _set_mode():
    _mla().mode = "flash"


xf = torch.randn(2, 5, E)
CASES = [
    ("odd rope dim", lambda: _mla(qk_rope_head_dim=7), ValueError, r"qk_rope_head_dim must be even .*got 7"),
    ("zero latent", lambda: _mla(kv_lora_rank=0), ValueError, r"kv_lora_rank must be a positive int, got 0"),
    ("float q rank", lambda: _mla(q_lora_rank=1.5), TypeError, r"q_lora_rank must be a positive int, got float 1.5"),
    ("negative v dim", lambda: _mla(v_head_dim=-1), ValueError, r"v_head_dim must be a positive int, got -1"),
    ("zero nope dim", lambda: _mla(qk_nope_head_dim=0), ValueError, r"qk_nope_head_dim must be a positive int, got 0"),
    ("missing dims", lambda: MultiHeadLatentAttention(E, H, kv_lora_rank=C), TypeError, r"qk_nope_head_dim"),
    ("unknown mode", lambda: _mla(mode="fast"), ValueError, r"mode must be one of \('naive', 'absorbed'\).*got 'fast'"),
    ("mode set later", _set_mode, ValueError, r"mode must be one of \('naive', 'absorbed'\).*got 'flash'"),
    (
        "rope of other dim",
        lambda: _mla(rope=RotaryEmbedding(2 * R)),
        ValueError,
        rf"rope rotates heads of dim={2 * R} but qk_rope_head_dim={R}; expected RotaryEmbedding\({R}",
    ),
    (
        "rope and rope_base",
        lambda: _mla(rope=RotaryEmbedding(R), rope_base=1e4),
        ValueError,
        r"give rope or rope_base, not both",
    ),
    ("rope not callable", lambda: _mla(rope=3), TypeError, r"rope must be None or a callable"),
    ("bad rope base", lambda: _mla(rope_base=0), ValueError, r"rope_base must be a positive finite number, got 0"),
    (
        "bad scale",
        lambda: _mla(softmax_scale=-0.1),
        ValueError,
        r"softmax_scale must be a positive finite number, got -0.1",
    ),
    ("bad eps", lambda: _mla(norm_eps=0.0), ValueError, r"norm_eps must be a positive finite number, got 0.0"),
    ("causal not bool", lambda: _mla(causal=1), TypeError, r"causal must be a bool, got int"),
    ("unknown backend", lambda: _mla(backend="flash9"), ValueError, r"unknown backend 'flash9'"),
    # forward
    (
        "x features",
        lambda: _mla()(torch.randn(2, 5, E + 1)),
        ValueError,
        rf"x has {E + 1} features .* expects d_model={E}",
    ),
    (
        "x rank",
        lambda: _mla()(torch.randn(5, E)),
        ValueError,
        r"x must have 3 dims \(B, L, E\), got shape \(5, 40\).*unsqueeze",
    ),
    (
        "x dtype",
        lambda: _mla()(xf.double()),
        TypeError,
        r"x has dtype torch.float64 but the layer's weights are torch.float32",
    ),
    (
        "x integer",
        lambda: _mla()(torch.ones(2, 5, E, dtype=torch.long)),
        TypeError,
        r"x must be a floating-point tensor",
    ),
    (
        "positions shape",
        lambda: _mla()(xf, positions=torch.arange(4)),
        ValueError,
        r"positions must have shape \(Lq,\) = \(5,\)",
    ),
    (
        "positions float",
        lambda: _mla()(xf, positions=torch.arange(5.0)),
        TypeError,
        r"positions must be None or an integer tensor .*got dtype torch.float32",
    ),
    (
        "cache type",
        lambda: _mla()(xf, kv_cache={}),
        TypeError,
        r"kv_cache must be None or a multihead.caches.KVCache.*got dict",
    ),
    ("need_weights type", lambda: _mla()(xf, need_weights=1), TypeError, r"need_weights must be a bool"),
    ("mask shape", lambda: _mla()(xf, mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, r"not broadcastable"),
    (
        "cache v wider than k",
        lambda: LatentKVCache().update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 5)),
        ValueError,
        r"v must be the first Dv features of k .*so Dv <= D",
    ),
    ("cache capacity", lambda: LatentKVCache(0), ValueError, r"capacity must be a positive int, got 0"),
    ("cache crop", lambda: LatentKVCache().crop(-1), ValueError, r"LatentKVCache.crop: length must be >= 0, got -1"),
    ("cache reorder empty", lambda: LatentKVCache().reorder(torch.tensor([0])), ValueError, r"the cache is empty"),
]


@pytest.mark.parametrize("name, call, error, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_message(name, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_a_cache_of_another_layer_shape_is_refused_and_unchanged():
    cache = LatentKVCache()
    with torch.no_grad():
        _mla()(xf, kv_cache=cache)
        with pytest.raises(ValueError, match=r"D=34 but the cache holds D=28"):
            MultiHeadLatentAttention(E, H, kv_lora_rank=C + 6, qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=V)(
                xf, kv_cache=cache
            )
    assert cache.length == 5


# DeepSeek-like head counts, small: 16 heads over one latent head of C + R = 96 features, Dv = C = 64
BIG = dict(heads=16, kv_lora_rank=64, q_lora_rank=48, nope=16, rope=32, v_dim=32, E=128)


def _deepseek_like_bf16(**options):
    torch.manual_seed(3)
    return MultiHeadLatentAttention(
        BIG["E"],
        BIG["heads"],
        kv_lora_rank=BIG["kv_lora_rank"],
        q_lora_rank=BIG["q_lora_rank"],
        qk_nope_head_dim=BIG["nope"],
        qk_rope_head_dim=BIG["rope"],
        v_head_dim=BIG["v_dim"],
        mode="absorbed",
        dtype=torch.bfloat16,
        **options,
    )


def test_a_bf16_latent_cache_decodes_on_the_kernel_as_exact_as_the_full_forward():
    """DeepSeek-like head counts in bf16 (16 heads over one latent head of ``C + R = 96`` features,
    ``Dv = C = 64``): the absorbed steps read the latent cache through the CPU decode kernel, on its
    AMX tiles where the CPU has them (``explain()`` says which). Prefill + one-token steps against
    the fp64 equations of the same rounded weights, no further than the bf16 full forward, times 2."""
    from multihead.backends import cpu_kernels

    heads, rank, nope, rope, v_dim, T = BIG["heads"], BIG["kv_lora_rank"], BIG["nope"], BIG["rope"], BIG["v_dim"], 40
    layer = _deepseek_like_bf16(backend="decode")  # auto leaves calls this small to sdpa
    x = torch.randn(2, T, BIG["E"], generator=torch.Generator().manual_seed(4)).bfloat16()
    params = {name: p.double() for name, p in layer.named_parameters()}
    want = published_mla(params, x.double(), heads=heads, kv_lora_rank=rank, nope=nope, rope=rope, v_dim=v_dim)
    with torch.no_grad():
        full = layer(x)
        cache = LatentKVCache()
        layer(x[:, :31], kv_cache=cache)
        report = str(layer.explain(x[:, 31:32], kv_cache=cache))
        out = _decode(layer, x, LatentKVCache(), [31] + [1] * (T - 31))
    if cpu_kernels.kernel() is not None:
        assert "cpu_decode.c" in report, report
        assert ("AMX tiles" in report) == cpu_kernels.tiles(torch.bfloat16, heads, rank + rope, rank, False), report
    assert_relative(out[:, 31:], want[:, 31:], full[:, 31:], 2, "bf16 decode steps")


def test_an_int8_latent_cache_under_sixteen_heads_stays_within_its_rounding():
    """MLA's latent rows in a ``QuantizedKVCache`` (int8, ``value_dim`` the latent width, bf16 compute,
    16 query heads per latent head). Prefill + 100 one-token steps against the same steps through a
    ``LatentKVCache``: within the int8 cache's rounding (docs/inference.md: about 1e-3 of the output's
    scale). (Each step reads the 8-bit slots in place: the next test.)"""
    from multihead.caches import QuantizedKVCache

    rank, rope, T = BIG["kv_lora_rank"], BIG["rope"], 300
    layer = _deepseek_like_bf16()
    x = torch.randn(1, T, BIG["E"], generator=torch.Generator().manual_seed(4)).bfloat16()
    int8 = QuantizedKVCache(1, T, 1, rank + rope, value_dim=rank, residual=16, sinks=4, span=64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = _decode(layer, x, LatentKVCache(), [200] + [1] * (T - 200))
        got = _decode(layer, x, int8, [200] + [1] * (T - 200))
    scale = float(want.abs().max())
    assert float((got.float() - want.float()).abs().max()) <= 1e-2 * scale
    assert float((got.float() - want.float()).abs().mean()) <= 1e-3 * scale


def _quantized(*args, **kw):
    from multihead.caches import QuantizedKVCache

    return QuantizedKVCache(*args, **kw)


LATENT_BLOCK_CACHES = {
    "paged": lambda B, T, rank, rope: PagedKVCache(2 * T // 8 + 2, 8, 1, rank + rope, value_dim=rank, batch_size=B),
    "paged, rows once": lambda B, T, rank, rope: PagedKVCache(
        2 * T // 8 + 2, 8, 1, rank + rope, value_dim=rank, values_in_keys=True, batch_size=B
    ),
    "int8": lambda B, T, rank, rope: _quantized(B, T, 1, rank + rope, value_dim=rank, residual=16, sinks=4, span=32),
    "int8, rows once": lambda B, T, rank, rope: _quantized(
        B, T, 1, rank + rope, value_dim=rank, values_in_keys=True, residual=16, sinks=4, span=32
    ),
}


@pytest.mark.parametrize("kind", sorted(LATENT_BLOCK_CACHES))
def test_an_absorbed_step_reads_a_paged_or_quantized_cache_in_place(kind, monkeypatch):
    """An absorbed MLA step over a paged cache (two rows growing together: their pages interleave in
    the pool) or an int8 ``QuantizedKVCache`` reads the cache's blocks in place, as
    ``MultiHeadAttention`` does: no gathered or dequantized copy of the cache is made during the
    steps (``dense`` refuses), ``explain()`` says so (and says the dense call when weights are asked
    for), the steps equal a ``LatentKVCache``'s (int8: within its rounding), and a step that asks for
    the weights (the dense read, its values as the cache stores them) gives the same output."""
    from multihead.caches.paged_blocks import PageBlocks
    from multihead.caches.quantized import _QuantizedBlocks

    rank, rope, T, P = BIG["kv_lora_rank"], BIG["rope"], 90, 40
    layer = _deepseek_like_bf16().float()
    x = torch.randn(2, T, BIG["E"], generator=torch.Generator().manual_seed(5))
    cache = LATENT_BLOCK_CACHES[kind](2, T, rank, rope)
    with torch.no_grad():
        want = _decode(layer, x, LatentKVCache(), [P] + [1] * (T - P))[:, P:]
        layer(x[:, :P], kv_cache=cache)
        assert "read as blocks" in str(layer.explain(x[:, P : P + 1], kv_cache=cache))
        assert "read as blocks" not in str(layer.explain(x[:, P : P + 1], kv_cache=cache, need_weights=True))

        def no_dense(self):
            raise AssertionError("a dense copy of the cache during a step")

        with monkeypatch.context() as patch:
            patch.setattr(PageBlocks, "dense", no_dense)
            patch.setattr(_QuantizedBlocks, "dense", no_dense)
            got = torch.cat([layer(x[:, t : t + 1], kv_cache=cache) for t in range(P, T)], 1)
        cache.rollback()  # the last step again, through the dense read
        last, weights = layer(x[:, T - 1 :], kv_cache=cache, need_weights=True)
    assert weights.shape == (2, BIG["heads"], 1, T)
    torch.testing.assert_close(last, got[:, -1:], rtol=1e-4, atol=1e-5)
    if kind.startswith("int8"):
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-2 * scale
        assert float((got - want).abs().mean()) <= 1e-3 * scale
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_an_int8_cache_of_latent_rows_stored_once_holds_about_half_the_bytes_within_its_rounding():
    """``QuantizedKVCache(values_in_keys=True)`` keeps MLA's rows once (the values are the keys'
    first ``C`` codes, with the keys' per-token scale): no buffer for the values (DeepSeek's
    ``C = 512, R = 64``: 578 bytes a token against 1092 stored twice and 1152 in a bf16
    ``LatentKVCache``), and a bf16 MLA layer's prefill + 100 steps within the int8 rounding of the
    latent cache's (as the cache that stores them twice)."""
    rank, rope, T = BIG["kv_lora_rank"], BIG["rope"], 300
    layer = _deepseek_like_bf16()
    x = torch.randn(1, T, BIG["E"], generator=torch.Generator().manual_seed(4)).bfloat16()
    kw = dict(value_dim=rank, residual=16, sinks=4, span=64, dtype=torch.bfloat16)
    once, twice = _quantized(1, T, 1, rank + rope, values_in_keys=True, **kw), _quantized(1, T, 1, rank + rope, **kw)
    with torch.no_grad():
        want = _decode(layer, x, LatentKVCache(), [200] + [1] * (T - 200)).float()
        got = {
            name: _decode(layer, x, c, [200] + [1] * (T - 200)).float()
            for name, c in (("once", once), ("twice", twice))
        }
    apart = sum(t.numel() * t.element_size() for t in (twice.q_v, twice.v_scale, twice.sink_v, twice.tail_v))
    assert once.nbytes == twice.nbytes - apart  # nothing held for the values
    codes = once.q_k.numel()  # the 8-bit region, one byte per feature: (rank + rope) per token, not 2·rank + rope
    assert codes == twice.q_k.numel() and twice.q_v.numel() == codes * rank // (rank + rope)
    scale = float(want.abs().max())
    for name, out in got.items():
        assert float((out - want).abs().max()) <= 1e-2 * scale, name
        assert float((out - want).abs().mean()) <= 1e-3 * scale, name
