"""Export a self-attention layer: ``torch.export`` with a dynamic sequence length, and ONNX.

    from multihead.integrations.export import export, to_onnx

    layer = MultiHeadAttention(64, 8, num_kv_heads=2, causal=True).eval()
    program = export(layer, x, lengths=lengths)  # torch.export.ExportedProgram, inputs (x, lengths)
    onnx_program = to_onnx(program)               # torch.onnx.ONNXProgram, opset 23 (or to_onnx(layer, x, ...))

**How a mask travels.** An exported program takes tensors, while a `multihead` mask is a Python
object (``causal()``, ``key_padding(lengths)``): ``torch.export`` refuses it as an input. So the
mask is split into what is fixed and what changes per call:

* the fixed structure is part of the module: the layer's ``causal=True``, or a mask object given
  to :class:`ExportableAttention` (``sliding_window(w)``, ``causal()``), evaluated at each call's
  lengths inside the graph;
* what changes per call is a tensor input: ``lengths`` ``(B,)`` int64, the real tokens of each
  row, made into ``key_padding(lengths)`` inside ``forward``.

The exported graph computes the same function at every sequence length in ``[min_length,
max_length]`` (a ``torch.export.Dim``) and every batch size: dispatch takes no decision on a
symbolic length (``multihead.backends.decode`` refuses one; ``blocksparse`` refuses tracing),
so ``auto`` runs ``sdpa``, whose fix-ups for fully masked rows and unseen keys run
unconditionally under tracing.

**ONNX.** :func:`to_onnx` runs ``torch.onnx.export(..., dynamo=True)``. From opset 23 the exporter
maps ``F.scaled_dot_product_attention`` onto ONNX's ``Attention`` operator, GQA included (one node
per layer); below 23 it writes ``MatMul``/``Softmax``. ``pip install "multihead[onnx]"``.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import Tensor, nn

from multihead.layers.multihead import MultiHeadAttention
from multihead.masks import Mask, key_padding

__all__ = ["ExportableAttention", "export", "to_onnx", "dynamic_shapes", "DEFAULT_OPSET"]

#: The first opset with the ``Attention`` operator (ONNX 1.18), onto which the exporter maps SDPA.
DEFAULT_OPSET = 23


class ExportableAttention(nn.Module):
    """``layer``'s self-attention with its mask built inside ``forward`` from tensors.

    Args:
        layer: a :class:`~multihead.MultiHeadAttention` (or subclass); ``causal=True`` for a
            causal mask. Its parameters are this module's (``self.layer``), shared, not copied.
        mask: a mask object applied on every call, whose meaning needs no per-call tensor
            (``causal()``, ``sliding_window(w)``, ``causal() & sliding_window(w)``); it is read at
            each call's lengths. ``None``: nothing but the layer's causality and the padding.

    ``forward(x, lengths=None)``: ``x`` ``(B, L, E)`` (``(L, B, E)`` when ``batch_first=False``),
    ``lengths`` ``(B,)`` integer, the real tokens of each row (keys ``j >= lengths[b]`` are masked:
    ``key_padding(lengths)``; a row of length 0 gives zeros); returns ``layer(x, mask=...)``.
    """

    def __init__(self, layer: MultiHeadAttention, *, mask: Mask | None = None):
        super().__init__()
        if not isinstance(layer, MultiHeadAttention):
            raise TypeError(
                f"ExportableAttention: layer must be a multihead.MultiHeadAttention, got "
                f"{type(layer).__name__}; hint: convert an nn.MultiheadAttention with "
                f"MultiHeadAttention.from_torch(module)"
            )
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(
                f"ExportableAttention: mask must be a multihead mask object or None, got "
                f"{type(mask).__name__}; per-call masks enter as tensors (lengths=)"
            )
        if layer.context_parallel is not None:
            raise ValueError(
                "ExportableAttention: a context-parallel layer attends across processes, which an "
                "exported graph cannot; export a layer with context_parallel=None"
            )
        self.layer = layer
        self.mask = mask
        self.train(layer.training)  # the layer's mode (call .eval() before export: dropout is traced as it is)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``layer(x, mask=mask & key_padding(lengths))``: ``x`` ``(B, L, E)``, ``lengths`` ``(B,)``
        or ``None``; returns ``(B, L, E)`` (``(L, B, E)`` for a layer with ``batch_first=False``)."""
        mask = self.mask
        if lengths is not None:
            padding = key_padding(lengths)
            mask = padding if mask is None else mask & padding
        out: Tensor = self.layer(x, mask=mask)  # (B, L, E) or (L, B, E)
        return out

    def extra_repr(self) -> str:
        return "" if self.mask is None else f"mask={self.mask._describe()}"


