"""``multihead.masks.tree``: the token-tree mask of speculative decoding.

* its meaning equals a dense mask built here from the parents by walking each node's chain of
  ancestors (bottom-right and ``start=`` placements, one tree or one per row, chains, stars,
  ``Lq`` > ``T``: queries before the tree, prefix length 0);
* attention through it (alone, ``& key_padding``, ``| sliding_window``) equals the fp64 reference
  given that dense mask, on every backend that does not refuse the call, fp64 exactly and
  fp32/bf16 by the relative rule, at the block-sparse block size ± 1 and with GQA;
* its structural answers (``block_state``, ``key_range``, ``causal_offset``) agree with its dense
  form, and a block-sparse call materializes nothing near ``Lq x Lk``;
* bad arguments in one table.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh
from helpers import assert_relative, naive_attention, refuses
from multihead.backends.blocksparse import DEFAULT_BLOCK_SIZE
from multihead.blocks import Block, Extent
from multihead.masks import BlockState, Tree, tree

BS = DEFAULT_BLOCK_SIZE


def _oracle(parents, B, Lq, Lk, start=None):
    """``(B, 1, Lq, Lk)`` bool from the definition: causal (bottom-right without ``start``,
    top-left with it), except that within the tree a node sees only the nodes met walking up its
    parents (walked here one node at a time)."""
    parents = parents.view(-1, parents.shape[-1])
    T = parents.shape[1]
    out = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        par = parents[0 if parents.shape[0] == 1 else b].tolist()
        if start is None:
            shift, s = Lk - Lq, Lk - T
        else:
            shift, s = 0, start if isinstance(start, int) else int(start[b])
        i = torch.arange(Lq).view(-1, 1) + shift  # each query's own key position
        j = torch.arange(Lk).view(1, -1)
        out[b, 0] = j <= i
        for node in range(T):
            row = node + s - shift  # the query of this node
            if not 0 <= row < Lq:
                continue
            out[b, 0, row, s : s + T] = False
            walk = node
            while walk != -1:
                out[b, 0, row, s + walk] = True
                walk = par[walk]
    return out


def _random_parents(T, gen, B=None):
    """A random tree in drafter order: each node's parent an earlier node or -1 (a few roots)."""
    rows = []
    for _ in range(B or 1):
        row = [-1]
        for i in range(1, T):
            row.append(
                int(torch.randint(-1, i, (1,), generator=gen))
                if i > 1
                else int(torch.randint(-1, 1, (1,), generator=gen))
            )
        rows.append(row)
    t = torch.tensor(rows)
    return t if B else t[0]


