"""Block-selection attention (``block_select(...) & causal()``) against dense causal SDPA: does the
cost follow the selected blocks?

Attention core, fp32, ``B=1, Hq=12, Hkv`` from the command line, ``D=64``, causal, key blocks of
64 and query blocks of 64; each (batch, KV head, query block) reads its own (diagonal) block and
``k - 1`` earlier blocks drawn at random (fewer near the start): a selection density of about
``k / nK`` of the key blocks (``nK = L / 64``), or half that of the causal triangle's. Contenders,
in one process on the same inputs, each first checked against the fp64 reference on a slice:

* ``dense causal sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``;
* ``select k=…``: ``multihead.attention(q, k, v, mask=block_select(idx, 64) & causal())``, which
  runs on ``blocksparse``'s gathered path (``backends/block_gather.py``; ``explain`` printed).

Printed per length: CPU time per call on one thread (process time: the machine is shared; see
benchmarks/variants.py), forward and forward+backward, the ratio to dense causal SDPA, and the
selection's density beside it (the share of the causal triangle's scores that are computed).
The load average is printed before and after.

    python benchmarks/block_select.py                    # L = 2048, 4096, 8192; k = 4, 8, 16
    python benchmarks/block_select.py --quick            # L = 1024, k = 4: a smoke run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, cpu_ms, machine_state, mh, print_table, write_csv

BS = 64


def selection(B: int, H: int, L: int, k: int, seed: int = 0) -> torch.Tensor:
    """``(B, H, nQ, k)``: each query block's own block and ``k - 1`` distinct earlier ones at random."""
    gen = torch.Generator().manual_seed(seed)
    nQ = -(-L // BS)
    idx = torch.full((B, H, nQ, k), -1, dtype=torch.long)
    for n in range(nQ):
        idx[:, :, n, 0] = n
        if n:
            earlier = torch.rand(B, H, n, generator=gen).argsort(-1)[..., : k - 1]
            idx[:, :, n, 1 : 1 + earlier.shape[-1]] = earlier
    return idx


def run(L: int, ks: list[int], Hkv: int, rounds: int, calls: int) -> list[dict]:
    torch.manual_seed(0)
    B, H, D = 1, 12, 64
    q = torch.randn(B, H, L, D)
    k = torch.randn(B, Hkv, L, D)
    v = torch.randn(B, Hkv, L, D)
    masks = {
        kk: mh.masks.block_select(selection(B, Hkv, L, kk), BS, num_heads=H) & mh.masks.causal(align="top_left")
        for kk in ks
    }
    kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    # correctness on the first 256 queries (top-left causal: the same mask on a slice of the rows)
    for kk, m in masks.items():
        got = mh.attention(q, k, v, mask=m)
        want = mh.attention(q[:, :, :256].double(), k.double(), v.double(), mask=m, backend="reference")
        check_close(f"select k={kk}", got[:, :, :256], want, atol=1e-4)
    check_close(
        "sdpa", F.scaled_dot_product_attention(q, kr, vr, is_causal=True), mh.attention(q, k, v, mask=mh.masks.causal())
    )
    print(mh.explain(q, k, v, mask=masks[ks[-1]]))

    grads = [t.clone().requires_grad_() for t in (q, k, v)]
    gr = [grads[0], grads[1].detach().repeat_interleave(H // Hkv, 1).requires_grad_(), None]
    gr[2] = grads[2].detach().repeat_interleave(H // Hkv, 1).requires_grad_()

    def dense(train):
        def fn():
            if train:
                F.scaled_dot_product_attention(*gr, is_causal=True).sum().backward()
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        return fn

    def selected(m, train):
        def fn():
            if train:
                mh.attention(*grads, mask=m).sum().backward()
            else:
                with torch.no_grad():
                    mh.attention(q, k, v, mask=m)

        return fn

    fns = {("dense causal sdpa", p): dense(p == "forward+backward") for p in ("forward", "forward+backward")}
    for kk, m in masks.items():
        fns |= {(f"select k={kk}", p): selected(m, p == "forward+backward") for p in ("forward", "forward+backward")}
    ms = cpu_ms(fns, rounds, calls)
    nK = -(-L // BS)
    triangle = nK * (nK + 1) / 2  # key blocks the causal triangle touches, summed over query blocks
    rows = []
    for name, p in fns:
        row = {"L": L, "Hkv": Hkv, "contender": name, "pass": p, "cpu ms": ms[(name, p)]}
        row["x dense"] = ms[(name, p)] / ms[("dense causal sdpa", p)]
        if name.startswith("select"):
            kk = int(name.split("=")[1])
            read = sum(min(kk, n + 1) for n in range(nK))
            row["blocks read / causal"] = read / triangle
        else:
            row["blocks read / causal"] = 1.0
        rows.append(row)
    return sorted(rows, key=lambda r: (r["pass"], r["contender"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--k", default="4,8,16", help="blocks read per query block")
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1)
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    lengths = [1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    ks = [4] if args.quick else [int(x) for x in args.k.split(",")]
    rounds = 1 if args.quick else args.rounds
    rows = []
    for L in lengths:
        rows += run(L, ks, args.kv_heads, rounds, args.calls)
        print_table(
            f"block_select & causal, fp32, B=1, Hq=12, Hkv={args.kv_heads}, D=64, L={L}, blocks of {BS}",
            [r for r in rows if r["L"] == L],
        )
    print("after:", machine_state())
    if not args.quick:
        write_csv(f"block_select-hkv{args.kv_heads}", rows)


if __name__ == "__main__":
    main()
