"""The slow tier's checks (``pytest -m slow tests/distributed``), registered in
:data:`dist_checks.CHECKS` under names starting with ``slow-``: wider than the default tier, in
worlds of 2, 3, 4 and 8.

* **odd sizes**: head dims 59 and 40 with ``Dv != D``, and 128; three batch rows with different
  key lengths; GQA and MQA; every mask kind, both layouts, ring and Ulysses;
* **fp32** by the relative rule at a longer length (``L = 96·P`` positions) and head dim 59;
* **seeded random cases** (:func:`random_case`): method, layout, batch, heads, lengths, head
  dims, mask, LSE in the loss or not, block backend and backward tile size drawn from a seed and
  the world size; the test id spells the whole case.
"""

from __future__ import annotations

import random

import torch
from dist_checks import (
    NAMES,
    check,
    compare_fp64,
    expected_run,
    inputs,
    loss_of,
    make_mask,
    naive_fp32,
    sharded_run,
    small_tiles,
)

from multihead.distributed import ring_attention, shard_sequence, ulysses_attention

FUNCTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}

# masks that make sense whatever Lq and Lk are, and those that need one sequence (document ids)
ANY_LENGTHS = (
    "none",
    "causal",
    "causal_top_left",
    "window_small",
    "window_large",
    "window_two_sided",
    "padding",
    "causal_padding",
    "bool_tensor",
)
ONE_SEQUENCE = ("documents", "document_causal", "window_documents")


def ulysses_heads(world: int, rng: random.Random | None = None) -> tuple[int, int]:
    """Heads Ulysses can split over ``world`` ranks: ``P | Hq``, and ``P | Hkv`` or ``Hkv | P``."""
    options = [(2 * world, world), (2 * world, 1), (world, world)] + ([(2 * world, 2)] if world % 2 == 0 else [])
    return options[0] if rng is None else rng.choice(options)


# ------------------------------------------------------------------------------------ odd sizes
for _fn in ("ring", "ulysses"):
    for _layout in ("zigzag", "contiguous"):
        for _kind in ANY_LENGTHS + ONE_SEQUENCE:

            def _odd(rank, world, fn=_fn, layout=_layout, kind=_kind):
                """B = 3 (rows with different key lengths under padding), D = 59 with Dv = 40 and
                the reverse, and D = Dv = 128; GQA 6/3 (ring) or Ulysses' own heads."""
                Lq = 4 * world * 3  # 12 positions per rank, whole zigzag chunks
                for D, Dv in ((59, 40), (40, 59), (128, 128)):
                    if fn == "ring":
                        heads = {"Hq": 6, "Hkv": 3} if D != 128 else {"Hq": 8, "Hkv": 1}
                    else:
                        heads = dict(zip(("Hq", "Hkv"), ulysses_heads(world)))
                    compare_fp64(FUNCTIONS[fn], mask_kind=kind, layout=layout, B=3, Lq=Lq, D=D, Dv=Dv, **heads)
                    compare_fp64(
                        FUNCTIONS[fn], mask_kind=kind, layout=layout, B=3, Lq=Lq, D=D, Dv=Dv, lse=False, **heads
                    )

            check(f"slow-odd-sizes-{_fn}-{_layout}-{_kind}")(_odd)


