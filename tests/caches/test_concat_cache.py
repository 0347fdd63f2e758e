"""`ConcatKVCache` and the `KVCache` interface: storage, reset, and refused updates that change nothing."""

from __future__ import annotations

import pytest
import torch

from multihead.caches import ConcatKVCache, KVCache


def _kv(B=2, Hkv=3, L=4, D=5, Dv=7, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype).to(device)
    v = torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype).to(device)
    return k, v


def test_updates_return_everything_stored_oldest_first():
    cache = ConcatKVCache()
    assert cache.length == 0 and cache.keys is None and repr(cache) == "ConcatKVCache(length=0)"
    chunks = [_kv(L=L, seed=i) for i, L in enumerate([4, 1, 1, 3])]  # prefill, two steps, a chunk
    for n, (k, v) in enumerate(chunks, start=1):
        k_all, v_all = cache.update(k, v)
        expected_k = torch.cat([c[0] for c in chunks[:n]], dim=2)
        expected_v = torch.cat([c[1] for c in chunks[:n]], dim=2)
        assert torch.equal(k_all, expected_k) and torch.equal(v_all, expected_v)
        assert cache.length == expected_k.shape[2]
    assert (cache.length, tuple(cache.keys.shape), tuple(cache.values.shape)) == (9, (2, 3, 9, 5), (2, 3, 9, 7))
    assert repr(cache) == "ConcatKVCache(length=9)"


def test_reset_forgets_the_sequence_and_its_shapes():
    cache = ConcatKVCache()
    cache.update(*_kv(B=2, Hkv=3, D=5))
    cache.reset()
    assert cache.length == 0 and cache.keys is None and cache.values is None
    k, v = _kv(B=1, Hkv=1, L=2, D=8, Dv=8, dtype=torch.float64)  # a new sequence may differ in every way
    k_all, v_all = cache.update(k, v)
    assert k_all is k and v_all is v and cache.length == 2


def test_kv_cache_is_an_interface():
    assert isinstance(ConcatKVCache(), KVCache)
    with pytest.raises(TypeError, match="abstract"):
        KVCache()

    class Partial(KVCache):  # forgets reset()
        length = 0

        def update(self, k, v):
            return k, v

    with pytest.raises(TypeError, match="reset"):
        Partial()


stored_k, stored_v = _kv(B=2, Hkv=3, L=4, D=5, Dv=7)
k1, v1 = _kv(B=2, Hkv=3, L=1, D=5, Dv=7, seed=1)

BAD = [  # (name, k, v, error, message)
    ("k not a tensor", [[0.0]], v1, TypeError, r"k must be a torch.Tensor \(B, Hkv, Lnew, D\), got list"),
    ("k 3-D", k1[0], v1, ValueError, r"k must have 4 dims \(B, Hkv, Lnew, D\), got shape \(3, 1, 5\); hint: split the heads"),
    ("v 5-D", k1, v1[None], ValueError, r"v must have 4 dims \(B, Hkv, Lnew, Dv\), got shape \(1, 2, 3, 1, 7\)"),
    ("k, v lengths", k1, _kv(L=2, seed=1)[1], ValueError, r"k and v must agree on \(B, Hkv, Lnew\), got k \(2, 3, 1, 5\) and v \(2, 3, 2, 7\)"),
    ("k, v dtypes", k1, v1.double(), TypeError, r"k and v must share a dtype, got torch.float32 and torch.float64"),
    ("k, v devices", k1, v1.to("meta"), ValueError, r"k and v must be on one device, got cpu and meta"),
    ("batch", *_kv(B=1, L=1), ValueError, r"have B=1 but the 4 stored tokens have B=2.*one cache per layer"),
    ("kv heads", *_kv(Hkv=1, L=1), ValueError, r"have Hkv=1 but the 4 stored tokens have Hkv=3 \(stored k \(2, 3, 4, 5\), v \(2, 3, 4, 7\); got k \(2, 1, 1, 5\)"),
    ("head dim", *_kv(D=6, L=1), ValueError, r"have D=6 but the 4 stored tokens have D=5"),
    ("value dim", *_kv(Dv=5, L=1), ValueError, r"have Dv=5 but the 4 stored tokens have Dv=7"),
    ("dtype", k1.double(), v1.double(), TypeError, r"have dtype torch.float64 but the stored ones torch.float32"),
    ("device", k1.to("meta"), v1.to("meta"), ValueError, r"are on meta but the stored ones on cpu"),
]


@pytest.mark.parametrize("k, v, error, pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_refused_update_changes_nothing(k, v, error, pattern):
    cache = ConcatKVCache()
    cache.update(stored_k, stored_v)
    keys, values = cache.keys, cache.values
    with pytest.raises(error, match=r"^ConcatKVCache\.update: (new keys/values )?" + pattern):
        cache.update(k, v)
    assert cache.length == 4 and cache.keys is keys and cache.values is values
    k_all, _ = cache.update(k1, v1)  # and it still takes a good update
    assert cache.length == 5 and torch.equal(k_all[:, :, :4], stored_k)


def test_truncate_keeps_the_first_tokens_and_refuses_bad_lengths():
    cache = ConcatKVCache()
    k, v = _kv(B=1, Hkv=2, L=5, D=4, Dv=3)
    cache.update(k, v)
    cache.truncate(3)
    assert cache.length == 3 and torch.equal(cache.keys, k[:, :, :3]) and torch.equal(cache.values, v[:, :, :3])
    for bad, exc, pattern in ((4, ValueError, r"length must be in \[0, 3\].*got 4"), (-1, ValueError, r"got -1"),
                              (1.0, TypeError, r"length must be an int, got float")):
        with pytest.raises(exc, match=pattern):
            cache.truncate(bad)
        assert cache.length == 3
    cache.truncate(0)
    assert cache.length == 0 and cache.keys is None


def test_a_layer_call_refused_after_the_update_rolls_the_cache_back():
    import multihead as mh

    layer = mh.MultiHeadAttention(16, 4, causal=True, backend="blocksparse").eval()
    cache = ConcatKVCache()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        layer.backend = "reference"
        layer(x, kv_cache=cache)
        layer.backend = "blocksparse"  # refuses a plain bool tensor mask
        with pytest.raises(mh.BackendRefusedError, match="blocksparse"):
            layer(x[:, :1], kv_cache=cache, mask=torch.ones(1, 6, dtype=torch.bool))
    assert cache.length == 5
