"""Speculative decoding on a cache: verify a draft tree in one call, then ``commit_path``.

* a tree of drafts appended to a cache holding the prefix (dynamic, static with one length or
  one per row, paged) and attended with ``tree(parents)`` equals, node by node, the fp64 softmax
  over the prefix and that node's root-to-node path computed here, alone (every backend on CPU
  that serves the call, the decode path included);
* ``commit_path`` leaves the cache equal to one that decoded the accepted tokens one by one:
  lengths, every stored key and value, and the next step's output;
* a refused commit (not a chain, nodes out of range, rows that disagree, caches it cannot
  commit on) raises a clear error and leaves the cache as it was.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import refuses
from multihead.caches import DynamicKVCache, PagedKVCache, StaticKVCache, commit_path
from multihead.masks import tree

B, HQ, HKV, D, T = 2, 4, 2, 8, 7
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, -1, 3, 2, 4]])  # per row; row 1 has two roots
CHAINS = {  # accepted root-to-node paths of PARENTS, per row
    "same-length": [[0, 2, 5], [0, 1, 2]],
    "per-row": [[0, 1, 4], [3]],
    "none": [[], []],
    "all-depth": [[0, 2, 5, 6], [0, 1, 2, 5]],
}


def _cache(kind: str, prefix: list[int]):
    if kind == "dynamic":
        return DynamicKVCache()
    if kind.startswith("static"):
        return StaticKVCache(B, 40, HKV, D, dtype=torch.float64)
    return PagedKVCache(num_pages=24, page_size=4, num_kv_heads=HKV, head_dim=D, batch_size=B, dtype=torch.float64)


def _prefill(cache, kind, k, v, prefix):
    """Each row's first ``prefix[b]`` tokens (a padded prefill cropped per row where rows differ)."""
    top = max(prefix)
    cache.update(k[:, :, :top], v[:, :, :top])
    if len(set(prefix)) > 1:
        cache.crop(torch.tensor(prefix))


KINDS = {"dynamic": [6, 6], "static-uniform": [6, 6], "static-per-row": [5, 9], "paged-per-row": [3, 9]}


