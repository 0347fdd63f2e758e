"""A scale model of context parallelism on 8-1024 GPUs: ring, Ulysses and the 2-D mesh per layer.

Nothing here runs on a GPU: the bytes each rank sends are the formulas of
:mod:`multihead.distributed.cost` (checked equal to the bytes measured through ``torch.distributed``
in worlds of 2, 3, 4 and 8 processes: ``tests/distributed/dist_checks_traffic.py``), and the times
follow from stated assumptions (``--help``; the defaults below):

* nodes of ``G = 8`` GPUs; NVLink inside a node at ``W_in`` = 450 GB/s per GPU each way,
  InfiniBand across nodes at ``W_out`` = 50 GB/s per GPU (one 400 Gb/s NIC per GPU);
* attention at ``F`` = 400 TFLOP/s (H100, bf16, sustained), the FlashAttention count
  ``4·B·Hq·L²·D`` halved for a causal mask, the backward 2.5x the forward;
* ``alpha`` = 10 us of latency per message step (a ring step, an all-to-all), which matters only
  when shards are a few tokens long;
* a Llama-3-8B-like layer: ``Hq = 32``, ``Hkv = 8``, ``D = Dv = 128``, ``B = 1``, bf16 (``b = 2``;
  the ring returns key gradients in fp32, ``b_acc = 4``), causal, balanced (zigzag).

Per layer and rank, forward then backward (the backward moves what ``cost`` says it does):

* **ring** over ``P`` ranks: ``P`` steps, each computing ``1/P`` of the rank's work while the next
  K/V shard arrives, so a step takes ``max(compute/P, shard/W)``; from ``P > G`` a step's messages
  cross nodes and ``W = W_out``;
* **Ulysses** over ``P``: the all-to-alls are not overlapped: ``sent·(G-1)/(P-1)`` of a rank's bytes
  stay in its node, the rest cross it, at ``max(inside/W_in, across/W_out)``; it needs ``P <= Hq``
  and ``Hkv`` dividing ``P`` or ``P`` dividing ``Hkv``;
* **2-D**: Ulysses over the ``U = G`` GPUs of a node (NVLink), the ring over the ``R = P/G`` nodes
  (InfiniBand), the ring's shards ``U`` times shorter in heads and longer in positions.

``efficiency`` = the compute alone (``P`` ranks perfectly parallel) / the modelled time. Prints the
table of ``docs/distributed.md`` and writes ``benchmarks/results/scale_model.csv``; with
``--update-docs`` also ``docs/img/scale_model.png``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import IMAGES, print_table, write_csv  # noqa: E402
from multihead.distributed.cost import hybrid_traffic, ring_traffic, ulysses_traffic  # noqa: E402

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
LENGTHS = (32 * 1024, 128 * 1024, 1024 * 1024, 4 * 1024 * 1024)


def model(args, P: int, L: int) -> dict:
    """Seconds per layer (forward + backward) of each layout at ``P`` GPUs and length ``L``."""
    B, Hq, Hkv, D, G = 1, args.heads, args.kv_heads, args.head_dim, args.node
    b, b_acc = 2, 4
    S = L // P
    forward = 4 * B * Hq * L * L * D / 2 / P / args.flops  # causal, balanced: a rank's share
    compute = 3.5 * forward  # forward + backward (2.5x)
    out = {"P": P, "L": f"{L // 1024}k", "compute_ms": 1e3 * compute}

    def ring(R, traffic, W):
        # R steps each side; a step hides its message when its share of compute is longer.
        a = args.latency
        fwd = forward / R + (R - 1) * max(forward / R, a + traffic.forward_outer / max(R - 1, 1) / W)
        bwd = 2.5 * forward / R + (R - 1) * max(2.5 * forward / R, a + traffic.backward_outer / max(R - 1, 1) / W)
        return fwd + bwd

    def exchange(sent, ranks):  # four all-to-alls (q, k, v, out; their gradients in the backward)
        inside = sent * (min(G, ranks) - 1) / (ranks - 1)
        return 4 * args.latency + max(inside / args.nvlink, (sent - inside) / args.infiniband)

    t = ring_traffic(B=B, Hkv=Hkv, S=S, D=D, Dv=D, P=P, b=b, b_acc=b_acc)
    out["ring_ms"] = 1e3 * ring(P, t, args.nvlink if P <= G else args.infiniband)
    out["ring_sent_mib"] = (t.forward + t.backward) / 2**20
    if P <= Hq and (P % Hkv == 0 or Hkv % P == 0):
        t = ulysses_traffic(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, Dv=D, P=P, b=b)
        out["ulysses_ms"] = 1e3 * (compute + exchange(t.forward, P) + exchange(t.backward, P))
        out["ulysses_sent_mib"] = (t.forward + t.backward) / 2**20
    U = min(G, P)
    R = P // U
    t = hybrid_traffic(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, Dv=D, R=R, U=U, b=b, b_acc=b_acc)
    inner = exchange(t.forward_inner, U) + exchange(t.backward_inner, U) if U > 1 else 0.0
    out["2d_ms"] = 1e3 * (inner + (ring(R, t, args.infiniband) if R > 1 else compute))
    out["2d_sent_mib"] = (t.forward + t.backward) / 2**20
    out["2d_across_mib"] = (t.forward_outer + t.backward_outer) / 2**20
    times = {k[:-3]: v for k, v in out.items() if k in ("ring_ms", "ulysses_ms", "2d_ms")}
    out["winner"] = min(times, key=lambda k: times[k])
    for k, v in times.items():
        out[f"{k}_eff"] = 1e3 * compute / v
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(dict.fromkeys(r["L"] for r in rows))
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.6), sharey=True)
    for ax, L in zip(axes, lengths):
        sub = [r for r in rows if r["L"] == L]
        for key, label in (
            ("ring_eff", "ring"),
            ("ulysses_eff", "Ulysses"),
            ("2d_eff", "2-D (Ulysses in node, ring across)"),
        ):
            pts = [(r["P"], r[key]) for r in sub if r[key] != ""]
            ax.plot([p for p, _ in pts], [e for _, e in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"L = {L} tokens")
        ax.set_xlabel("GPUs (P)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency: compute / modelled time")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Context parallelism per layer, modelled (H100 400 TFLOP/s, NVLink 450 GB/s, IB 50 GB/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flops", type=float, default=400e12, help="attention FLOP/s per GPU (400e12)")
    parser.add_argument("--nvlink", type=float, default=450e9, help="bytes/s per GPU inside a node (450e9)")
    parser.add_argument("--infiniband", type=float, default=50e9, help="bytes/s per GPU across nodes (50e9)")
    parser.add_argument("--latency", type=float, default=10e-6, help="seconds per message step (10e-6)")
    parser.add_argument("--node", type=int, default=8, help="GPUs per node (8)")
    parser.add_argument("--heads", type=int, default=32, help="Hq (32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="Hkv (8)")
    parser.add_argument("--head-dim", type=int, default=128, help="D = Dv (128)")
    parser.add_argument("--update-docs", action="store_true", help="write docs/img/scale_model.png")
    args = parser.parse_args()
    rows = [model(args, P, L) for L in LENGTHS for P in WORLDS]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: r.get(k, "") for k in keys} for r in rows]  # Ulysses has no row beyond Hq GPUs
    print_table("context parallelism per layer, forward + backward, modelled (ms; eff = compute / time)", rows)
    write_csv("scale_model", rows)
    if args.update_docs:
        plot(rows, IMAGES / "scale_model.png")


if __name__ == "__main__":
    main()
