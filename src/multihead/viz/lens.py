"""The logit lens: what each layer of a decoder would predict next, read through the model's own
final norm and unembedding (nostalgebraist's logit lens; the LM Transparency Tool's per-layer
readout).

    lens = logit_lens(decoder, ids, token_names=names)           # a CausalDecoder or an HF causal LM
    write_viewer("v.html", [ViewerSource(..., logit_lens=lens)])  # the viewer's "Logit lens" tab

The residual stream after block ``l`` at position ``i``, ``h_l[i] (E,)``, is read as if it were the
last layer's: ``softmax(unembed(norm(h_l[i])))``, and its ``top_k`` tokens kept. The last block's
readout is the model's own next-token distribution (a test holds it to the model's logits). It is
computed here, in Python, when the source is recorded: the page only shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["LogitLens", "logit_lens"]


@dataclass
class LogitLens:
    """Per layer and position, the ``k`` most likely next tokens.

    Attributes:
        layers: the blocks' module names, first to last.
        tokens: the ``L`` input tokens (position ``i`` predicts the token after ``tokens[i]``).
        top_ids: ``(layers, L, k)`` token ids, most likely first.
        top_probs: ``(layers, L, k)`` their probabilities.
        top_names: ``top_ids`` as strings, ``[layer][position][rank]``.
    """

    layers: list[str]
    tokens: list[str]
    top_ids: Tensor
    top_probs: Tensor
    top_names: list[list[list[str]]]

    def to_json(self) -> dict:
        """The lens as the viewer's JSON: names, tokens, and the top tokens with 3-digit probabilities."""
        return {
            "layers": list(self.layers),
            "tokens": [str(t) for t in self.tokens],
            "k": int(self.top_ids.shape[-1]),
            "names": self.top_names,
            "probs": [[[round(float(p), 3) for p in pos] for pos in layer] for layer in self.top_probs.tolist()],
        }


@torch.no_grad()
def logit_lens(
    model: nn.Module,
    ids: Tensor,
    *,
    token_names: Callable[[list[int]], list[str]],
    top_k: int = 5,
    batch: int | None = None,
    blocks: Sequence[nn.Module] | None = None,
    norm: nn.Module | None = None,
    unembed: nn.Module | None = None,
    **kwargs,
) -> LogitLens:
    """The logit lens of one forward ``model(ids, **kwargs)``.

    Args:
        model: a :class:`multihead.models.CausalDecoder` (``blocks``, ``norm``, ``head``) or a
            Hugging Face causal LM (its base model's ``layers`` and ``norm``, and
            ``get_output_embeddings()``); any other decoder with ``blocks=``, ``norm=`` and
            ``unembed=`` given.
        ids: ``(B, L)`` token ids; ``batch`` picks the sequence when ``B > 1``.
        token_names: ids to strings (the inputs' and the predictions').
        top_k: tokens kept per layer and position.
        blocks, norm, unembed: the residual blocks in order (each returns the stream, or a tuple
            whose first item is), the final norm and the unembedding, when they are not found.
    """
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"logit_lens: ids must be (B, L) integer token ids, got {got}")
    B = ids.shape[0]
    if batch is None and B != 1:
        raise ValueError(f"logit_lens: ids hold B={B} sequences; pass batch=i (0 <= i < {B}) for the one shown")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or not -B <= batch < B):
        raise ValueError(f"logit_lens: batch must be an int in [0, {B}), got {batch!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"logit_lens: top_k must be a positive int, got {top_k!r}")
    found_blocks, found_norm, found_unembed = _parts(model)
    blocks = list(found_blocks if blocks is None else blocks)
    norm = found_norm if norm is None else norm
    unembed = found_unembed if unembed is None else unembed
    if not blocks or norm is None or unembed is None:
        raise ValueError(
            f"logit_lens: cannot find the blocks, final norm and unembedding of {type(model).__name__} "
            "(known: multihead.models.CausalDecoder, Hugging Face causal LMs with model.layers and "
            "model.norm); pass blocks=, norm= and unembed="
        )
    names = {id(m): n for n, m in model.named_modules()}
    streams: list[Tensor] = []

    def keep(module, args, output):
        streams.append(output[0] if isinstance(output, tuple) else output)  # (B, L, E)

    handles = [block.register_forward_hook(keep) for block in blocks]
    try:
        model(ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if len(streams) != len(blocks):
        raise ValueError(
            f"logit_lens: {len(blocks)} blocks ran {len(streams)} times in one forward; expected once each"
        )
    i = 0 if batch is None else batch
    h = torch.stack([s[i] for s in streams])  # (layers, L, E)
    logits = unembed(norm(h)).float()  # (layers, L, V)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap:  # Gemma 2 caps its output logits: the last layer's readout is then the model's own
        logits = cap * torch.tanh(logits / cap)
    probs = torch.softmax(logits, dim=-1)
    k = min(top_k, probs.shape[-1])
    top = probs.topk(k, dim=-1)
    top_names = [[list(token_names(pos)) for pos in layer] for layer in top.indices.tolist()]
    tokens = list(token_names(ids[i].tolist()))
    if len(tokens) != ids.shape[1]:
        raise ValueError(f"logit_lens: token_names gave {len(tokens)} names for {ids.shape[1]} ids")
    return LogitLens(
        [names.get(id(b), f"block {n}") for n, b in enumerate(blocks)],
        tokens,
        top.indices.cpu(),
        top.values.cpu(),
        top_names,
    )


def _parts(model: nn.Module) -> tuple[list[nn.Module], nn.Module | None, nn.Module | None]:
    """The blocks, final norm and unembedding of the decoders this module knows, else empty."""
    from multihead.models import CausalDecoder

    if isinstance(model, CausalDecoder):
        return list(model.blocks), model.norm, model.head
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)  # an HF causal LM's base model
    get_unembed = getattr(model, "get_output_embeddings", None)
    if isinstance(base, nn.Module) and callable(get_unembed):
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module):
            return list(layers), norm, get_unembed()
    return [], None, None
