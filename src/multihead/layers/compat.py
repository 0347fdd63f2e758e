"""``multihead.compat.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention``.

Same constructor, ``forward`` signature, return values, parameter names (``in_proj_weight`` or
``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, ``in_proj_bias``, ``bias_k``, ``bias_v``,
``out_proj.weight``, ``out_proj.bias``: ``load_state_dict`` of an ``nn.MultiheadAttention``
checkpoint just works) and initialization (the same seed gives the same weights).

.. warning::
   **Masks follow PyTorch's polarity here, the opposite of the rest of multihead**:

   * ``key_padding_mask``: bool, ``True`` = **ignore** this key (padding);
   * ``attn_mask``: bool, ``True`` = **blocked**;
   * float masks of either kind are added to the scores, as in PyTorch; what blocks is ``-inf``
     and values at or below ``finfo(dtype).min / 2`` (:func:`multihead.masks.additive_blocked`).

   Everywhere else in `multihead` a bool mask means ``True`` = *may attend*
   (:mod:`multihead.conventions`).

Where this class differs from PyTorch's, on purpose:

* a query row that sees no key gives attention 0 (so its output is ``out_proj.bias``) and a
  weights row of 0, never NaN, in forward and backward;
* ``is_causal=True`` is honoured, with or without ``attn_mask``: a top-left causal mask (PyTorch's
  ``is_causal``) over the given keys, combined with ``attn_mask`` if one is passed. PyTorch
  requires an ``attn_mask`` and treats the flag as an unchecked hint;
* an ``attn_mask`` that is exactly a structure a mask object spells out (the causal pattern, a
  band, key padding, documents) is recognised (:func:`multihead.masks.recognize.from_dense`, an
  ``O(Lq·Lk)`` check) and run as that object, so the fused kernel needs no mask tensor;
* returned weights are the probabilities *before* dropout (PyTorch returns them after dropout
  in training mode); the output path is dropped out the same way;
* the fast path of :func:`multihead.attention` runs whatever ``need_weights`` is; weights are
  recomputed block by block only when asked for;
* like every `multihead` layer, its per-head weights ``(B, H, L, S)`` are recorded by
  :func:`multihead.capture_attention`.

Inside ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer`` it
works wherever PyTorch's class does:

* **PyTorch's fast path.** In eval mode without autograd (``torch.no_grad()``,
  ``torch.inference_mode()``), ``nn.TransformerEncoderLayer`` reads ``batch_first``,
  ``_qkv_same_embed_dim``, ``num_heads``, ``embed_dim``, ``in_proj_weight``, ``in_proj_bias``
  and ``out_proj`` of its ``self_attn``, calls :meth:`merge_masks`, and runs
  ``torch._transformer_encoder_layer_fwd`` with these weights *instead of* ``self_attn.forward``,
  exactly as it does with PyTorch's class. Those attributes mean what they mean there, so the
  layer computes PyTorch's numbers, and the deliberate differences above are not in effect on
  that path (it is PyTorch's kernel). ``nn.TransformerEncoder`` then also packs a padded batch
  into a nested tensor and returns padded rows as 0, as PyTorch does.
* **Nested inputs.** A layer that declines its fast path inside such an encoder (a hook,
  for example) passes nested ``(B, ragged L, E)`` tensors to ``self_attn``. They are accepted here
  with ``batch_first=True`` and no mask tensors (PyTorch's own conditions for nested inputs), run
  as a padded batch with a key padding mask, and returned nested; weights come back padded,
  ``0`` on padded rows and keys, as PyTorch returns them.
* under ``torch.compile`` the ``O(L·S)`` recognition of an ``attn_mask`` (data-dependent,
  a graph break) is skipped: the mask runs as a tensor. So it is for a float ``attn_mask`` that
  requires grad, which always gets its gradient (PyTorch's ``is_causal`` hint may skip the mask
  and leave its gradient ``None``).
* ``torch.jit.script`` is refused with a ``TypeError`` that says why: ``forward`` runs the
  `multihead` core (mask objects, backend dispatch), which TorchScript cannot compile. Script a
  ``torch.nn.MultiheadAttention`` loaded with this module's ``state_dict()`` instead (the state
  dicts are the same).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from multihead.backends import cpu_gemv
from multihead.call import Selection, mask_and_score_mod
from multihead.hooks import HookPoints
from multihead.layers.checks import check_dropout, check_flag, check_inputs, check_size, dims
from multihead.layers.heads import attend_heads, split_heads
from multihead.masks import Mask, causal
from multihead.masks.recognize import from_dense
from multihead.scores import ScoreMod

__all__ = ["MultiheadAttention"]

_NAME = "MultiheadAttention"


class MultiheadAttention(HookPoints, nn.Module):
    """``torch.nn.MultiheadAttention`` on the `multihead` core; arguments as in PyTorch.

    Shapes (``E = embed_dim``, ``H = num_heads``, ``L`` target and ``S`` source length):
    ``query (L, B, E)``, ``key (S, B, kdim)``, ``value (S, B, vdim)``, or ``(B, L, E)`` ... with
    ``batch_first=True``, or unbatched ``(L, E)`` ...; ``key_padding_mask (B, S)`` (``(S,)``
    unbatched); ``attn_mask (L, S)`` or ``(B·H, L, S)`` (``(H, L, S)`` unbatched). Returns
    ``(attn_output, attn_weights)``: the output in the query's layout, the weights ``(B, L, S)``
    averaged over heads or ``(B, H, L, S)``, ``None`` unless ``need_weights``. ``S`` counts the
    ``bias_k`` and zero-attention keys when ``add_bias_kv``/``add_zero_attn`` append them.
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        embed_dim = check_size(_NAME, "embed_dim", embed_dim)
        num_heads = check_size(_NAME, "num_heads", num_heads)
        if embed_dim % num_heads != 0:
            divisors = [d for d in range(1, embed_dim + 1) if embed_dim % d == 0]
            raise ValueError(
                f"{_NAME}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                f"num_heads must be one of {divisors}"
            )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else check_size(_NAME, "kdim", kdim)
        self.vdim = embed_dim if vdim is None else check_size(_NAME, "vdim", vdim)
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = check_dropout(_NAME, dropout)
        self.batch_first = check_flag(_NAME, "batch_first", batch_first)
        self.head_dim = embed_dim // num_heads

        # Parameters created in PyTorch's order, so that the same seed gives the same weights.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if check_flag(_NAME, "bias", bias):
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if check_flag(_NAME, "add_bias_kv", add_bias_kv):
            self.bias_k: nn.Parameter | None = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v: nn.Parameter | None = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = check_flag(_NAME, "add_zero_attn", add_zero_attn)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """PyTorch's initialization, call for call."""
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None and self.bias_v is not None:
            xavier_normal_(self.bias_k)
            xavier_normal_(self.bias_v)

    __init__.__doc__ = __doc__  # help(MultiheadAttention.__init__): not nn.Module.__init__'s text

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickles of PyTorch 1.1 modules lack this flag, as PyTorch's own class handles.
        state.setdefault("_qkv_same_embed_dim", True)
        super().__setstate__(state)  # type: ignore[no-untyped-call]  # torch's Module.__setstate__ is unannotated

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        weights_heads: Selection = None,
        weights_rows: Selection = None,
    ) -> tuple[Tensor, Tensor | None]:
        """PyTorch's contract (see the module docstring for masks and the deliberate differences).

        Beyond it, ``weights_heads``/``weights_rows`` (with ``need_weights``, batched padded inputs):
        return the weights of these heads and query rows only, computed for them alone, as
        :func:`multihead.attention` does; ``average_attn_weights`` then averages the selected heads."""
        if (weights_heads is not None or weights_rows is not None) and not need_weights:
            raise ValueError(
                f"{_NAME}: weights_heads/weights_rows select which weights to return; they need "
                f"need_weights=True, got need_weights=False"
            )
        if any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
            if weights_heads is not None or weights_rows is not None:
                raise ValueError(
                    f"{_NAME}: weights_heads/weights_rows need padded inputs, got nested tensors; "
                    "hint: select from the returned weights instead"
                )
            return self._forward_nested(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        bf = self.batch_first
        check_inputs(
            _NAME, query, key, value, sizes=(self.embed_dim, self.kdim, self.vdim), batch_first=bf, ranks=(2, 3)
        )
        for name, flag in (
            ("need_weights", need_weights),
            ("average_attn_weights", average_attn_weights),
            ("is_causal", is_causal),
        ):
            check_flag(_NAME, name, flag)
        batched = query.dim() == 3
        if not batched:  # (L, E): one batch element in this module's layout
            query, key, value = (t.unsqueeze(0 if bf else 1) for t in (query, key, value))
        B, L = dims(query, bf)
        S = dims(key, bf)[1]
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)  # keys appended after the S given
        mask, score_mod = self._mask(key_padding_mask, attn_mask, is_causal, B, L, S, extra, batched, query.device)

        q, k, v = self._project(query, key, value)  # (B, L, E), (B, S, E), (B, S, E); L, S first if not bf
        if self.bias_k is not None:
            assert self.bias_v is not None  # set together with bias_k
            k, v = _append_key(k, self.bias_k, bf), _append_key(v, self.bias_v, bf)  # (B, S+1, E)
        if self.add_zero_attn:
            zero = torch.zeros((1, 1, self.embed_dim), dtype=k.dtype, device=k.device)
            k, v = _append_key(k, zero, bf), _append_key(v, zero, bf)  # (B, S+extra, E)
        q = split_heads(q, self.num_heads, self.head_dim, bf)  # (B, H, L, D)
        k = split_heads(k, self.num_heads, self.head_dim, bf)  # (B, H, S+extra, D)
        v = split_heads(v, self.num_heads, self.head_dim, bf)  # (B, H, S+extra, D)

        out, weights = attend_heads(
            self,
            q,
            k,
            v,
            out_proj=self.out_proj,
            mask=mask,
            score_mod=score_mod,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            weights_heads=weights_heads,
            weights_rows=weights_rows,
        )  # (B, L, E), (B, H, L, S+extra) or None
        if not batched:
            out = out.squeeze(0)  # (L, E)
        elif not bf:
            out = out.transpose(0, 1)  # (L, B, E), a view
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S+extra)
            if not batched:
                weights = weights.squeeze(0)  # (L, S+extra) or (H, L, S+extra)
        return out, weights

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """PyTorch's ``nn.MultiheadAttention.merge_masks``, with its meaning: the masks of a
        self-attention in the form PyTorch's fused kernels take them.

        ``nn.TransformerEncoderLayer`` calls it on its fast path (module docstring) with the masks
        it has already made canonical (float, additive, PyTorch's polarity). Returns
        ``(merged_mask, mask_type)``: ``(None, None)`` without masks; ``(key_padding_mask, 1)``
        with only ``key_padding_mask (B, L)``; with ``attn_mask`` ``(L, L)`` or ``(B·H, L, L)``,
        that mask viewed as ``(B, H, L, L)`` plus ``key_padding_mask`` viewed as
        ``(B, 1, 1, L)`` if given, and type 2. ``query`` is ``(B, L, E)``.
        """
        mask_type: int | None = None
        merged_mask: Tensor | None = None
        if key_padding_mask is not None:
            mask_type = 1
            merged_mask = key_padding_mask  # (B, L)
        if attn_mask is not None:
            batch_size, seq_len, _ = query.shape
            mask_type = 2
            if attn_mask.dim() == 3:
                attn_mask_expanded = attn_mask.view(batch_size, -1, seq_len, seq_len)  # (B, H, L, L)
            else:
                attn_mask_expanded = attn_mask.view(1, 1, seq_len, seq_len).expand(
                    batch_size, self.num_heads, -1, -1
                )  # (B, H, L, L)
            merged_mask = attn_mask_expanded
            if key_padding_mask is not None:
                key_padding_mask_expanded = key_padding_mask.view(batch_size, 1, 1, seq_len).expand(
                    -1, self.num_heads, -1, -1
                )  # (B, H, 1, L)
                merged_mask = attn_mask_expanded + key_padding_mask_expanded
        return merged_mask, mask_type

    def __prepare_scriptable__(self) -> NoReturn:
        # torch.jit.script calls this before compiling a module, and for every submodule of a
        # scripted model (e.g. an nn.TransformerEncoderLayer holding this module).
        raise TypeError(
            f"multihead.compat.{_NAME} cannot be compiled by torch.jit.script: its forward runs the multihead "
            "core (mask objects, backend dispatch, weights recomputed by blocks), which is Python that "
            "TorchScript cannot compile. Use torch.compile(module) instead, or script PyTorch's class with "
            "the same weights: m = torch.nn.MultiheadAttention(embed_dim, num_heads, ..., batch_first=...); "
            "m.load_state_dict(module.state_dict()); torch.jit.script(m) (PyTorch's semantics then apply, "
            "e.g. NaN on query rows that see no key)"
        )

    # ------------------------------------------------------------------------------ helpers
    def _forward_nested(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Nested ``(B, ragged L, E)`` inputs (what ``nn.TransformerEncoder`` passes on once it has
        packed a padded batch) as a padded batch with a key padding mask, the output nested again."""
        tensors = (query, key, value)
        if not all(isinstance(t, Tensor) and t.is_nested for t in tensors):
            raise TypeError(
                f"{_NAME}: query, key and value must be all nested tensors or none, got is_nested="
                f"{tuple(isinstance(t, Tensor) and t.is_nested for t in tensors)}"
            )
        if not self.batch_first:
            raise ValueError(
                f"{_NAME}: nested tensors are (B, ragged L, E), batch first, but this module has "
                "batch_first=False; build it with batch_first=True (as PyTorch requires)"
            )
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError(
                f"{_NAME}: nested inputs take no key_padding_mask or attn_mask (their padding is "
                "their ragged lengths, as in PyTorch); pass a padded tensor with masks instead"
            )
        q_lengths = [t.shape[0] for t in query.unbind()]
        k_lengths = [t.shape[0] for t in key.unbind()]
        v_lengths = [t.shape[0] for t in value.unbind()]
        if k_lengths != v_lengths:
            raise ValueError(f"{_NAME}: key and value must have the same lengths, got {k_lengths} and {v_lengths}")

        def padded(t: Tensor) -> Tensor:
            out: Tensor = torch.nested.to_padded_tensor(t, 0.0)  # (B, max L, features)
            return out

        q = padded(query)  # (B, L, E)
        k = q if key is query else padded(key)  # (B, S, kdim); `is` kept for the one-matmul projection
        v = k if value is key else padded(value)  # (B, S, vdim)
        S = k.shape[1]
        keys = torch.arange(S, device=k.device)
        padding = keys >= torch.tensor(k_lengths, device=k.device).unsqueeze(1)  # (B, S), True = padding
        out, weights = self.forward(
            q,
            k,
            v,
            key_padding_mask=padding,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        out = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out.unbind(), q_lengths)], layout=query.layout)
        if weights is not None:  # (B, L, S+extra) or (B, H, L, S+extra): padded query rows to 0, as PyTorch
            rows = torch.arange(q.shape[1], device=q.device) < torch.tensor(q_lengths, device=q.device).unsqueeze(1)
            rows = rows.view(len(q_lengths), *([1] * (weights.dim() - 3)), -1, 1)  # (B, [1,] L, 1)
            weights = weights.masked_fill(~rows, 0.0)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E, bias = self.embed_dim, self.in_proj_bias
        if self._qkv_same_embed_dim and key is query and value is query:
            q, k, v = _linear(query, self.in_proj_weight, bias).split(E, dim=-1)  # one matmul
            return q, k, v
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.split(E)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq, bk, bv = (None, None, None) if bias is None else bias.split(E)
        return _linear(query, wq, bq), _linear(key, wk, bk), _linear(value, wv, bv)

    def _mask(
        self,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        B: int,
        L: int,
        S: int,
        extra: int,
        batched: bool,
        device: torch.device,
    ) -> tuple[Mask | None, ScoreMod | None]:
        """PyTorch's masks as one `multihead` mask over ``(B, H, L, S + extra)``, and the additive
        bias of a float mask as a score modifier.

        Bool masks are inverted here (PyTorch: ``True`` = blocked) into ``True`` = may attend;
        the appended ``bias_k``/zero keys are visible to every query, as in PyTorch.
        """
        H, parts = self.num_heads, []
        structure: Mask | None = None  # what a recognised attn_mask spells out, instead of its tensor
        expected: tuple[int, ...]
        if key_padding_mask is not None:
            kpm = _mask_tensor("key_padding_mask", key_padding_mask)
            expected = (B, S) if batched else (S,)
            if tuple(kpm.shape) != expected:
                raise ValueError(
                    f"{_NAME}: key_padding_mask must have shape {'(B, S)' if batched else '(S,)'} = "
                    f"{expected}, got {tuple(kpm.shape)}"
                )
            parts.append(_allowed(kpm).reshape(B, 1, 1, S))
        causal_mask = causal("top_left") if is_causal else None
        if attn_mask is not None:
            am = _mask_tensor("attn_mask", attn_mask)
            if am.dim() == 2:
                if tuple(am.shape) != (L, S):
                    raise ValueError(
                        f"{_NAME}: a 2-D attn_mask must have shape (L, S) = {(L, S)}, got {tuple(am.shape)}"
                    )
                am = _allowed(am).view(1, 1, L, S)
            elif am.dim() == 3:
                expected = (B * H, L, S) if batched else (H, L, S)
                if tuple(am.shape) != expected:
                    raise ValueError(
                        f"{_NAME}: a 3-D attn_mask must have shape "
                        f"{'(B*num_heads, L, S)' if batched else '(num_heads, L, S)'} = {expected}, "
                        f"got {tuple(am.shape)}"
                    )
                am = _allowed(am).view(B, H, L, S)  # PyTorch's row b*H + h is batch b, head h
            else:
                raise ValueError(
                    f"{_NAME}: attn_mask must have 2 dims (L, S) or 3 dims (B*num_heads, L, S), "
                    f"got shape {tuple(am.shape)}"
                )
            # Recognising a structure reads the mask's values: a graph break under torch.compile,
            # where the mask simply runs as a tensor; so does a mask that wants its gradient (a
            # learned additive mask), and one whose bias is more than 0 where it lets keys through.
            found = None
            if extra == 0 and not am.requires_grad and not torch.compiler.is_compiling():
                found = from_dense(am)
            if found is not None and not found.bias:
                structure = found.mask  # the same mask, without a tensor (None: it blocks nothing)
                if structure is not None and structure.causal_offset(L, S) == 0:
                    # PyTorch's is_causal pattern, named as the flag names it: one object with the
                    # flag too (causal() & causal('top_left') would hide the diagonal from backends)
                    structure = causal("top_left")
            else:
                parts.append(am)
        if causal_mask is not None and extra:
            # The causal pattern covers the S given keys only; appended keys stay visible.
            parts.append(torch.ones((L, S), dtype=torch.bool, device=device).tril().view(1, 1, L, S))
            causal_mask = None
        # (structure is set only outside torch.compile: comparing masks hashes their values)
        objects = structure if structure is not None and structure == causal_mask else _and([structure, causal_mask])
        dense = _combine([_pad_keys(p, extra) for p in parts])
        if dense is None:
            return objects, None
        # PyTorch's float masks are additive whatever their values (a 0/1 float attn_mask keeps
        # PyTorch's meaning here instead of being refused): what it blocks and a bias.
        combined, score_mod = mask_and_score_mod(dense, None, check_binary=False)
        return _and([combined, objects]), score_mod


# ---------------------------------------------------------------------------------- helpers
def _mask_tensor(name: str, mask: object) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{_NAME}: {name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{_NAME}: {name} must be a bool (True = ignore/blocked, PyTorch's polarity) or float "
            f"(additive) tensor, got dtype {mask.dtype}"
        )
    return mask


def _allowed(mask: Tensor) -> Tensor:
    """PyTorch bool (``True`` = blocked) -> multihead bool (``True`` = may attend); floats unchanged."""
    return ~mask if mask.dtype == torch.bool else mask


def _and(masks: list[Mask | None]) -> Mask | None:
    """The ``&`` of the masks given (``None``: nothing blocked)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def _pad_keys(mask: Tensor, extra: int) -> Tensor:
    """Append ``extra`` always-visible key columns."""
    if extra == 0:
        return mask
    shape = (*mask.shape[:-1], extra)
    fill = (
        torch.ones(shape, dtype=torch.bool, device=mask.device)
        if mask.dtype == torch.bool
        else torch.zeros(shape, dtype=mask.dtype, device=mask.device)
    )
    return torch.cat([mask, fill], dim=-1)


def _combine(parts: list[Tensor]) -> Tensor | None:
    """One tensor from broadcastable parts: ``&`` of bools, or the sum of additive biases."""
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        out = parts[0]
        for p in parts[1:]:
            out = out & p
        return out
    dtype = next(p.dtype for p in parts if p.dtype != torch.bool)
    total: Tensor | None = None
    for p in parts:
        if p.dtype == torch.bool:
            zero = torch.zeros((), dtype=dtype, device=p.device)
            p = torch.where(p, zero, torch.full((), float("-inf"), dtype=dtype, device=p.device))
        total = p if total is None else total + p
    return total


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` as ``nn.MultiheadAttention`` computes it, for a bias of any dtype.

    ``F.linear``'s fused kernel (addmm) needs the bias in the dtype of ``x``; PyTorch's class
    declines its fast path when the dtypes of the query and ``in_proj_bias`` differ, and its
    projection of a batch-first input (a transposed view) is a matmul then an add, which promotes
    types: an fp16 ``in_proj_bias`` in an fp64 module is added in fp64 (PyTorch's test
    ``test_multihead_attn_fast_path_query_and_bias_have_different_dtypes``). So is it here.
    """
    if bias is None or bias.dtype == x.dtype:
        return cpu_gemv.linear(x, weight, bias)  # F.linear; a few bf16 rows on the one-token kernel
    return F.linear(x, weight) + bias  # type promotion, as PyTorch's matmul + add


def _append_key(x: Tensor, row: Tensor, batch_first: bool) -> Tensor:
    """Append ``row (1, 1, E)`` as one more key to every batch element of ``x``."""
    row = row.to(x.dtype)  # bias_k stays fp32 under autocast while the projections run in bf16
    if batch_first:
        return torch.cat([x, row.expand(x.shape[0], 1, -1)], dim=1)  # (B, S+1, E)
    return torch.cat([x, row.expand(1, x.shape[1], -1)], dim=0)  # (S+1, B, E)
