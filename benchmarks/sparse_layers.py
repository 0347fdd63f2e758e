"""The trainable sparse layers against the plain layer as the sequence grows: NSA, MoBA and top-k
indexer attention, causal, fp32, in one process on the same input.

``E = 768``, 12 query heads of 64 sharing 2 KV heads (GQA) for every contender:

* ``plain``: :class:`multihead.MultiHeadAttention` (dense causal attention, the fused kernel);
* ``nsa``: :class:`multihead.NativeSparseAttention` with the paper's sizes: compressed blocks of
  32 every 16 keys, 16 selected blocks of 64, a window of 512 (``--nsa`` to change);
* ``moba``: :class:`multihead.MixtureOfBlockAttention`, blocks of 64, 16 read per query;
* ``topk``: :class:`multihead.TopKIndexerAttention`, 1024 keys per query (as many as NSA's
  selected branch), an indexer of 4 heads of 32 (chunks of queries against the keys they chose,
  ``layers/token_selection.py``);
* ``topk-mask``: the same layer with ``backend="blocksparse"``: its ``block_select`` mask, each
  query's keys copied beside it (the path before ``token_selection.py``).

Each contender is first checked against a float64 copy of itself at ``L = 256``. Printed per
length: CPU time per call on one thread (process time; the machine is shared: see
benchmarks/variants.py), forward and forward+backward, the ratio to the plain layer, and the time
per token. The load average is printed before and after.

    python benchmarks/sparse_layers.py                    # L = 4096, 8192, 16384
    python benchmarks/sparse_layers.py --lengths 2048 --rounds 1
    python benchmarks/sparse_layers.py --lengths 16384 --layers nsa,moba    # without the top-k layer
"""

from __future__ import annotations

import argparse

import torch

from common import check_layers, context, cpu_ms, layer_passes, machine_state, mh, print_table, write_csv

E, H, HKV = 768, 12, 2


def contenders() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    topk = mh.TopKIndexerAttention(E, H, num_kv_heads=HKV, top_k=1024, index_heads=4, index_dim=32)
    # the same layer run on the block_select mask (each query's keys copied: the path before
    # token_selection.py), which a named backend keeps
    mask_path = mh.TopKIndexerAttention(
        E, H, num_kv_heads=HKV, top_k=1024, index_heads=4, index_dim=32, backend="blocksparse"
    )
    mask_path.load_state_dict(topk.state_dict())
    return {
        "plain": mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=True),
        "nsa": mh.NativeSparseAttention(
            E, H, num_kv_heads=HKV, compress_block=32, compress_stride=16, select_block=64, select_count=16, window=512
        ),
        "moba": mh.MixtureOfBlockAttention(E, H, num_kv_heads=HKV, block_size=64, top_k=16),
        "topk": topk,
        "topk-mask": mask_path,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument(
        "--layers", default="plain,nsa,moba,topk,topk-mask", help="which contenders (plain always runs)"
    )
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    wanted = {"plain", *args.layers.split(",")}
    layers = {name: layer for name, layer in contenders().items() if name in wanted}
    check_layers(layers, torch.randn(1, 256, E))
    rows = []
    for L in (int(s) for s in args.lengths.split(",")):
        fns = layer_passes(layers, torch.randn(1, L, E), backward=not args.forward_only)
        ms = cpu_ms(fns, args.rounds)
        these = []
        for name, kind in fns:
            these.append(
                {
                    "L": L,
                    "layer": name,
                    "pass": kind,
                    "cpu ms": ms[(name, kind)],
                    "x plain": ms[(name, kind)] / ms[("plain", kind)],
                    "us per token": ms[(name, kind)] * 1e3 / L,
                }
            )
        these.sort(key=lambda r: (r["pass"], list(layers).index(r["layer"])))
        print_table(f"causal self-attention layer, fp32, E={E}, Hq={H}, Hkv={HKV}, B=1, L={L}", these)
        rows += these
    print("after:", machine_state())
    write_csv("sparse_layers", rows)


if __name__ == "__main__":
    main()
