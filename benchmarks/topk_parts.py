"""Where the top-k indexer layer's forward goes: the choice and the attention over the chosen keys,
beside dense causal attention of the same shape, in one process on the same inputs.

``E = 768``, 12 query heads of 64 on 2 KV heads, fp32, ``B = 1``, ``top_k = 1024``, an indexer of
4 heads of 32 (as ``benchmarks/sparse_layers.py``). Rows, CPU time per call on one thread (process
time, the fastest of interleaved rounds after a warm-up call of each):

* ``choice``: ``IndexerCore.choose`` (indexer scores a query chunk at a time, ``best_first``);
* ``chunks``: ``token_selected_attention`` over that choice (the path a plain call runs);
* ``mask``: ``multihead.attention`` under the choice's ``block_select`` mask (each query's keys
  copied beside it: the path before ``layers/token_selection.py``);
* ``dense``: ``multihead.attention(mask=causal())``, what the plain layer runs.

Both selected paths are first checked against each other. The load average is printed before and
after.

    python benchmarks/topk_parts.py                      # L = 4096, 8192
    python benchmarks/topk_parts.py --lengths 16384 --rounds 1
"""

from __future__ import annotations

import argparse

import torch

from common import THREADS, check_close, context, cpu_ms, machine_state, mh, print_table, write_csv
from multihead.layers.token_selection import token_selected_attention

E, H, HKV, D = 768, 12, 2, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    torch.manual_seed(0)
    layer = mh.TopKIndexerAttention(E, H, num_kv_heads=HKV, top_k=1024, index_heads=4, index_dim=32)
    rows = []
    torch.set_num_threads(1)
    for L in (int(s) for s in args.lengths.split(",")):
        x = torch.randn(1, L, E)
        q, k, v = torch.randn(1, H, L, D), torch.randn(1, HKV, L, D), torch.randn(1, HKV, L, D)
        with torch.no_grad():
            core, _ = layer._heads(x)
            chosen = core.choose(L, L)
            mask = core.mask(L, L)
            check_close("chunks vs mask", token_selected_attention(q, k, v, chosen), mh.attention(q, k, v, mask=mask))
            fns = {
                "choice": lambda: core.choose(L, L),
                "chunks": lambda: token_selected_attention(q, k, v, chosen),
                "mask": lambda: mh.attention(q, k, v, mask=mask),
                "dense": lambda: mh.attention(q, k, v, mask=mh.masks.causal()),
            }
            best = cpu_ms(fns, args.rounds)  # after a warm-up call of each: first calls allocate and plan
        these = [{"L": L, "part": key, "cpu ms": ms, "x dense": ms / best["dense"]} for key, ms in best.items()]
        print_table(f"top-k indexer parts, fp32, Hq={H}, Hkv={HKV}, D={D}, top_k=1024, B=1, L={L}", these)
        rows += these
    torch.set_num_threads(THREADS)
    print("after:", machine_state())
    write_csv("topk_parts", rows)


if __name__ == "__main__":
    main()