SHAPES = {  # name: (parents builder, B, Lq, Lk, start)
    "star-br": (lambda g: torch.tensor([-1, 0, 0, 0, 0, 0]), 2, 6, 11, None),
    "chain-br": (lambda g: torch.arange(-1, 6), 1, 7, 7, None),
    "random-prefix0": (lambda g: _random_parents(9, g), 2, 9, 9, None),
    "random-Lq>T": (lambda g: _random_parents(5, g), 2, 8, 12, None),  # 3 queries before the tree
    "per-row-trees": (lambda g: _random_parents(7, g, B=3), 3, 7, 20, None),
    "start-int": (lambda g: _random_parents(5, g), 2, 12, 12, 4),
    "start-per-row": (lambda g: _random_parents(4, g, B=3), 3, 10, 10, torch.tensor([0, 3, 6])),
    "roots-only": (lambda g: torch.full((5,), -1), 1, 5, 9, None),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_meaning_equals_the_definition(name):
    build, B, Lq, Lk, start = SHAPES[name]
    parents = build(torch.Generator().manual_seed(len(name)))
    mask = tree(parents, start=start)
    mask.check(Extent(B, 2, Lq, Lk))
    got = mask.materialize(B, 2, Lq, Lk).expand(B, 2, Lq, Lk)
    want = _oracle(parents, B, Lq, Lk, start).expand(B, 2, Lq, Lk)
    assert torch.equal(got, want)
    assert mask == tree(parents.clone(), start=start)  # by value
    depth = mask.depths()
    assert depth.shape == parents.view(-1, parents.shape[-1]).shape
    assert int(depth.min()) == 0


def test_picture_chain_and_star():
    star = tree(torch.tensor([-1, 0, 0, 0]))
    assert star.to_string() == "\n".join(["█····", "██···", "███··", "██·█·", "██··█"])
    assert repr(star).startswith("tree([-1, 0, 0, 0])")
    chain = tree(torch.tensor([-1, 0, 1, 2]))
    assert chain.is_chain() and chain.causal_offset(4, 9) == 5  # exactly causal(): fast paths see it
    assert star.causal_offset(4, 9) is None
    assert tree(torch.tensor([-1, 0, 1]), start=2).causal_offset(5, 5) == 0


def test_structure_agrees_with_the_dense_form():
    """On random blocks: EMPTY has nothing visible, FULL everything, PARTIAL something;
    ``key_range`` covers every visible key of its rows, for every batch row."""
    gen = torch.Generator().manual_seed(4)
    B, Lq, Lk = 2, 40, 70
    for mask in (
        tree(_random_parents(25, gen, B=2)),
        tree(_random_parents(12, gen), start=torch.tensor([20, 50])) & mh.causal("top_left"),
    ):
        L_q = Lq if mask.depends_on_lengths() else Lk
        dense = mask.materialize(B, 1, L_q, Lk).expand(B, 1, L_q, Lk)
        seen = set()
        for _ in range(400):
            q0, q1 = sorted(torch.randint(0, L_q + 1, (2,), generator=gen).tolist())
            k0, k1 = sorted(torch.randint(0, Lk + 1, (2,), generator=gen).tolist())
            if q0 == q1 or k0 == k1:
                continue
            block = dense[:, :, q0:q1, k0:k1]
            extent = Extent(B, 1, L_q, Lk)
            state = mask.block_state(extent, Block(q0, q1, k0, k1))
            seen.add(state)
            if state is BlockState.EMPTY:
                assert not block.any()
            elif state is BlockState.FULL:
                assert block.all()
            else:
                assert block.any() and not block.all()
            lo, hi = mask.key_range(extent, Block(q0, q1, 0, Lk))
            visible = dense[:, :, q0:q1].any(dim=(0, 1, 2)).nonzero().flatten()
            if visible.numel():
                assert lo <= int(visible[0]) and int(visible[-1]) < hi
        assert seen == {BlockState.EMPTY, BlockState.FULL, BlockState.PARTIAL}


BACKENDS = ["reference", "sdpa", "blocksparse", "torch_blocks", "decode"]
# (Lq, Lk, T): a verification chunk against a prefix at the block size ± 1, the tree across a
# block boundary, a prefix of 0, and Lq > T (a prefill chunk before the tree)
LENGTHS = [
    (BS - 1, BS + 1 + 40, BS - 1),
    (BS + 1, 2 * BS + 1, 37),
    (BS + 1, BS + 1, BS + 1),
    (2 * BS - 1, 2 * BS - 1, 64),
    (17, BS + 18, 17),  # decode-sized: a small tree after a prefix
    (64, BS - 1, 64),  # the decode path's most queries
    (1, 9, 1),  # one node: a decode step
]
COMPOSED = {
    "tree": lambda parents, B, Lk: tree(parents),
    "tree&padding": lambda parents, B, Lk: tree(parents) & mh.key_padding(torch.tensor([Lk, Lk - 5])),
    "tree|window": lambda parents, B, Lk: tree(parents) | mh.sliding_window(3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("composed", list(COMPOSED))
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"Lq{a}-Lk{b}-T{c}" for a, b, c in LENGTHS])
def test_attention_through_it_equals_the_dense_reference(backend, composed, lengths):
    """fp64, exact to assert_close; GQA (4 query heads on 2 KV heads), one tree per row."""
    Lq, Lk, T = lengths
    B, Hq, Hkv, D = 2, 4, 2, 16
    gen = torch.Generator().manual_seed(Lq + Lk + T)
    parents = _random_parents(T, gen, B=B)
    mask = COMPOSED[composed](parents, B, Lk)
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    if refuses(backend, q, k, v, mask=mask):
        pytest.skip(f"{backend} refuses this call (checked: forcing it raises)")
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    dense = _oracle(parents, B, Lq, Lk)
    if composed == "tree&padding":
        dense = dense & (torch.arange(Lk) < torch.tensor([Lk, Lk - 5]).view(B, 1)).view(B, 1, 1, Lk)
    elif composed == "tree|window":
        i, j = torch.arange(Lq).view(-1, 1) + (Lk - Lq), torch.arange(Lk).view(1, -1)
        dense = dense | ((j <= i) & (j >= i - 3))
    want = mh.reference_attention(q, k, v, mask=dense.expand(B, Hq, Lq, Lk).clone()).output
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_follows_the_relative_rule(backend, dtype):
    """fp32/bf16 outputs against the fp64 reference: error at most F x that of naive attention in
    the same dtype (shared TESTING.md); non-contiguous queries (a transposed view)."""
    B, Hq, Hkv, D, T = 2, 4, 2, 40, 31
    Lq, Lk = T, BS + 3 + T
    gen = torch.Generator().manual_seed(11)
    parents = _random_parents(T, gen, B=B)
    mask = tree(parents) & mh.key_padding(torch.tensor([Lk, Lk - 2]))
    q64 = torch.randn(B, Lq, Hq, D, generator=gen, dtype=torch.float64).transpose(1, 2)  # non-contiguous
    k64, v64 = (torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    if refuses(backend, q, k, v, mask=mask):
        pytest.skip(f"{backend} refuses this call (checked: forcing it raises)")
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    dense = _oracle(parents, B, Lq, Lk) & (torch.arange(Lk) < torch.tensor([Lk, Lk - 2]).view(B, 1)).view(B, 1, 1, Lk)
    want = mh.reference_attention(q64, k64, v64, mask=dense).output
    base = naive_attention(q, k, v, dense)
    assert_relative(got, want, base, mh.get_backend(backend).capabilities.tolerance_factor(dtype, False))


def test_blocksparse_runs_prefix_blocks_full_and_allocates_no_square():
    """A 64-node tree after a 4k prefix: the prefix blocks are FULL (no mask read), only the
    blocks meeting the tree are partial, and nothing near ``Lq x Lk`` is allocated."""
    B, H, D, T, P = 1, 2, 16, 64, 4096
    Lk = P + T
    parents = _random_parents(T, torch.Generator().manual_seed(2))
    mask = tree(parents)
    extent = Extent(B, H, T, Lk)
    states = [mask.block_state(extent, Block(0, T, k0, min(k0 + BS, Lk))) for k0 in range(0, Lk, BS)]
    assert states[: P // BS] == [BlockState.FULL] * (P // BS)
    assert states[-1] is BlockState.PARTIAL
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = (torch.randn(B, H, Lk, D, dtype=torch.float64) for _ in range(2))
    with _LargestMask() as spy:
        got = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    assert 0 < spy.largest <= BS * T, spy.largest  # the tree's blocks only; the (Lq x Lk) mask would be T·Lk
    want = mh.reference_attention(q, k, v, mask=_oracle(parents, B, T, Lk)).output
    torch.testing.assert_close(got, want)


class _LargestMask(TorchDispatchMode):
    """The largest bool tensor any op returns: the masks a call materializes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                self.largest = max(self.largest, t.numel())
        return out


BAD = [
    (lambda: tree(torch.tensor([-1.0, 0.0])), TypeError, r"parents must be an integer tensor.*float32"),
    (lambda: tree(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, r"shape \(T,\) or \(B, T\).*\(2, 2, 2\)"),
    (lambda: tree(torch.zeros(0, dtype=torch.long)), ValueError, r"T >= 1 nodes, got \(0,\)"),
    (
        lambda: tree(torch.tensor([-1, 2, 0])),
        ValueError,
        r"parents\[1\] = 2; expected -1 \(a root\) or an earlier node in \[0, 1\)",
    ),
    (lambda: tree(torch.tensor([[-1, 0], [-1, -2]])), ValueError, r"parents\[1, 1\] = -2"),
    (lambda: tree(torch.tensor([-1, 0]), start=-1), ValueError, r"start must be >= 0"),
    (
        lambda: tree(torch.tensor([-1, 0]), start=1.5),
        TypeError,
        r"start must be None, an int or a \(B,\) integer tensor",
    ),
    (lambda: tree(torch.tensor([-1, 0]), start=torch.tensor([1, -3])), ValueError, r"got \[1, -3\]"),
    (
        lambda: tree(torch.tensor([[-1, 0]] * 2)).check(Extent(3, 1, 4, 4)),
        ValueError,
        r"parents has 2 batch rows, the call 3",
    ),
    (
        lambda: tree(torch.tensor([-1, 0, 1])).check(Extent(1, 1, 2, 9)),
        ValueError,
        r"T=3 nodes.*Lq=2; expected Lq >= 3",
    ),
    (
        lambda: tree(torch.tensor([-1, 0, 1]), start=8).check(Extent(1, 1, 9, 9)),
        ValueError,
        r"positions \[8, 11\) but Lk=9",
    ),
    (
        lambda: mh.attention(*(torch.randn(1, 1, 2, 4),) * 3, mask=tree(torch.tensor([-1, 0, 0]))),
        ValueError,
        r"Lq=2; expected Lq >= 3",
    ),
]


@pytest.mark.parametrize("make,error,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_is_a_mask_that_composes():
    mask = tree(torch.tensor([-1, 0, 0])) & mh.causal()
    assert isinstance(mask.parts[0], Tree)
    assert "tree([-1, 0, 0]) & causal" in mask._describe()


@pytest.mark.slow
def test_flex_runs_it_like_the_reference():
    """Compiled FlexAttention (slow tier: a compile per mask) reads the tree through its mask_mod."""
    B, Hq, Hkv, Lq, Lk, D, T = 2, 4, 2, 40, 200, 32, 40
    gen = torch.Generator().manual_seed(9)
    parents = _random_parents(T, gen, B=B)
    mask = tree(parents)
    q = torch.randn(B, Hq, Lq, D, generator=gen)
    k, v = (torch.randn(B, Hkv, Lk, D, generator=gen) for _ in range(2))
    if refuses("flex", q, k, v, mask=mask):
        pytest.skip("flex refuses this call (checked: forcing it raises)")
    got = mh.attention(q, k, v, mask=mask, backend="flex")
    dense = _oracle(parents, B, Lq, Lk)
    want = mh.reference_attention(q.double(), k.double(), v.double(), mask=dense).output
    factor = mh.get_backend("flex").capabilities.tolerance_factor(torch.float32, False)
    assert_relative(got, want, naive_attention(q, k, v, dense), factor)