def dynamic_shapes(
    module: ExportableAttention,
    lengths: bool,
    *,
    min_length: int = 1,
    max_length: int = 1 << 16,
    dynamic_batch: bool = True,
) -> dict[str, Any]:
    """The ``dynamic_shapes`` of ``torch.export`` for ``module(x, lengths)``: the sequence length of
    ``x`` is ``Dim("L", min=min_length, max=max_length)``, its batch ``Dim("B")`` (shared with
    ``lengths``) when ``dynamic_batch``, else fixed."""
    L = torch.export.Dim("L", min=min_length, max=max_length)
    B = torch.export.Dim("B", min=1, max=1 << 16) if dynamic_batch else None
    seq, batch = (1, 0) if module.layer.batch_first else (0, 1)
    x = {seq: L} if B is None else {seq: L, batch: B}
    shapes: dict[str, Any] = {"x": x}
    if lengths:
        shapes["lengths"] = None if B is None else {0: B}
    return shapes


def export(
    layer: MultiHeadAttention | ExportableAttention,
    x: Tensor,
    *,
    lengths: Tensor | None = None,
    mask: Mask | None = None,
    min_length: int = 1,
    max_length: int = 1 << 16,
    dynamic_batch: bool = True,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``layer``'s self-attention for any sequence length in
    ``[min_length, max_length]`` (and any batch size when ``dynamic_batch``).

    ``x`` and ``lengths`` are example inputs (their values do not matter, their dtypes and number of
    dimensions do); with ``lengths`` the program takes ``(x, lengths)``, without it ``(x,)``.
    ``mask``: the fixed mask of :class:`ExportableAttention`. Returns the ``ExportedProgram``;
    ``program.module()(x, lengths)`` runs it.
    """
    module = _exportable(layer, mask)
    args = (x,) if lengths is None else (x, lengths)
    shapes = dynamic_shapes(
        module, lengths is not None, min_length=min_length, max_length=max_length, dynamic_batch=dynamic_batch
    )
    return torch.export.export(module, args, dynamic_shapes=shapes)


def to_onnx(
    model: MultiHeadAttention | ExportableAttention | torch.export.ExportedProgram,
    x: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    mask: Mask | None = None,
    opset_version: int = DEFAULT_OPSET,
    min_length: int = 1,
    max_length: int = 1 << 16,
    dynamic_batch: bool = True,
    optimize: bool = True,
) -> torch.onnx.ONNXProgram:
    """``torch.onnx.export(..., dynamo=True)`` of a program of :func:`export` (``model`` an
    ``ExportedProgram``: no second trace), or of ``model``'s self-attention exported with the
    arguments of :func:`export`. Returns a ``torch.onnx.ONNXProgram`` whose inputs are ``x`` (and
    ``lengths``) and whose output is ``out``, batch and length symbolic (named ``B`` and ``L`` when
    ``model`` is a layer; as the exporter names them for a program): ``program.model_proto``
    is the ONNX model, ``program.save(path)`` writes it. From opset 23 each attention is one
    ``Attention`` node. Needs ``onnx`` and ``onnxscript`` (``pip install "multihead[onnx]"``)."""
    if isinstance(model, torch.export.ExportedProgram):
        if x is not None or lengths is not None or mask is not None:
            raise ValueError(
                "to_onnx: an ExportedProgram is converted as it was exported; x=, lengths= and mask= "
                "are for a layer (pass the layer instead, or leave them out)"
            )
        onnx_program = torch.onnx.export(
            model, dynamo=True, opset_version=opset_version, output_names=["out"], optimize=optimize, verbose=False
        )
    else:
        if x is None:
            raise ValueError("to_onnx: a layer needs an example input x (B, L, E); got x=None")
        module = _exportable(model, mask)
        args = (x,) if lengths is None else (x, lengths)
        shapes = dynamic_shapes(
            module, lengths is not None, min_length=min_length, max_length=max_length, dynamic_batch=dynamic_batch
        )
        with warnings.catch_warnings():
            # x's batch and lengths' are one Dim, named once: the exporter says so for the second.
            warnings.filterwarnings("ignore", message=r".*The axis name: \w+ will not be used")
            onnx_program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=opset_version,
                dynamic_shapes=shapes,  # the axes are named B and L in the ONNX model
                output_names=["out"],
                optimize=optimize,
                verbose=False,
            )
    return cast(torch.onnx.ONNXProgram, onnx_program)  # None only for the TorchScript exporter (dynamo=False)


def _exportable(layer: MultiHeadAttention | ExportableAttention, mask: Mask | None) -> ExportableAttention:
    if isinstance(layer, ExportableAttention):
        if mask is not None:
            raise ValueError("export: mask= is given twice, to ExportableAttention and here; give it once")
        return layer
    return ExportableAttention(layer, mask=mask)