def _path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _alone(q, k_prefix, v_prefix, k_tree, v_tree, path):
    """fp64 attention of one query (Hq, D) over the prefix and the path's drafts, written plainly."""
    k = torch.cat([k_prefix, k_tree[:, path]], dim=1).repeat_interleave(HQ // HKV, 0)  # (Hq, n, D)
    v = torch.cat([v_prefix, v_tree[:, path]], dim=1).repeat_interleave(HQ // HKV, 0)
    scores = torch.einsum("hd,hnd->hn", q, k) / D**0.5
    return torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v)


def _data(seed=0, n=12):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, HKV, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    kt, vt = (torch.randn(B, HKV, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    qt = torch.randn(B, HQ, T, D, generator=gen, dtype=torch.float64)
    return k, v, kt, vt, qt


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "blocksparse", "decode"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_verification_equals_each_path_alone(kind, backend):
    prefix = KINDS[kind]
    k, v, kt, vt, qt = _data()
    cache = _cache(kind, prefix)
    _prefill(cache, kind, k, v, prefix)
    read = cache.update(kt, vt)
    mask = read.mask(tree(PARENTS), causal=True, heads=HQ)
    if backend != "auto" and refuses(backend, qt, read.keys, read.values, mask=mask):
        pytest.skip(f"{backend} refuses this read's mask (checked: forcing it raises)")  # a per-row read's bool tensor
    out = mh.attention(qt, read.keys, read.values, mask=mask, backend=backend)
    for b in range(B):
        P = prefix[b]
        for node in range(T):
            path = _path_to(PARENTS[b].tolist(), node)
            want = _alone(qt[b, :, node], k[b, :, :P], v[b, :, :P], kt[b], vt[b], path)
            torch.testing.assert_close(out[b, :, node], want)


def _stored(cache):
    """Every row's keys and values in position order, as lists (empty read: every slot)."""
    if isinstance(cache, PagedKVCache):
        k0 = cache.key_pages.new_empty(B, HKV, 0, D)
        v0 = k0
    else:
        k0, v0 = cache.keys[:, :, :0], cache.values[:, :, :0]
    read = cache.update(k0, v0)
    cache.rollback()
    lengths = cache.lengths.tolist()
    return [(read.keys[b, :, : lengths[b]].clone(), read.values[b, :, : lengths[b]].clone()) for b in range(B)]


@pytest.mark.parametrize("accepted", list(CHAINS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_commit_equals_decoding_the_accepted_tokens_one_by_one(kind, accepted):
    prefix, paths = KINDS[kind], CHAINS[accepted]
    if kind == "dynamic" and len({len(p) for p in paths}) > 1:
        pytest.skip("one length for every row: refused, tested below")
    k, v, kt, vt, qt = _data(seed=1)
    cache = _cache(kind, prefix)
    _prefill(cache, kind, k, v, prefix)
    cache.update(kt, vt)
    commit_path(cache, tree(PARENTS), paths)

    alone = _cache(kind, prefix)  # the same prefix, then the accepted tokens one at a time
    _prefill(alone, kind, k, v, prefix)
    A = max(len(p) for p in paths)
    for i in range(A):
        node = torch.tensor([p[i] if i < len(p) else 0 for p in paths])
        alone.update(kt[torch.arange(B), :, node].unsqueeze(2), vt[torch.arange(B), :, node].unsqueeze(2))
        if any(len(p) == i for p in paths):  # a row whose path ended: drop what it does not accept
            ends = torch.tensor([prefix[b] + min(len(paths[b]), i + 1) for b in range(B)])
            alone.crop(ends)
    if A and isinstance(alone, (StaticKVCache, PagedKVCache)):
        alone.crop(torch.tensor([prefix[b] + len(paths[b]) for b in range(B)]))

    assert cache.lengths.tolist() == alone.lengths.tolist() == [prefix[b] + len(paths[b]) for b in range(B)]
    for (ck, cv), (ak, av) in zip(_stored(cache), _stored(alone), strict=True):
        assert torch.equal(ck, ak) and torch.equal(cv, av)
    # and the next step reads them alike
    gen = torch.Generator().manual_seed(5)
    q1 = torch.randn(B, HQ, 1, D, generator=gen, dtype=torch.float64)
    k1, v1 = (torch.randn(B, HKV, 1, D, generator=gen, dtype=torch.float64) for _ in range(2))
    outs = []
    for c in (cache, alone):
        read = c.update(k1, v1)
        outs.append(mh.attention(q1, read.keys, read.values, mask=read.mask(None, causal=True, heads=HQ)))
    torch.testing.assert_close(outs[0], outs[1])


def test_paged_commit_frees_the_pages_of_rejected_drafts():
    cache = PagedKVCache(num_pages=12, page_size=2, num_kv_heads=HKV, head_dim=D, batch_size=B, dtype=torch.float64)
    k, v, kt, vt, _ = _data(seed=2)
    _prefill(cache, "paged", k, v, [4, 4])
    free = len(cache.free)
    cache.update(kt, vt)  # 7 drafts: 4 more pages per row
    assert len(cache.free) == free - 8
    commit_path(cache, PARENTS, [[0], [3]])  # 5 tokens per row: 3 pages
    assert len(cache.free) == free - 2 and cache.lengths.tolist() == [5, 5]


def _snapshot(cache):
    return cache.lengths.tolist(), _stored(cache)


BAD = [
    ([[0, 3], [0]], ValueError, r"path row 0 \[0, 3\] is not a root-to-node chain: node 3 \(parent 1\) at depth 1"),
    ([[1], [0]], ValueError, r"node 1 \(parent 0\) at depth 0 must be a root"),
    ([[0, 9], [0]], ValueError, r"names node 9; expected nodes in \[0, 7\)"),
    ([[0], [0], [0]], ValueError, r"path has 3 rows, the cache 2"),
    (torch.tensor([[0, -1, 1], [0, 1, 2]]), ValueError, r"-1 before a node"),
    (torch.tensor([0.0, 1.0]), TypeError, r"integer tensor \(A,\) or \(B, A\)"),
    ("0,1", TypeError, r"path must be node indices"),
    (
        torch.tensor([0, 1], device="meta"),
        ValueError,
        r"commit_path: path is on the meta device \(a shape without values\), got torch.int64 of shape \(2,\); "
        r"expected an integer tensor \(A,\) or \(B, A\) of accepted nodes with values",
    ),
]


@pytest.mark.parametrize("path,error,message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_a_refused_commit_changes_nothing(path, error, message):
    cache = _cache("static-per-row", [5, 9])
    k, v, kt, vt, _ = _data(seed=3)
    _prefill(cache, "static", k, v, [5, 9])
    cache.update(kt, vt)
    before = _snapshot(cache)
    with pytest.raises(error, match=message):
        commit_path(cache, tree(PARENTS), path)
    after = _snapshot(cache)
    assert before[0] == after[0]
    for (bk, bv), (ak, av) in zip(before[1], after[1], strict=True):
        assert torch.equal(bk, ak) and torch.equal(bv, av)


def test_caches_that_cannot_commit_say_why():
    k, v, kt, vt, _ = _data(seed=4)
    dynamic = DynamicKVCache()
    dynamic.update(k[:, :, :6], v[:, :, :6])
    dynamic.update(kt, vt)
    with pytest.raises(
        ValueError, match=r"DynamicKVCache keeps one length for every row, but the paths accept \[1, 2\]"
    ):
        commit_path(dynamic, PARENTS, [[0], [0, 1]])
    assert dynamic.length == 13
    short = DynamicKVCache()
    short.update(k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match=r"hold \[3, 3\] tokens, fewer than the tree's T=7"):
        commit_path(short, PARENTS, [0])
    ring = mh.SlidingWindowKVCache(16, B, HKV, D, dtype=torch.float64)
    ring.update(k, v)
    with pytest.raises(TypeError, match=r"SlidingWindowKVCache cannot commit a tree path: a ring"):
        commit_path(ring, PARENTS, [0])
    policy = DynamicKVCache(policy=mh.caches.policies.SinksAndWindow(2, 8))
    policy.update(k, v)
    with pytest.raises(TypeError, match=r"PolicyKVCache cannot commit a tree path: an eviction policy"):
        commit_path(policy, PARENTS, [0])
    with pytest.raises(TypeError, match=r"cache must be a KVCache, got Tensor"):
        commit_path(k, PARENTS, [0])


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_a_rotary_layer_verifies_a_tree_like_each_path_alone_then_commits(kind):
    """A GQA layer with rotary positions: the drafts at positions ``P + depth`` with
    ``mask=tree(parents)`` (stored after the prefix, in call order, on every cache: the positions
    only rotate them) give, node by node, the layer's output for the prefix followed by that node's
    path alone; after ``commit_path`` the next token's output equals the full forward of the
    accepted text."""
    torch.manual_seed(0)
    E, P = 32, 6
    layer = mh.MultiHeadAttention(E, HQ, num_kv_heads=HKV, causal=True, rope=mh.positions.RotaryEmbedding(8))
    layer = layer.double()
    parents = PARENTS[:1]  # one tree for the batch row
    x = torch.randn(1, P + T + 1, E, dtype=torch.float64)
    prefix, drafts, last = x[:, :P], x[:, P : P + T], x[:, P + T :]
    draft = tree(parents)
    cache = {
        "dynamic": lambda: DynamicKVCache(),
        "static": lambda: StaticKVCache(1, 32, HKV, E // HQ, dtype=torch.float64),
        "paged": lambda: PagedKVCache(8, 4, HKV, E // HQ, dtype=torch.float64),
    }[kind]()
    layer(prefix, kv_cache=cache)
    out = layer(drafts, mask=draft, positions=P + draft.depths()[0], kv_cache=cache)
    for node in range(T):
        path = _path_to(parents[0].tolist(), node)
        alone = layer(torch.cat([prefix, drafts[:, path]], dim=1))
        torch.testing.assert_close(out[:, node], alone[:, -1])
    accepted = _path_to(parents[0].tolist(), 6)  # [0, 2, 5, 6]
    commit_path(cache, draft, accepted)
    step = layer(last, kv_cache=cache)
    whole = layer(torch.cat([prefix, drafts[:, accepted], last], dim=1))
    torch.testing.assert_close(step[:, -1], whole[:, -1])


def test_a_latent_cache_commits_its_rows():
    """MLA's one latent row per token (values are the keys' first features): the accepted rows kept."""
    cache = mh.LatentKVCache()
    rows = torch.randn(1, 1, 10, 12, dtype=torch.float64)  # 6 prefix tokens, then 4 drafts
    cache.update(rows, rows[..., :8])
    commit_path(cache, torch.tensor([-1, 0, 0, 1]), [0, 2])
    assert cache.length == 8
    assert torch.equal(cache.keys[0, 0], rows[0, 0, [0, 1, 2, 3, 4, 5, 6, 8]])
    assert cache.values.data_ptr() == cache.keys.data_ptr()  # still stored once
