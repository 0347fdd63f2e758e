"""How a ``block_select`` mask runs on ``blocksparse``: copied per query block
(:mod:`multihead.backends.block_gather`) or key-major (:mod:`multihead.backends.key_major`), and
what ``explain()`` says of it.

A query block holding fewer rows (its query heads x queries) than a key block has keys (a
selection per query token: NSA, MoBA, a top-k indexer) runs key-major: copying each query block's
key blocks would move more than copying each key block's queries.
"""

from __future__ import annotations

from torch import Tensor

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
    if prefers_key_major(selection, q.shape[1], k.shape[1]):
        return key_major_attention(q, k, v, selection, scale)
    return gathered_attention(q, k, v, selection, scale)


def selected_plan(selection: Selection, shape: tuple[int, ...]) -> list[str]:
    """What ``explain()`` says of a call ``(B, Hq, Hkv, Lq, Lk, D, Dv)`` run here: the units, the
    selection's density, the rest of the mask."""
    B, Hq, Hkv, Lq, Lk = shape[:5]
    He, Gp, _, _ = selection.units(Hq, Hkv)
    per_block, blocks = selection.density(Lq, Lk)
    sel, rest = selection.select, selection.rest
    if prefers_key_major(selection, Hq, Hkv):
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
        "PyTorch kernel: aten._scaled_dot_product_flash_attention_for_cpu over the gathered keys, "
        "query blocks folded into the batch",
    ]
