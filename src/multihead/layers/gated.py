"""``GatedAttention``: each head's attention output gated by a sigmoid of the layer's input.

Qiu et al., 2025, "Gated Attention for Large Language Models" (the gate of Qwen3-Next), the gate
at position G1: after attention, before the heads are joined by ``out_proj``. Notation of
:mod:`multihead.conventions`, ``x (B, Lq, E)`` the query input::

    o_h   = attention(q_h, K_g(h), V_g(h))               (B, Lq, D)      head h, as MultiHeadAttention
    g     = σ(x W_g + b_g)                               elementwise: (B, Lq, Hq·D), one per channel
                                                         headwise:    (B, Lq, Hq),   one per head
    y     = [o_1 ⊙ g_1 | ... | o_Hq ⊙ g_Hq] W_O + b_O    (B, Lq, E)

The gate depends on the query token only, so caches, cross-attention, masks and backends are
those of :class:`~multihead.layers.MultiHeadAttention`: the layer *is* one, whose last step
(:meth:`~multihead.layers.MultiHeadAttention._heads`) multiplies the merged heads by ``g``
before ``out_proj``. The paper finds the elementwise gate the better of the two, and both remove
the attention sink (a head can output nothing instead of attending to the first token).

Qwen3-Next computes ``g`` in ``q_proj`` (head ``h``'s ``2·D`` outputs are ``[q_h | g_h]``); here
it is its own ``gate_proj (E -> Hq·D)``, so the attention part loads a plain layer's state dict::

    gate_proj.weight = q_proj.weight.view(Hq, 2, D, E)[:, 1].reshape(Hq·D, E)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from multihead.layers.checks import check_flag
from multihead.layers.heads import Heads
from multihead.layers.multihead import MultiHeadAttention

__all__ = ["GatedAttention", "GATES"]

#: One gate per channel of each head, or one per head.
GATES = ("elementwise", "headwise")


class GatedAttention(MultiHeadAttention):
    """Multi-head (GQA, MQA, cross-) attention whose heads are gated by ``σ(x W_g + b_g)``.

    Args:
        d_model, num_heads: as :class:`~multihead.layers.MultiHeadAttention`.
        num_kv_heads: ``Hkv``; default ``num_heads``.
        gate: ``"elementwise"`` (``gate_proj: E -> Hq·D``, a gate per channel of each head; the
            paper's best) or ``"headwise"`` (``gate_proj: E -> Hq``, one scalar per head).
        gate_bias: a bias in ``gate_proj`` (the paper's gate has none).
        **options: every other argument of :class:`~multihead.layers.MultiHeadAttention`
            (``head_dim``, ``causal``, ``rope``, ``dropout``, ``batch_first``, ``backend``, ...).

    ``forward`` is :meth:`MultiHeadAttention.forward`; the gate reads the ``query`` argument, so
    with a cache it is computed for the new tokens only. ``need_weights`` returns the attention
    probabilities (the gate scales what they produce, not them).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        gate: str = "elementwise",
        gate_bias: bool = False,
        **options: Any,
    ):
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, **options)
        layer = type(self).__name__
        if gate not in GATES:
            raise ValueError(
                f"{layer}: gate must be one of {GATES} (a gate per channel of each head, or one per head), got {gate!r}"
            )
        self.gate = gate
        width = num_heads * self.head_dim if gate == "elementwise" else num_heads
        weight = self.q_proj.weight
        self.gate_proj = nn.Linear(
            d_model,
            width,
            bias=check_flag(layer, "gate_bias", gate_bias),
            device=weight.device,
            dtype=weight.dtype,
        )

    def _heads(self, query: Tensor) -> Heads:
        """Attention as the plain layer's; the merged heads multiplied by ``σ(gate_proj(query))``."""
        g = self.gate_proj(query)  # (B, Lq, Hq·D) or (B, Lq, Hq); L first if not batch_first
        if not self.batch_first:
            g = g.transpose(0, 1)  # (B, Lq, ·): attend_heads merges the heads batch first
        return None, _gated(self.out_proj, torch.sigmoid(g), self.num_heads, self.gate == "headwise")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate={self.gate!r}"

    @classmethod
    def from_torch(cls, module: nn.Module) -> MultiHeadAttention:
        raise TypeError(
            f"{cls.__name__}.from_torch: torch.nn.MultiheadAttention has no gate to copy; hint: "
            f"MultiHeadAttention.from_torch(module), or build a {cls.__name__} and load the "
            f"attention weights with load_state_dict(..., strict=False)"
        )

    def to_torch(self) -> nn.MultiheadAttention:
        raise TypeError(
            f"{type(self).__name__}.to_torch: torch.nn.MultiheadAttention has no output gate; "
            f"it cannot compute what this layer computes"
        )


GatedAttention.__init__.__doc__ = GatedAttention.__doc__


def _gated(out_proj: nn.Module, gate: Tensor, heads: int, headwise: bool) -> Callable[[Tensor], Tensor]:
    """``merged (B, Lq, Hq·D) -> out_proj(merged ⊙ gate)``, ``gate (B, Lq, Hq·D)`` or, headwise,
    ``(B, Lq, Hq)`` broadcast over each head's ``D`` channels."""

    def project(merged: Tensor) -> Tensor:
        if headwise:
            merged = (merged.unflatten(-1, (heads, -1)) * gate.unsqueeze(-1)).flatten(-2)  # (B, Lq, Hq·D)
        else:
            merged = merged * gate  # (B, Lq, Hq·D)
        out: Tensor = out_proj(merged)  # (B, Lq, E)
        return out

    return project
