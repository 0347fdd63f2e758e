"""How a ``block_select`` mask runs on ``blocksparse``: through multihead's CPU kernel
(:mod:`multihead.backends.cpu_sparse`) where it takes the call, else copied per query block
(:mod:`multihead.backends.block_gather`) or key-major (:mod:`multihead.backends.key_major`), and
what ``explain()`` says of it.

A query block holding fewer rows (its query heads x queries) than a key block has keys (a
selection per query token: NSA, MoBA, a top-k indexer) runs key-major: copying each query block's
key blocks would move more than copying each key block's queries.
"""

from __future__ import annotations

from torch import Tensor

from multihead.backends import cpu_sparse
from multihead.backends.block_gather import Selection, gathered_attention, selection_of
from multihead.backends.key_major import key_major_attention

__all__ = ["selection_of", "selected_attention", "selected_plan", "prefers_key_major"]


def prefers_key_major(selection: Selection, Hq: int, Hkv: int) -> bool:
    """Whether a query block holds fewer rows than a key block has keys."""
    _, Gp, _, _ = selection.units(Hq, Hkv)
    return Gp * selection.select.query_block_size < selection.select.block_size


def selected_attention(q: Tensor, k: Tensor, v: Tensor, selection: Selection, scale: float) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hq, Lq, E)`` and LSE ``(B, Hq, Lq)`` under the selection's mask, one head size
    ``E`` (the caller pads); differentiable in ``q, k, v``."""
    if cpu_sparse.supports(q, k, v, selection):
        return cpu_sparse.sparse_attention(q, k, v, selection, scale)
    if prefers_key_major(selection, q.shape[1], k.shape[1]):
        return key_major_attention(q, k, v, selection, scale)
    return gathered_attention(q, k, v, selection, scale)


def selected_plan(selection: Selection, q: Tensor, k: Tensor, v: Tensor) -> list[str]:
    """What ``explain()`` says of a call ``q (B, Hq, Lq, D)``, ``k, v (B, Hkv, Lk, D|Dv)`` run
    here: the units, the selection's density, the rest of the mask, the kernel."""
    B, Hq, Lq = q.shape[:3]
    Hkv, Lk = k.shape[1], k.shape[2]
    He, Gp, _, _ = selection.units(Hq, Hkv)
    per_block, blocks = selection.density(Lq, Lk)
    sel, rest = selection.select, selection.rest
    native = cpu_sparse.supports(q, k, v, selection)
    if native:
        how = "query-major: each selected key block read once for the rows of a tile that chose it (cpu_sparse.c)"
    elif prefers_key_major(selection, Hq, Hkv):
        how = "key-major: each selected key block read once for the query rows that chose it, in tiles (key_major.py)"
    else:
        how = "gathered: each query block's selected key blocks copied beside it (block_gather.py)"
    return [
        f"block selection: each of {B}x{He} units ({Gp} query head(s) sharing a row and a KV head) x "
        f"{-(-Lq // sel.query_block_size)} query blocks of {sel.query_block_size} reads only its selected "
        f"key blocks, {how}",
        f"selection density: {per_block:.2f} of {blocks} key blocks of {sel.block_size} per query block "
        f"({100.0 * per_block / max(1, blocks):.1f}%)",
        "no other mask" if rest is None else f"the rest of the mask, {rest._describe()}, read at the gathered keys",
        "kernel: multihead's CPU sparse kernel (cpu_sparse.c, built for this CPU): register tiles of 4 rows x 64 "
        "keys, online softmax in fp32, forward and backward"
        if native
        else "PyTorch kernel: aten._scaled_dot_product_flash_attention_for_cpu over the gathered keys, "
        f"query blocks folded into the batch (the CPU sparse kernel: {_refusal(q, k, v, selection)})",
    ]


def _refusal(q: Tensor, k: Tensor, v: Tensor, selection: Selection) -> str:
    """Why :mod:`~multihead.backends.cpu_sparse` does not take the call."""
    if q.device.type == "cpu" and (why := cpu_sparse.unavailable()) is not None:
        return why
    return "it takes fp32 CPU tensors, head sizes and block sizes multiples of 16, causal() or no other mask"