# ------------------------------------------------------------------------------------ fp32, longer
for _fn, _layout, _kind in (
    ("ring", "zigzag", "causal"),
    ("ring", "contiguous", "window_large"),
    ("ring", "zigzag", "document_causal"),
    ("ring", "zigzag", "causal_padding"),
    ("ulysses", "zigzag", "causal"),
):

    def _fp32(rank, world, fn=_fn, layout=_layout, kind=_kind):
        from helpers import assert_relative

        B, Lq, D, Dv = 3, 96 * world, 59, 40
        Hq, Hkv = (6, 3) if fn == "ring" else ulysses_heads(world)
        q, k, v, gout, glse = inputs(B, Hq, Hkv, Lq, Lq, D, Dv, torch.float32, seed=11)
        glse = glse.float()
        mask = make_mask(kind, B, Lq, Lq)
        got = sharded_run(FUNCTIONS[fn], q, k, v, gout, glse, mask=mask, layout=layout)
        want = expected_run(*(t.double() for t in (q, k, v, gout, glse)), mask=mask, layout=layout)
        qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
        out_b, lse_b = naive_fp32(qb, kb, vb, mask)
        grads_b = torch.autograd.grad(loss_of(out_b, lse_b, gout, glse), (qb, kb, vb))
        baseline = tuple(shard_sequence(t, layout=layout, dim=2) for t in (out_b, lse_b) + tuple(grads_b))
        for name, x, y, b in zip(NAMES, got, want, baseline):
            finite = torch.isfinite(y)
            if name == "lse":
                assert torch.equal(torch.isneginf(x), torch.isneginf(y)), "LSE -inf rows differ"
            # F = 10 for fp32 (TESTING.md: an online softmax reorders sums)
            assert_relative(x[finite], y[finite], b[finite], 10.0, what=f"{fn} {layout} {kind} {name}")

    check(f"slow-fp32-{_fn}-{_layout}-{_kind}")(_fp32)


# ------------------------------------------------------------------------------------ random cases
RANDOM_SEEDS = range(24)


def random_case(seed: int, world: int) -> dict:
    """A case drawn from ``seed`` and the world size, the same on every rank and in the parent."""
    rng = random.Random(1000 * seed + world)
    fn = rng.choice(("ring", "ring", "ulysses"))
    layout = rng.choice(("zigzag", "contiguous"))
    chunk = 2 * world if layout == "zigzag" else world  # the whole length splits into these
    chunks = (max(1, -(-8 // chunk)), max(2, 64 // chunk))  # at least 8 positions (padding masks 7), at most ~64
    Lq = chunk * rng.randint(*chunks)
    Lk = Lq if fn == "ulysses" or rng.random() < 0.5 else chunk * rng.randint(*chunks)
    if fn == "ring":
        Hq, Hkv = rng.choice(((1, 1), (4, 4), (8, 2), (6, 3), (8, 1)))
    else:
        Hq, Hkv = ulysses_heads(world, rng)
    D = rng.choice((8, 40, 59, 64))
    Dv = D if rng.random() < 0.5 else rng.choice((8, 40, 59, 64))
    kinds = ANY_LENGTHS + (ONE_SEQUENCE if Lq == Lk else ())
    return {
        "fn": fn,
        "layout": layout,
        "B": rng.choice((1, 3)),
        "Hq": Hq,
        "Hkv": Hkv,
        "Lq": Lq,
        "Lk": Lk,
        "D": D,
        "Dv": Dv,
        "mask": rng.choice(kinds),
        "lse": rng.random() < 0.5,
        "backend": rng.choice(("auto", "auto", "reference")) if fn == "ring" else "auto",
        "tile": rng.choice((None, 3, 7)) if fn == "ring" else None,
    }


def describe(case: dict) -> str:
    c = case
    return (
        f"{c['fn']}-{c['layout']}-B{c['B']}-H{c['Hq']}x{c['Hkv']}-L{c['Lq']}x{c['Lk']}-D{c['D']}-Dv{c['Dv']}-"
        f"{c['mask']}-{'lse' if c['lse'] else 'out'}-{c['backend']}" + (f"-tile{c['tile']}" if c["tile"] else "")
    )


for _seed in RANDOM_SEEDS:

    def _random(rank, world, seed=_seed):
        c = random_case(seed, world)
        kw = {"backend": c["backend"]} if c["fn"] == "ring" else {}
        run = lambda: compare_fp64(
            FUNCTIONS[c["fn"]],
            mask_kind=c["mask"],
            layout=c["layout"],
            B=c["B"],  # noqa: E731
            Hq=c["Hq"],
            Hkv=c["Hkv"],
            Lq=c["Lq"],
            Lk=c["Lk"],
            D=c["D"],
            Dv=c["Dv"],
            lse=c["lse"],
            seed=seed,
            **kw,
        )
        if c["tile"]:
            with small_tiles(c["tile"]):
                run()
        else:
            run()

    check(f"slow-random-{_seed:02d}")(_random)
