"""Input checks for sharded attention, run on every rank *before* any other communication.

A bad input on one rank must not leave the other ranks waiting forever in a send or an
all-to-all. So each rank checks its own arguments, catches its own error, and then every rank
takes part in one small ``all_gather_object`` of ``(error, summary)``: if any rank failed, or
the ranks disagree (:func:`call_summary`: shapes, dtype, which of q, k, v need gradients, layout,
the mask and score modifier by content, scale...), every rank raises, naming the rank and the argument. Only a
process that never calls the function at all can still hang the others; the process group's
``timeout`` bounds that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from multihead.blocks import Extent
from multihead.distributed.fingerprint import mask_fingerprint, tensor_fingerprint
from multihead.distributed.layout import Layout, check_layout
from multihead.inputs import check_tensor
from multihead.masks import Mask
from multihead.masks.tensor import as_mask
from multihead.scores import Chain, ScoreMod, as_score_mod
from multihead.scores import softcap as softcap_mod
from multihead.sinks import check_sinks

__all__ = [
    "Shards",
    "check_group",
    "check_qkv",
    "check_mask",
    "check_score_mod",
    "check_scale",
    "check_call",
    "Checked",
    "call_summary",
    "agree",
    "agree_mesh",
]


@dataclass(frozen=True)
class Shards:
    """The shapes of one sharded call: every rank holds ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``,
    ``v (B, Hkv, Sk, Dv)`` of a whole attention of ``Lq = P·Sq`` by ``Lk = P·Sk``."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    world: int

    @property
    def Lq(self) -> int:
        return self.Sq * self.world

    @property
    def Lk(self) -> int:
        return self.Sk * self.world


def check_group(group, where: str) -> tuple[int, int]:
    """``(P, rank)`` of this process in ``group``; raises at once (no communication) if there is
    no process group or this process is not in it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{where}: this process (global rank {dist.get_rank()}) is not a member of group; "
            "call it only on the ranks of the group that shares the sequence"
        )
    return dist.get_world_size(group), rank


def check_qkv(where: str, q, k, v, world: int) -> Shards:
    for name, t, layout in (("q", q, "(B, Hq, Sq, D)"), ("k", k, "(B, Hkv, Sk, D)"), ("v", v, "(B, Hkv, Sk, Dv)")):
        check_tensor(name, t, f"{layout} (this rank's shard)", where=where)
        if t.dim() != 4:
            raise ValueError(
                f"{where}: {name} must have 4 dims {layout} (this rank's shard of the sequence), "
                f"got shape {tuple(t.shape)}"
            )
        if 0 in t.shape:
            raise ValueError(
                f"{where}: {name} has a zero-size dimension: shape {tuple(t.shape)}; expected every "
                "dimension >= 1 (each rank holds at least one token)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{where}: q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"{where}: batch sizes differ: q has B={B}, k has {k.shape[0]}, v has {v.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"{where}: head dims differ: q has D={D} but k has D={k.shape[3]}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(
            f"{where}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; expected "
            f"v (B, Hkv, Sk, Dv) = ({B}, {Hkv}, {Sk}, Dv)"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"{where}: q has Hq={Hq} heads, not divisible by Hkv={Hkv}; Hkv must divide Hq "
            f"(one of {[h for h in range(1, Hq + 1) if Hq % h == 0]})"
        )
    return Shards(B, Hq, Hkv, Sq, Sk, D, v.shape[3], world)


def check_mask(where: str, mask, shards: Shards) -> Mask | None:
    """The global mask as a :class:`Mask`, checked against the whole attention ``(B, Hq, Lq, Lk)``."""
    if mask is None:
        return None
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise TypeError(
            f"{where}: mask must be a multihead mask or a bool tensor over the whole sequence, got a "
            f"{mask.dtype} tensor; hint: additive float masks are not sharded, use a mask object "
            "(causal(), key_padding(...), document(...)) or ~multihead.masks.additive_blocked(mask)"
        )
    if not isinstance(mask, (Mask, Tensor)):
        raise TypeError(f"{where}: mask must be None, a multihead mask or a bool tensor, got {type(mask).__name__}")
    mask = as_mask(mask)
    try:
        mask.check(Extent(shards.B, shards.Hq, shards.Lq, shards.Lk))
    except ValueError as e:
        raise ValueError(
            f"{where}: mask does not fit the whole attention (B, Hq, Lq, Lk) = "
            f"({shards.B}, {shards.Hq}, {shards.Lq}, {shards.Lk}) of {shards.world} shards: {e}; "
            "hint: the mask describes the whole sequence, not this rank's shard"
        ) from None
    return mask


def check_score_mod(where: str, score_mod, softcap, shards: Shards) -> ScoreMod | None:
    """``score_mod=`` and ``softcap=`` as one modifier (as :func:`multihead.attention` reads them),
    bound to the whole attention's lengths and checked against ``(B, Hq, Lq, Lk)``."""
    mod = as_score_mod(score_mod)
    if softcap is not None:
        cap = softcap_mod(softcap)
        mod = cap if mod is None else Chain([mod, cap])
    if mod is None:
        return None
    mod = mod.for_lengths(shards.Lq, shards.Lk)
    try:
        mod.check(Extent(shards.B, shards.Hq, shards.Lq, shards.Lk))
    except ValueError as e:
        raise ValueError(
            f"{where}: score_mod does not fit the whole attention (B, Hq, Lq, Lk) = "
            f"({shards.B}, {shards.Hq}, {shards.Lq}, {shards.Lk}) of {shards.world} shards: {e}; "
            "hint: a modifier describes the whole sequence, not this rank's shard"
        ) from None
    return mod


