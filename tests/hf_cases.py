"""What the Hugging Face backend's tests share (``tests/integrations/test_hf.py``,
``test_hf_hooks.py``): the sizes of their tiny random models, and the fp64 reference they compare
against, registered in ``transformers`` as the attention implementation ``oracle64`` with the
dense bool masks HF's own ``sdpa_mask`` builds (so it shares no mask code with the backend under
test). Import it after ``helpers.optional("transformers", ...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

VOCAB = 97


def tiny_config(**extra) -> dict:
    """The arguments of a tiny decoder config: 2 layers, hidden 64, GQA 4 x 2; ``extra`` added."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )


def oracle64(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None, **kwargs):
    """fp64 attention written out: ``attention_mask`` is HF's bool ``(B, 1, Lq, Lk)`` (True = attend)."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if kwargs.get("position_bias") is not None:  # T5
        s = s + kwargs["position_bias"][..., : k.shape[2]].double()
    if attention_mask is None:
        allowed = torch.ones_like(s, dtype=torch.bool)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[..., : k.shape[2]].expand_as(s)
    else:  # a user's additive 4-D mask: finfo.min blocks, the rest is added
        m = attention_mask[..., : k.shape[2]]
        allowed = (m > torch.finfo(m.dtype).min / 2).expand_as(s)
        s = s + m.double().masked_fill(~allowed, 0.0)
    if s_aux is not None:  # a sink joins each head's denominator and carries no value
        s = torch.cat([s, s_aux.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        allowed = torch.cat([allowed, allowed.any(-1, keepdim=True)], dim=-1)
    seen = allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~allowed, -1e300), dim=-1).masked_fill(~seen, 0.0)
    p = p[..., : v.shape[2]]
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), p.to(query.dtype)


def dense_hf_mask(**kwargs):
    """HF's ``sdpa_mask`` always written out (no skip for a causal or a bidirectional mask)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


@contextmanager
def oracle_registered() -> Iterator[None]:
    """``oracle64`` registered in ``transformers`` (attention and mask functions) for the block."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("oracle64", oracle64)
    AttentionMaskInterface.register("oracle64", dense_hf_mask)
    try:
        yield
    finally:
        AttentionInterface._global_mapping.pop("oracle64", None)
        AttentionMaskInterface._global_mapping.pop("oracle64", None)
