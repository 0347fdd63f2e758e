"""A small causal LM trained on CPU with each attention variant: loss curves for docs/variants.md.

The model is :class:`multihead.models.decoder.CausalDecoder` (``d_model=64``, 2 layers, 4 heads,
learned positions) with the attention of every block swapped for the variant:

* ``plain``: :class:`multihead.MultiHeadAttention` (4 heads of 16), the decoder's own;
* ``gated elementwise`` / ``gated headwise``: :class:`multihead.GatedAttention` (4 heads);
* ``differential``: :class:`multihead.DifferentialAttention` with 2 heads of 32 (the paper halves
  the heads), ``depth`` = the block's index from 1;
* ``moba``: :class:`multihead.MixtureOfBlockAttention`, blocks of 8, 3 read per query;
* ``nsa``: :class:`multihead.NativeSparseAttention`, compressed blocks of 4 every 2 keys, 3
  selected blocks of 8, a window of 8 (too short for the task: the other branches must look back);
* ``topk``: :class:`multihead.TopKIndexerAttention`, 8 keys per query, its indexer trained by its
  KL loss (:meth:`~multihead.TopKIndexerAttention.indexer_loss`, added to the task's loss).

The task needs attention: each sequence is 24 random tokens (vocabulary 16) then the same 24
again, and the loss is the cross-entropy of the second half, which only a head that looks back
24 tokens can bring below ``ln 16``. Every variant starts from the same seed, sees the same
batches (32 sequences a step) and trains with AdamW (lr 3e-3) for ``--steps`` steps, on one thread. Printed:
the loss every 25 steps (the mean of the last 25) and the wall time of each run; written: a CSV
and, with ``--update-docs``, ``docs/img/variants_training.png``.

    python benchmarks/variants_training.py                  # 300 steps, plot in benchmarks/results/
    python benchmarks/variants_training.py --update-docs    # the figure of docs/variants.md
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from common import context, machine_state, mh, plot, print_table, write_csv
from multihead.models.decoder import CausalDecoder, DecoderConfig

VOCAB, HALF, BATCH, E, HEADS, LAYERS = 16, 24, 32, 64, 4, 2


def variant(name: str, depth: int) -> torch.nn.Module:
    if name == "plain":
        return mh.MultiHeadAttention(E, HEADS, causal=True)
    if name == "gated elementwise":
        return mh.GatedAttention(E, HEADS, causal=True)
    if name == "gated headwise":
        return mh.GatedAttention(E, HEADS, gate="headwise", causal=True)
    if name == "moba":
        return mh.MixtureOfBlockAttention(E, HEADS, block_size=8, top_k=3)
    if name == "nsa":
        return mh.NativeSparseAttention(
            E, HEADS, compress_block=4, compress_stride=2, select_block=8, select_count=3, window=8
        )
    if name == "topk":
        return mh.TopKIndexerAttention(E, HEADS, top_k=8, index_heads=2, index_dim=16)
    return mh.DifferentialAttention(E, HEADS // 2, causal=True, depth=depth)


NAMES = ["plain", "gated elementwise", "gated headwise", "differential", "moba", "nsa", "topk"]


def indexer_inputs(model: CausalDecoder) -> list:
    """``(layer, [its last input])`` of every top-k layer: the indexer's loss reads the input."""
    seen = []
    for block in model.blocks:
        if isinstance(block.attn, mh.TopKIndexerAttention):
            box: list = []
            block.attn.register_forward_pre_hook(lambda mod, args, box=box: box.__setitem__(slice(None), [args[0]]))
            seen.append((block.attn, box))
    return seen


def model_with(name: str) -> CausalDecoder:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, max_len=2 * HALF, d_model=E, num_layers=LAYERS, num_heads=HEADS)
    model = CausalDecoder(config)
    for i, block in enumerate(model.blocks):
        block.attn = variant(name, depth=i + 1)
    return model


def batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        first = torch.randint(0, VOCAB, (BATCH, HALF), generator=gen)
        yield torch.cat([first, first], dim=1)  # (B, 2·HALF): the second half repeats the first


def train(name: str, steps: int, every: int) -> tuple[list[int], list[float], float]:
    model = model_with(name)
    indexers = indexer_inputs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, xs, ys = [], [], []
    start = time.perf_counter()
    for step, ids in enumerate(batches(steps), start=1):
        logits = model(ids[:, :-1])  # (B, L - 1, V): position t predicts token t + 1
        second = logits[:, HALF - 1 :]  # the predictions of the repeated half
        loss = F.cross_entropy(second.reshape(-1, VOCAB), ids[:, HALF:].reshape(-1))
        # the indexers' KL losses train the indexers only (their input is detached)
        extra = sum((layer.indexer_loss(box[0]) for layer, box in indexers), torch.zeros(()))
        opt.zero_grad()
        (loss + extra).backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % every == 0:
            xs.append(step)
            ys.append(sum(losses[-every:]) / every)
    return xs, ys, time.perf_counter() - start


def main() -> None:
    # One thread: the model is tiny, and a second OpenMP thread on a shared machine spins for
    # work between the many small ops instead of doing it.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--update-docs", action="store_true", help="write docs/img/variants_training.png")
    parser.add_argument("--variants", help=f"comma-separated, of {NAMES} (default: all)")
    args = parser.parse_args()
    print(context())
    print("before:", machine_state())
    every = 25
    names = args.variants.split(",") if args.variants else NAMES
    series, rows = {}, []
    for name in names:
        xs, ys, seconds = train(name, args.steps, every)
        series[name] = (xs, ys)
        rows.append({"variant": name, "first loss": ys[0], "final loss": ys[-1], "s": seconds})
        print(f"{name}: " + ", ".join(f"{x}: {y:.3f}" for x, y in zip(xs, ys)), flush=True)
    print_table(f"copy task, {args.steps} steps (ln {VOCAB} = {math.log(VOCAB):.3f} is chance)", rows)
    print("after:", machine_state())
    curves = [{"variant": n, "step": x, "loss": y} for n, (xs, ys) in series.items() for x, y in zip(xs, ys)]
    write_csv("variants_training", curves)
    plot(
        "variants_training",
        f"CausalDecoder (E={E}, {LAYERS} layers) on a copy task: training loss",
        "training step",
        f"cross-entropy of the repeated half (mean of {every} steps)",
        series,
        logx=False,
        logy=False,
        update_docs=args.update_docs,
    )


if __name__ == "__main__":
    main()