def check_scale(where: str, scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{where}: scale must be a finite number or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


class Checked(NamedTuple):
    """What :func:`check_call` gives back: the shapes of the call, its arguments as the call runs
    them, and the summary its ranks agreed on."""

    shards: Shards
    mask: Mask | None
    score_mod: ScoreMod | None
    scale: float
    summary: dict


def check_call(
    where: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    world: int,
    shapes: Callable[[Shards], None],
    agree_with: Callable[[BaseException | None, dict], None],
    *,
    mask,
    score_mod,
    softcap,
    sinks,
    layout,
    scale,
    return_lse,
    backend,
    agreed: dict,
) -> Checked:
    """Every sharded entry point's checks, on every rank before anything moves (module
    docstring), in one order: q, k, v (:func:`check_qkv`), the layout, ``shapes(shards)`` (the
    entry point's own conditions), the mask, the scale, ``return_lse``, ``backend``, the score
    modifier and the sinks; then :func:`call_summary`, with ``agreed``'s entries between the
    scale and the backend. Any error is caught and handed with the summary to
    ``agree_with(error, summary)`` (:func:`agree` or :func:`agree_mesh` over the call's groups),
    which raises on every rank if one failed or two disagree."""
    error, checked = None, None
    try:
        shards = check_qkv(where, q, k, v, world)
        check_layout(layout, where)
        shapes(shards)
        mask = check_mask(where, mask, shards)
        scale = check_scale(where, scale, shards.D)
        if not isinstance(return_lse, bool):
            raise TypeError(f"{where}: return_lse must be a bool, got {type(return_lse).__name__}")
        if not isinstance(backend, str):
            raise TypeError(
                f"{where}: backend must be a str ('auto' or a registered name), got {type(backend).__name__}"
            )
        mod = check_score_mod(where, score_mod, softcap, shards)
        check_sinks(sinks, q)
        summary = call_summary(
            q, k, v, mask=mask, score_mod=mod, sinks=sinks, layout=layout, scale=scale, **agreed, backend=backend
        )
        checked = Checked(shards, mask, mod, scale, summary)
    except Exception as e:  # any failure here (a mask's fingerprint too) must reach the other ranks
        error = e
    agree_with(error, {} if checked is None else checked.summary)
    assert checked is not None  # agree_with raised on every rank otherwise
    return checked


def call_summary(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    score_mod: ScoreMod | None = None,
    sinks: Tensor | None = None,
    **arguments: object,
) -> dict:
    """What every rank of one sharded call must have alike, as plain data: the shapes and dtype of
    its shards, whether autograd will run a backward through each (a backward communicates, so a
    rank without one leaves the others waiting), the mask and the score modifier by content
    (:func:`~multihead.distributed.fingerprint.mask_fingerprint`), the sinks by content, and the
    other ``arguments``."""
    # A layout object counts by its description (its runs' digest), not by the ids it holds.
    arguments = {k: repr(a) if isinstance(a, Layout) else a for k, a in arguments.items()}
    summary = {
        "q": tuple(q.shape),
        "k": tuple(k.shape),
        "v": tuple(v.shape),
        "dtype": str(q.dtype),
        "requires_grad": _gradients(q, k, v, score_mod, sinks),
        "mask": mask_fingerprint(mask),
        **arguments,
    }
    if score_mod is not None:
        summary["score_mod"] = mask_fingerprint(score_mod)
    if sinks is not None:
        summary["sinks"] = (tuple(sinks.shape), str(sinks.dtype), tensor_fingerprint(sinks))
    return summary


def _gradients(q: Tensor, k: Tensor, v: Tensor, score_mod=None, sinks=None) -> str:
    """Which of q, k, v (and the modifier's tensors, the sinks) autograd will differentiate:
    ``'q, k, v'``, ``'q'``, ``'none'``..."""
    named = [("q", q), ("k", k), ("v", v)]
    named += [("score_mod", t) for t in (score_mod.tensors() if score_mod is not None else ())]
    named += [("sinks", sinks)] if sinks is not None else []
    wanted = list(dict.fromkeys(name for name, t in named if t.requires_grad))
    if wanted and not torch.is_grad_enabled():
        return "none (grad mode is off: torch.no_grad or inference_mode)"
    return ", ".join(wanted) or "none"


def agree(where: str, group, rank: int, error: BaseException | None, summary: dict) -> None:
    """Raise on every rank if any rank failed its own checks or the ranks' ``summary`` differ.

    One ``all_gather_object``; every rank of ``group`` must call this (with or without an error).
    A disagreement raises the same ``ValueError`` on every rank, naming every argument that
    differs and which ranks hold which value."""
    gathered: list = [None] * dist.get_world_size(group)
    mine = (None if error is None else (type(error).__name__, str(error)), summary)
    dist.all_gather_object(gathered, mine, group=group)
    for r, (err, _) in enumerate(gathered):
        if err is not None:
            kind, message = err
            if r == rank and error is not None:
                raise error
            cls = TypeError if kind == "TypeError" else ValueError
            raise cls(f"{where}: rank {r} received bad input, so every rank stops here: {message}")
    summaries = [s for _, s in gathered]
    found = (_difference(name, [s.get(name) for s in summaries]) for name in summaries[0])
    differences = [d for d in found if d is not None]
    if differences:
        raise ValueError(
            f"{where}: ranks disagree on {'; and on '.join(differences)}; expected every rank to pass a "
            "shard of the same shape, dtype and arguments (one call, sharded), the same mask built "
            "from the same values, and the same requires_grad and grad mode (a backward communicates)"
        )


def agree_mesh(where: str, inner, outer, error: BaseException | None, summary: dict) -> None:
    """:func:`agree` over a 2-D mesh given as two groups (every rank is in one ``inner`` group and
    one ``outer`` group, e.g. Ulysses inside, ring across): raise on *every* rank of the mesh if
    any rank failed or any two disagree, before anything moves.

    Three rounds: within ``inner``, then ``outer`` (each rank carries its inner group's outcome),
    then ``inner`` again (each carries what its outer group learnt). After the second round rank
    ``(i, o)`` knows about every inner group that meets outer group ``o``, which is all of them;
    the third round gives that to the ranks of its inner group. Raising after the first round
    alone would leave the ranks of other inner groups waiting in the next exchange."""
    outcome = error
    for group in (inner, outer, inner):
        try:
            agree(where, group, dist.get_rank(group), outcome, summary)
        except (TypeError, ValueError) as e:
            outcome = e
    if outcome is not None:
        raise outcome


def _difference(name: str, values: list) -> str | None:
    """``None`` if every rank has the same value, else ``"name: rank 1 has X but rank 0 has Y"``
    (ranks holding one value together: ``"ranks 1, 3 have X"``), rank 0's value last."""
    if all(v == values[0] for v in values):
        return None
    held: list[tuple[object, list[int]]] = []  # (value, its ranks) in order of first appearance
    for r, value in enumerate(values):
        for seen, ranks in held:
            if seen == value:
                ranks.append(r)
                break
        else:
            held.append((value, [r]))

    def who(ranks: list[int]) -> str:
        return f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"

    first, *others = held
    return f"{name}: " + ", ".join(f"{who(r)} {v!r}" for v, r in others) + f" but {who(first[1])} {first[0]!r}"
