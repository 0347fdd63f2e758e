"""The host side of the ``triton_blocks`` backend, without triton: the tile plan (which key tiles
each query tile reads, full or partial) against the dense mask, and the mask program (the leaves
and truth table the kernels evaluate) against ``Mask.materialize``, through an evaluator written
here from the table in ``mask_program``'s docstring (independent of the kernels)."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from helpers import STRUCTURED_KINDS, make_mask
from multihead.backends import mask_program as mp
from multihead.backends.tile_plan import tile_plan, visible_tiles
from multihead.masks import Band

#: The kinds of tests/helpers.py the backend runs (test_triton_blocks.py, KINDS).
KINDS = [*STRUCTURED_KINDS, "shifted_causal", "shifted_causal_br", "window_per_sequence", "document_causal"]
SHAPES = [(1, 1), (13, 13), (40, 33), (33, 70), (70, 33)]


def _mask(kind: str, B: int, Lq: int, Lk: int, seed: int = 0):
    return make_mask(kind, B, 2, Lq, Lk, torch.Generator().manual_seed(seed))


def evaluate(program: mp.MaskProgram, B: int, Lq: int, Lk: int) -> torch.Tensor:
    """The program's ``(B, Lq, Lk)`` visibility, leaf by leaf as the docstring's table says."""
    q = torch.arange(Lq).view(1, -1, 1)
    kv = torch.arange(Lk).view(1, 1, -1)
    b = torch.arange(B).view(-1, 1, 1)
    data = program.data.long()
    index = torch.zeros(B, Lq, Lk, dtype=torch.long)
    for j, (kind, p) in enumerate(zip(program.kinds, program.params.long().tolist())):
        qq, kk = q + p[0], kv + p[1]
        if kind == mp.BAND:
            c = qq + data[p[6] + b]
            ok = ((kk >= c - p[2]) | (p[3] == 0)) & ((kk <= c + p[4]) | (p[5] == 0))
        elif kind == mp.LENGTHS:
            ok = kk < data[p[2] + b]
        elif kind == mp.VALID:
            ok = data[p[2] + b * p[3] + kk] != 0
        else:
            ok = data[p[2] + b * p[3] + qq] == data[p[4] + b * p[5] + kk]
            if kind == mp.DOCUMENT_CAUSAL:
                ok = ok & (data[p[7] + b * p[5] + kk] <= data[p[6] + b * p[3] + qq])
        index = index + (ok.expand(B, Lq, Lk).long() << j)
    return (program.table >> index) & 1 == 1


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_mask_program_is_the_mask(kind, Lq, Lk):
    B = 3
    mask = _mask(kind, B, Lq, Lk)
    program = mp.mask_program(mask, B, Lq, Lk)
    assert not isinstance(program, str), program
    want = torch.ones(B, Lq, Lk, dtype=torch.bool) if mask is None else mask.materialize(B, 1, Lq, Lk)[:, 0]
    assert torch.equal(evaluate(program, B, Lq, Lk), want.expand(B, Lq, Lk))


def test_combinations_up_to_five_leaves_and_bool_tables():
    B, Lq, Lk = 2, 30, 37
    ids = torch.tensor([0] * 10 + [1] * 12 + [2] * 8)
    kv_ids = torch.tensor([0] * 15 + [1] * 12 + [3] * 10)
    pad = torch.rand(B, Lk, generator=torch.Generator().manual_seed(1)) > 0.6
    masks = [
        (mh.causal() & mh.sliding_window(9)) | (mh.document(ids, kv_ids) & ~mh.key_padding([20, 30]))
        | mh.key_padding([3, 0]),
        mh.key_padding(pad=pad) & mh.sliding_window(4, 2, align="top_left"),
        ~(mh.document_causal(ids, kv_ids) | mh.causal(q_lengths=[30, 12], kv_lengths=[37, 20])),
        (mh.document(torch.cat([ids, ids[-2:]]), kv_ids) & mh.causal()).shifted(2, 0, q_len=32, kv_len=37),
    ]  # fmt: skip
    for mask in masks:
        program = mp.mask_program(mask, B, Lq, Lk)
        assert not isinstance(program, str), program
        assert torch.equal(evaluate(program, B, Lq, Lk), mask.materialize(B, 1, Lq, Lk)[:, 0].expand(B, Lq, Lk))


@pytest.mark.parametrize(
    "mask,reason",
    [
        (mh.custom(lambda b, h, q, kv: q >= kv), "no per-element formula"),
        (mh.masks.as_mask(torch.ones(6, 6, dtype=torch.bool)), "no per-element formula"),
        (mh.causal().at(torch.arange(6), torch.arange(6), q_len=6, kv_len=6), "position tensors"),
        (mh.causal() & mh.key_padding([5]) & mh.sliding_window(2) & mh.causal("top_left") & mh.key_padding([4])
         & mh.sliding_window(4, 1), "6 leaves"),
    ],
)  # fmt: skip
def test_masks_without_a_program_say_why(mask, reason):
    program = mp.mask_program(mask, 1, 6, 6)
    assert isinstance(program, str) and reason in program


def _dense_tiles(mask, B, Lq, Lk, bm, bn):
    """``{(query tile, key tile): "full" | "partial"}`` of the visible tiles, from the dense mask."""
    dense = torch.ones(B, 1, Lq, Lk, dtype=torch.bool) if mask is None else mask.materialize(B, 2, Lq, Lk)
    dense = dense.expand(B, 2, Lq, Lk)
    out = {}
    for t in range(-(-Lq // bm)):
        for n in range(-(-Lk // bn)):
            block = dense[..., t * bm : (t + 1) * bm, n * bn : (n + 1) * bn]
            if block.any():
                out[(t, n)] = "full" if block.all() and (n + 1) * bn <= Lk else "partial"
    return out


def _plan_tiles(plan):
    out = {}
    for owner, (p0, p1, f0, f1) in enumerate(plan.ptr.tolist()):
        for i in range(p0, p1):
            out[(owner, int(plan.idx[i]))] = "partial"
        for i in range(f0, f1):
            assert (owner, int(plan.idx[i])) not in out, "a tile both partial and full"
            out[(owner, int(plan.idx[i]))] = "full"
    return out


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("Lq,Lk", [(40, 33), (33, 70), (64, 64)])
@pytest.mark.parametrize("kind", KINDS)
def test_the_tile_plan_reads_every_visible_tile_and_masks_only_mixed_ones(kind, Lq, Lk, tiles):
    B, (bm, bn) = 2, tiles
    mask = _mask(kind, B, Lq, Lk, seed=1)
    by_query, by_key = tile_plan(mask, B, 2, Lq, Lk, bm, bn)
    dense = _dense_tiles(mask, B, Lq, Lk, bm, bn)
    planned = _plan_tiles(by_query)
    # Every visible tile is read; a tile the plan skips is empty; a full tile is all visible. A
    # mixed tile the mask cannot prove full stays partial (conservative, never wrong).
    assert set(dense) <= set(planned)
    assert all(state == "partial" for tile, state in planned.items() if tile not in dense)
    assert all(dense.get(tile) == "full" for tile, state in planned.items() if state == "full")
    assert by_query.tiles == len(planned)
    assert _plan_tiles(by_key) == {(n, t): state for (t, n), state in planned.items()}  # the transpose


def test_a_causal_row_costs_a_few_questions_not_one_per_tile(monkeypatch):
    asked = []
    original = Band.block_state

    def counting(self, *args, **kwargs):
        asked.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Band, "block_state", counting)
    L, tile = 4096, 64
    tiles = visible_tiles(mh.causal(), 1, 1, L, L, L - tile, L, tile)  # the last query tile: every key tile
    assert len(tiles) == L // tile and [n for n, _ in tiles] == list(range(L // tile))
    assert [partial for _, partial in tiles] == [False] * (L // tile - 1) + [True]
    assert len(asked) <= 2 * (L // tile).bit_length()
