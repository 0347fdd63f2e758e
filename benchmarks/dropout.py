"""Dropout on the structured path: forward+backward with ``dropout_p=0.1`` against the same call
without dropout (issue 9: within 1.5x), and against SDPA's own dropout (its math kernel on a
dense mask, the first wave's path).

Cases (fp32, 2 threads): ``attention()`` with ``sliding_window(512)`` at B=1, H=8, L=4096, D=64;
and ``MultiHeadAttention(512, 8, causal=True, dropout=0.1)`` in training mode at B=1, L=4096.
``--quick``: L=2048. Timed in interleaved rounds, fastest kept (:func:`common.fastest_ms`).

Each row also times the random draw alone: ``torch.rand`` of one number per score the call may
see (what PyTorch's dropout draws), against the call without dropout. No dropout that draws
with PyTorch's CPU generator can be faster than the call plus its draw, so ``draw alone / no
dropout`` above 0.5 puts the 1.5x target out of reach of any implementation built on it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import THREADS, context, fastest_ms, machine_state, mh, print_table, write_csv


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    L = 2048 if args.quick else 4096
    print(f"# dropout, forward+backward  ({context()}); {machine_state()}")
    rows = [_window(L), _layer(L)]
    print_table(f"dropout 0.1, forward+backward, L={L}: ratios to the same call without dropout (target <= 1.5)", rows)
    write_csv("dropout" + ("_quick" if args.quick else ""), rows)
    return rows


def _step(fn, *leaves):
    def run():
        for t in leaves:
            t.grad = None
        fn().sum().backward()

    return run


def _window(L: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, generator=gen, requires_grad=True) for _ in range(3))
    mask = mh.sliding_window(512)
    dense = mask.materialize(1, 8, L, L)
    visible = int(dense.sum()) * 8  # the scores a dropout draws for: one per visible (row, key), each head
    fns = {
        "no dropout": _step(lambda: mh.attention(q, k, v, mask=mask), q, k, v),
        "draw alone": lambda: torch.rand(visible),
        "dropout 0.1": _step(lambda: mh.attention(q, k, v, mask=mask, dropout_p=0.1, backend="torch_blocks"), q, k, v),
        "dropout 0.1, auto": _step(lambda: mh.attention(q, k, v, mask=mask, dropout_p=0.1), q, k, v),
        "sdpa dense mask, dropout 0.1": _step(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=0.1), q, k, v
        ),
    }
    return _row(
        f"attention, sliding_window(512), B=1 H=8 L={L} D=64 (dropout: torch_blocks forced)",
        fns,
        mh.explain(q.detach(), k.detach(), v.detach(), mask=mask, dropout_p=0.1).backend,
    )


def _layer(L: int) -> dict:
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(512, 8, causal=True, dropout=0.1).train()
    plain = mh.MultiHeadAttention(512, 8, causal=True, dropout=0.0).train()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(1, L, 512, requires_grad=True)
    visible = 8 * L * (L + 1) // 2  # causal: one draw per visible (row, key) of each head
    fns = {
        "no dropout": _step(lambda: plain(x), x),
        "dropout 0.1": _step(lambda: layer(x), x),
        "draw alone": lambda: torch.rand(visible),
    }
    backend = mh.explain(
        torch.randn(1, 8, L, 64), torch.randn(1, 8, L, 64), torch.randn(1, 8, L, 64), mask=mh.causal(), dropout_p=0.1
    ).backend
    return _row(f"MultiHeadAttention(512, 8, causal=True), B=1 L={L} (auto)", fns, backend)


def _row(case: str, fns: dict, backend: str) -> dict:
    ms = fastest_ms(fns, rounds=2, min_run_time=0.5)
    row = {
        "case": case,
        "backend with dropout": backend,
        **{f"{n}_ms": t for n, t in ms.items()},
        "dropout / no dropout": ms["dropout 0.1"] / ms["no dropout"],
        # The floor of any dropout that draws one number per visible score with PyTorch's CPU
        # generator (as torch's dropout does): the target (1.5) needs this below 0.5.
        "draw alone / no dropout": ms["draw alone"] / ms["no dropout"],
        "threads": THREADS,
    }
    if "sdpa dense mask, dropout 0.1" in ms:
        row["sdpa dropout / blocksparse dropout"] = ms["sdpa dense mask, dropout 0.1"] / ms["dropout 0.1"]
        row["auto dropout / no dropout"] = ms["dropout 0.1, auto"] / ms["no dropout"]
    print(row, flush=True)
    return row


if __name__ == "__main__":
    main()
