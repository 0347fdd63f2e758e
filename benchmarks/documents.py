"""Packed documents: 8 documents of mixed lengths packed in one 8192-token sequence
(``document(ids) & causal()``, auto -> blocksparse) vs the usual alternative, a padded batch of
8 rows with SDPA and a dense (causal & key-padding) mask. H=8, D=64, fp32 forward.
``--quick``: the same shape (it is one configuration), shorter timing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import check_close, context, mh, print_table, time_ms, used_backend, write_csv

LENGTHS = [2048, 1536, 1280, 1024, 896, 640, 512, 256]  # sums to 8192
#: Where each document starts in the packed sequence.
STARTS = torch.tensor([0] + LENGTHS[:-1]).cumsum(0).tolist()


def padded_batch(q, k, v):
    """The padded equivalent of packed ``(1, H, total, D)`` inputs: one row per document, padded to
    the longest, ``(n, H, Lmax, D)`` each, and the dense bool mask (causal & key padding) SDPA takes."""
    n, Lmax = len(LENGTHS), max(LENGTHS)

    def pad(x):
        out = x.new_zeros(n, x.shape[1], Lmax, x.shape[3])
        for i, (s, length) in enumerate(zip(STARTS, LENGTHS)):
            out[i, :, :length] = x[0, :, s : s + length]
        return out

    lengths = torch.tensor(LENGTHS)
    dense = (mh.causal() & mh.key_padding(lengths)).materialize(n, q.shape[1], Lmax, Lmax)  # (n, 1, Lmax, Lmax)
    # Padding query rows see no key; SDPA needs one visible key per row to stay finite.
    dense = dense | (torch.arange(Lmax).view(1, 1, -1, 1) >= lengths.view(-1, 1, 1, 1))
    return pad(q), pad(k), pad(v), dense


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(f"# packed documents  ({context()})")
    H, D, total, n = 8, 64, sum(LENGTHS), len(LENGTHS)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, total, D, generator=gen) for _ in range(3))
    ids = torch.repeat_interleave(torch.arange(n), torch.tensor(LENGTHS))
    mask = mh.document(ids) & mh.causal()
    packed = lambda: mh.attention(q, k, v, mask=mask)  # noqa: E731

    qp, kp, vp, dense = padded_batch(q, k, v)  # the padded equivalent, one row per document
    padded = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=dense)  # noqa: E731

    out_packed, out_padded = packed(), padded()
    for i, (s, length) in enumerate(zip(STARTS, LENGTHS)):
        check_close(f"document {i}", out_packed[0, :, s : s + length], out_padded[i, :, :length])
    mrt = 0.5 if args.quick else 2.0
    t_packed, t_padded = time_ms(packed, mrt), time_ms(padded, mrt)
    row = {
        "docs": n,
        "tokens": total,
        "backend": used_backend(q, k, v, mask=mask),
        "packed_multihead_ms": t_packed,
        "padded_sdpa_dense_mask_ms": t_padded,
        "speedup": t_padded / t_packed,
    }
    print_table("packed documents vs padded batch + dense mask", [row])
    write_csv("documents" + ("_quick" if args.quick else ""), [row])
    return [row]


if __name__ == "__main__":
    main()
