"""Training a small causal LM with FSDP2 and context parallelism, checked against one process.

    torchrun --nproc-per-node 4 examples/fsdp_context_parallel.py              # 2 x 2 mesh, gloo
    torchrun --nproc-per-node 4 examples/fsdp_context_parallel.py --dp 1 --cp 4 --steps 5
    torchrun --nproc-per-node 4 examples/fsdp_context_parallel.py --dp 1 --cp 4 --method hybrid --ulysses 2 --sinks

The ranks form a ``DeviceMesh`` of ``(dp, cp)``: ``dp`` splits the batch, ``cp`` splits each
sequence (zigzag layout), so rank ``(d, c)`` holds batch rows ``d`` of ``dp`` and sequence shard
``c`` of ``cp``. The model's attention layers are :class:`multihead.MultiHeadAttention` with
``context_parallel=ContextParallel(group=<the cp group>)``: projections, norms and MLPs run on the
shard, RoPE turns at the global positions and attention goes round the ring of the ``cp`` group.
``fully_shard`` (FSDP2) shards every block's parameters over the ``cp`` dimension and replicates
them over ``dp`` (HSDP on the 2-D mesh); its gradient reduction averages over all ``P`` ranks.
``--method ulysses`` attends by all-to-all instead; ``--method hybrid --ulysses U`` splits the
``cp`` ranks once more into a 2-D context-parallel mesh of ``cp/U`` ring ranks by ``U`` Ulysses
ranks (:func:`multihead.distributed.hybrid_attention`), whose groups are made inside each ``cp``
group. ``--sinks``: attention sinks in every layer (trainable, sharded by FSDP like any weight).

Each rank's loss is its tokens' summed cross-entropy times ``P / N`` (``N``: target tokens of the
whole batch), so the average FSDP takes is the gradient of the whole batch's mean loss, although
the ranks hold different numbers of targets (the last position has none). Every rank also trains
the same model in one process on the whole batch (the reference, fp64 like the sharded one) and
checks, step by step: the loss, every parameter's gradient (the FSDP shards gathered) and the
parameters after the optimizer step. With ``--check`` off it only trains and prints.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import multihead as mh  # noqa: E402
from multihead.distributed import ContextParallel, Mesh2D  # noqa: E402
from multihead.positions import RotaryEmbedding  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: GQA attention with RoPE, then an MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, cp: ContextParallel | None, sinks: bool = False):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = mh.MultiHeadAttention(
            dim,
            heads,
            num_kv_heads=kv_heads,
            causal=True,
            rope=RotaryEmbedding(dim // heads),
            sinks=sinks,
            context_parallel=cp,
        )
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # (B, S, E): a whole sequence, or this rank's shard of it
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, ``layers`` blocks, a final norm and an untied head; ``cp=None``: one process."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        heads: int,
        kv_heads: int,
        layers: int,
        cp: ContextParallel | None,
        sinks: bool = False,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, cp, sinks) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):  # (B, S) -> logits (B, S, vocab)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(steps: int, size: int, length: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``(ids, targets)``, ``(size, length)`` each: counting sequences
    ``start, start + 1, ...`` (mod ``vocab``) from random starts, something a few steps learn;
    targets are the next ids, ``-100`` (ignored) at the last position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.randint(vocab, (size, 1), generator=g) + torch.arange(length)) % vocab
        targets = torch.cat([ids[:, 1:], torch.full((size, 1), -100)], dim=1)
        out.append((ids, targets))
    return out


def context_of(mesh, method: str, ulysses: int) -> ContextParallel:
    """This rank's :class:`ContextParallel` over the ``cp`` dimension of ``mesh``: the ``cp`` group
    itself (ring or Ulysses), or a 2-D mesh of ``cp/ulysses`` ring ranks by ``ulysses`` Ulysses
    ranks inside it (cp rank ``r·ulysses + u``). Every rank creates every group, in the same order:
    ``new_group`` is collective over the world."""
    if method != "hybrid":
        return ContextParallel(group=mesh.get_group("cp"), layout="zigzag", method=method)
    dp, cp = mesh.shape
    if cp % ulysses:
        raise ValueError(f"train: ulysses={ulysses} does not divide cp={cp}")
    R, me = cp // ulysses, dist.get_rank()
    ranks = mesh.mesh.tolist()  # ranks[d][c]: global rank of mesh coordinate (d, c)
    ring = ulysses_group = None
    for d in range(dp):
        for u in range(ulysses):
            members = [ranks[d][r * ulysses + u] for r in range(R)]
            group = dist.new_group(members)
            ring = group if me in members else ring
        for r in range(R):
            members = [ranks[d][r * ulysses + u] for u in range(ulysses)]
            group = dist.new_group(members)
            ulysses_group = group if me in members else ulysses_group
    return ContextParallel(group=Mesh2D(ring, ulysses_group), layout="zigzag", method="hybrid")


def train(
    *,
    dp: int,
    cp: int,
    steps: int = 3,
    batch_size: int = 4,
    length: int = 24,
    check: bool = True,
    method: str = "ring",
    ulysses: int = 1,
    sinks: bool = False,
) -> list[float]:
    """Train on this rank of an initialised ``dp·cp`` world; returns the whole batch's loss per
    step (the same on every rank). With ``check``, raises if a loss, a gradient or a parameter
    differs from one process training on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"train: dp x cp = {dp} x {cp} = {dp * cp} but the world has {world} ranks")
    if batch_size % dp:
        raise ValueError(f"train: batch_size={batch_size} does not split over dp={dp} ranks")
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    d, c = mesh.get_coordinate()
    context = context_of(mesh, method, ulysses)
    vocab, dim = 64, 32
    torch.manual_seed(0)  # the same initial weights on every rank, and in the reference
    model = TinyLM(vocab, dim, heads=4, kv_heads=2, layers=2, cp=context, sinks=sinks).double()
    reference = TinyLM(vocab, dim, heads=4, kv_heads=2, layers=2, cp=None, sinks=sinks).double()
    if sinks:  # sinks start at 0; spread them so that each head's own sink is checked
        with torch.no_grad():
            for block in model.blocks:
                block.attn.sinks.copy_(torch.linspace(-1.0, 1.0, 4))
    reference.load_state_dict(model.state_dict())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # 2-D mesh: replicated over dp, sharded over cp
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    losses = []
    rows = slice(d * batch_size // dp, (d + 1) * batch_size // dp)
    for step, (ids, targets) in enumerate(batch(steps, batch_size, length, vocab)):
        n_targets = int((targets != -100).sum())  # N: the whole batch's target tokens
        local_ids, local_targets = (context.shard(t[rows], dim=1) for t in (ids, targets))  # (B/dp, L/cp)
        logits = model(local_ids)  # (B/dp, L/cp, vocab): this rank's rows and positions
        summed = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), ignore_index=-100, reduction="sum")
        (summed * world / n_targets).backward()  # FSDP averages over the world: the mean's gradient
        total = summed.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n_targets)
        if check:
            ref_loss = F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
            ref_loss.backward()
            torch.testing.assert_close(total / n_targets, ref_loss.detach(), msg=lambda m: f"step {step} loss: {m}")
            for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(
                    p.grad.full_tensor(), ref.grad, msg=lambda m: f"step {step} gradient of {name}: {m}"
                )
        optimizer.step()
        optimizer.zero_grad()
        if check:
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(
                    p.full_tensor(), ref.detach(), msg=lambda m: f"step {step} parameter {name}: {m}"
                )
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}" + (f" (one process: {ref_loss.item():.6f})" if check else ""))
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (splits the batch)")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (splits each sequence)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=24, help="sequence length (a multiple of 2·cp)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--method", choices=("ring", "ulysses", "hybrid"), default="ring")
    parser.add_argument("--ulysses", type=int, default=1, help="with --method hybrid: Ulysses ranks per ring rank")
    parser.add_argument("--sinks", action="store_true", help="attention sinks in every layer")
    parser.add_argument("--no-check", action="store_true", help="skip the one-process comparison")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # torchrun sets the environment
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        train(
            dp=args.dp,
            cp=args.cp,
            steps=args.steps,
            batch_size=args.batch_size,
            length=args.length,
            check=not args.no_check,
            method=args.method,
            ulysses=args.ulysses,
            sinks=args.sinks,
        )
        if dist.get_rank() == 0 and not args.no_check:
            print("losses, gradients and parameters equal one process at every step")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
