"""``multihead.explain``: which backend runs a call, why the others were refused, and how."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from multihead.backends.registry import AUTO_ORDER, available_backends, check_backend_name, get_backend, select_backend
from multihead.masks import Mask
from multihead.validation import validate_call, validate_weights_selection

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True)
class Explanation:
    """The dispatch decision for one call. ``str()`` gives the readable report."""

    backend: str  # the backend that runs
    shape: tuple  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    dtype: str
    device: str
    mask: str
    refused: dict = field(default_factory=dict)  # backend name -> reasons
    plan: tuple = ()  # how the chosen backend runs the call
    requested: str = "auto"

    def __str__(self) -> str:
        B, Hq, Hkv, Lq, Lk, D, Dv = self.shape
        lines = [
            f"attention call: B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lk={Lk} D={D} Dv={Dv} {self.dtype} on {self.device}",
            f"mask: {self.mask}",
            f"backend: {self.backend}" + (" (chosen by auto)" if self.requested == "auto" else " (forced)"),
        ]
        lines += [f"  - {line}" for line in self.plan]
        if self.refused:
            lines.append("refused:")
            lines += [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.refused.items()]
        if self.requested == "auto":
            lines.append("auto order: " + " > ".join(AUTO_ORDER))
        return "\n".join(lines)


def explain(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, score_mod=None,
            scale: float | None = None,
            dropout_p: float = 0.0, return_weights: bool = False, return_lse: bool = False,
            backend: str = "auto", dropout_mask: Tensor | None = None, weights_heads=None,
            weights_rows=None) -> Explanation:
    """Explain what :func:`multihead.attention` would do with these arguments, without running it."""
    check_backend_name(backend)
    call = validate_call(q, k, v, mask=mask, score_mod=score_mod, scale=scale, dropout_p=dropout_p, dropout_mask=dropout_mask,
                         return_weights=return_weights, return_lse=return_lse)
    heads, rows = validate_weights_selection(weights_heads, weights_rows, q=q, return_weights=return_weights)
    mask_text = "none" if call.mask is None else call.mask._describe()
    if call.score_mod is not None:
        mask_text += f"; score_mod: {call.score_mod._describe()}"
    notes = []
    if call.scale_folded:
        notes.append(f"scale {scale!r} <= 0 folded into q (q * scale, kernel scale 1): PyTorch's fused kernels "
                     "compute -inf * scale for masked scores (NaN or +inf)")
    if call.empty:
        return Explanation("none", call.shape, str(q.dtype), str(q.device), mask_text, {},
                           tuple(notes + ["Lq or Lk is 0: no kernel runs; every row sees no key (output 0, LSE -inf)"]),
                           backend)
    chosen, refused = select_backend(call, backend)
    if backend == "auto":  # also say why backends after the chosen one would not do
        for name in available_backends():
            if name != chosen.name and name not in refused:
                reasons = get_backend(name).refusals(call)
                if reasons:
                    refused[name] = reasons
    plan = notes + list(chosen.plan(call))
    if return_weights:
        nh = q.shape[1] if heads is None else len(heads)
        nr = q.shape[2] if rows is None else len(rows)
        plan.append(f"weights: {nh} head(s) x {nr} row(s) recomputed block by block from q, k and the LSE")
    return Explanation(chosen.name, call.shape, str(q.dtype), str(q.device), mask_text, refused,
                       tuple(plan), backend)
