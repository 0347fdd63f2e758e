"""Export: ``torch.export`` of ``MultiHeadAttention`` with a dynamic sequence length, and ONNX run in
``onnxruntime`` (``multihead.integrations.export``, ``docs/integrations.md``).

Every exported graph is traced once, at one example length, and then run at other lengths and
batch sizes (1 included), with rows of length 0 and NaN in the padded positions: each output is
held to the relative rule of ``shared/TESTING.md`` (fp32 against the fp64 reference, at most
``F = 10`` times the error of a naive fp32 computation) and the padded positions must change
nothing. The ONNX graph is inspected: from opset 23 the attention is one ``Attention`` node.

Default tier: one export of the layer itself, one of the padding wrapper, one ONNX program
(about 20 s on an idle machine). ``-m slow``: MHA / GQA / MQA x every mask x opsets 23 and 18.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from onnx import helper

import multihead as mh
from helpers import assert_relative, naive_attention
from multihead.integrations.export import ExportableAttention, export, to_onnx

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
F32 = 10.0  # the rule's factor in fp32 (shared/TESTING.md): fused kernels reorder the sums


# ------------------------------------------------------------------------------ references
def by_hand_cross(layer: mh.MultiHeadAttention, x, kv, dtype):
    """Cross-attention from ``x`` to ``kv`` (batch first), no mask, computed plainly in ``dtype``."""
    return by_hand(layer, x, None, dtype, kv=kv)


def by_hand(layer: mh.MultiHeadAttention, x, mask, dtype, kv=None):
    """The layer computed plainly in ``dtype``: the fp64 oracle (``reference_attention``) or, in
    fp32, the naive baseline (no upcast). ``mask`` is the call's mask object, causality added here."""
    if not layer.batch_first:
        x = x.transpose(0, 1)
    D = layer.head_dim

    def linear(t, proj):
        return F.linear(t.to(dtype), proj.weight.to(dtype), None if proj.bias is None else proj.bias.to(dtype))

    def heads(t, proj, n):
        return linear(t, proj).unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, L, D)

    kv = x if kv is None else kv
    q, k, v = (
        heads(x, layer.q_proj, layer.num_heads),
        heads(kv, layer.k_proj, layer.num_kv_heads),
        heads(kv, layer.v_proj, layer.num_kv_heads),
    )
    if layer.causal:
        mask = mh.causal() if mask is None else mask & mh.causal()
    if dtype == torch.float64:
        out = mh.reference_attention(q, k, v, mask=mask).output
    else:
        out = naive_attention(q, k, v, mask)
    out = linear(out.transpose(1, 2).flatten(2), layer.out_proj)  # (B, L, E)
    return out if layer.batch_first else out.transpose(0, 1)


def padded_inputs(B, L, E, gen, *, zero_row=True, batch_first=True):
    """``x`` with NaN at every padded position, and ``lengths`` (one row of length 0 if asked)."""
    x = torch.randn(B, L, E, generator=gen)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    lengths[-1] = L  # a full row
    if zero_row and B > 1:
        lengths[0] = 0
    x = x.masked_fill((torch.arange(L) >= lengths[:, None])[..., None], float("nan"))
    return (x if batch_first else x.transpose(0, 1)), lengths


def check_padded(layer, out, x, lengths, extra_mask=None):
    """``out`` for ``x`` whose padded positions hold NaN: the real rows by the relative rule (NaN
    there would mean a padded key leaked), and a row of length 0 equal to ``out_proj``'s bias
    (its attention output is 0: the convention for rows that see no key)."""
    out = torch.as_tensor(out)
    clean = torch.nan_to_num(x, nan=0.0)
    mask = mh.key_padding(lengths) if extra_mask is None else extra_mask & mh.key_padding(lengths)
    ref, base = by_hand(layer, clean, mask, torch.float64), by_hand(layer, clean, mask, torch.float32)
    if not layer.batch_first:
        out, ref, base = (t.transpose(0, 1) for t in (out, ref, base))  # (B, L, E)
    real = torch.arange(out.shape[1]) < lengths[:, None]  # (B, L)
    assert_relative(out[real], ref[real], base[real], F32, "real rows")
    for b in range(len(lengths)):
        if lengths[b] == 0:
            torch.testing.assert_close(out[b], layer.out_proj.bias.detach().expand_as(out[b]), rtol=0, atol=1e-6)


def ort_session(model_proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ops(model_proto) -> collections.Counter:
    """Node types of the graph and of the functions it calls."""
    nodes = list(model_proto.graph.node) + [n for f in model_proto.functions for n in f.node]
    return collections.Counter(n.op_type for n in nodes)


def attention_node(model_proto):
    (node,) = [n for n in model_proto.graph.node if n.op_type == "Attention"]
    return node, {a.name: helper.get_attribute_value(a) for a in node.attribute}


def opset(model_proto) -> int:
    return next(o.version for o in model_proto.opset_import if o.domain in ("", "ai.onnx"))


# ------------------------------------------------------------------------------ default tier
def test_torch_export_of_the_causal_layer_itself_runs_at_every_length():
    """``torch.export.export(layer, (x,), dynamic_shapes=...)`` with a ``Dim`` for the length: the
    layer's own ``causal=True`` needs no wrapper. Traced at 9 tokens, run at 1, 13 and 40."""
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True).eval()
    L = torch.export.Dim("L", min=1, max=1024)
    program = torch.export.export(layer, (torch.randn(2, 9, 32),), dynamic_shapes=({1: L},))
    run = program.module()
    for n in (1, 13, 40):
        x = torch.randn(2, n, 32)
        out = run(x)
        assert out.shape == (2, n, 32)
        assert_relative(
            out, by_hand(layer, x, None, torch.float64), by_hand(layer, x, None, torch.float32), F32, f"L={n}"
        )
        # a causal output row depends on no later token
        later = x.clone()
        later[:, n // 2 + 1 :] = 0.5
        torch.testing.assert_close(run(later)[:, : n // 2 + 1], out[:, : n // 2 + 1])


def test_torch_export_with_padding_lengths_as_an_input():
    """The padding mask enters as ``lengths (B,)``, a tensor input; batch and length are both
    dynamic. Padded positions hold NaN, one row has length 0."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True).eval()
    program = export(layer, torch.randn(2, 9, 32), lengths=torch.tensor([9, 5]))
    assert [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == ["x", "lengths"]
    run = program.module()
    for B, n in ((1, 1), (3, 17), (4, 40)):
        x, lengths = padded_inputs(B, n, 32, gen)
        check_padded(layer, run(x, lengths), x, lengths)


@pytest.fixture(scope="module")
def page() -> dict:
    """The ``Export and ONNX`` section of docs/integrations.md, its python blocks run in order in one
    namespace (they assert their own claims): a GQA causal layer, its program with ``lengths``, and
    that program in ONNX, run in onnxruntime."""
    text = DOC.read_text()
    section = text[text.index("## Export and ONNX") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/integrations.md: the Export section has no python block"
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/integrations.md [Export and ONNX, block {i}]", "exec"), namespace)  # noqa: S102
    return namespace


def test_onnx_program_is_one_attention_node_and_matches_in_onnxruntime(page):
    """The page's ``to_onnx(program)`` at opset 23: SDPA becomes ONNX's ``Attention`` (GQA's 2 KV
    heads passed as they are, the padding as its mask input, no ``Softmax`` written out), and
    onnxruntime's outputs at other batch sizes and lengths follow the relative rule."""
    gen = torch.Generator().manual_seed(2)
    layer, model = page["layer"], page["onnx_program"].model_proto
    assert (layer.num_heads, layer.num_kv_heads, layer.causal) == (8, 2, True)
    assert opset(model) == 23
    counts = ops(model)
    assert counts["Attention"] == 1 and counts["Softmax"] == 0, counts
    node, attrs = attention_node(model)
    assert len(node.input) >= 4 and node.input[3], "the padding mask is the Attention node's mask input"
    assert attrs.get("is_causal", 0) == 0  # causal & padding arrive as one materialized mask
    assert [i.name for i in model.graph.input] == ["x", "lengths"]
    assert [o.name for o in model.graph.output] == ["out"]
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim[:2]]
    assert all(dims), f"batch and length are symbolic: {dims}"
    session = ort_session(model)
    for B, n in ((1, 1), (3, 23)):
        x, lengths = padded_inputs(B, n, 64, gen)
        (out,) = session.run(None, {"x": x.numpy(), "lengths": lengths.numpy()})
        check_padded(layer, out, x, lengths)


BAD = [
    (
        lambda: ExportableAttention(torch.nn.MultiheadAttention(8, 2)),
        TypeError,
        r"layer must be a multihead.MultiHeadAttention, got MultiheadAttention.*from_torch",
    ),
    (
        lambda: ExportableAttention(mh.MultiHeadAttention(8, 2), mask="causal"),
        TypeError,
        r"mask must be a multihead mask object or None, got str",
    ),
    (
        lambda: export(
            ExportableAttention(mh.MultiHeadAttention(8, 2), mask=mh.causal()), torch.randn(1, 3, 8), mask=mh.causal()
        ),
        ValueError,
        r"mask= is given twice",
    ),
    (lambda: to_onnx(mh.MultiHeadAttention(8, 2)), ValueError, r"a layer needs an example input x"),
    (
        lambda: to_onnx(torch.export.export(torch.nn.Identity(), (torch.zeros(1),)), torch.zeros(1)),
        ValueError,
        r"an ExportedProgram is converted as it was exported",
    ),
]


@pytest.mark.parametrize(
    "make, error, message",
    BAD,
    ids=["not-a-layer", "mask-not-a-mask", "mask-twice", "onnx-without-x", "onnx-program-and-x"],
)
def test_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


# ------------------------------------------------------------------------------ slow tier
MASKS = {  # name: (layer causal, fixed mask, padding lengths as an input)
    "causal": (True, None, False),
    "padding": (False, None, True),
    "causal+padding": (True, None, True),
    "window+padding": (False, lambda: mh.sliding_window(3), True),
    "causal&window": (False, lambda: mh.causal() & mh.sliding_window(4), False),
}
HEADS = [(4, 4, 8), (8, 2, 6), (6, 1, 7)]  # (Hq, Hkv, D): MHA, GQA, MQA; odd head dims
SLOW = [(h, m, 23, True) for h in HEADS for m in MASKS] + [
    ((8, 2, 6), "causal+padding", 18, True),
    ((4, 4, 8), "causal", 18, True),
    ((8, 2, 6), "padding", 23, False),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads, mask_name, opset_version, batch_first",
    SLOW,
    ids=[f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}-{m}-opset{o}" + ("" if bf else "-seq_first") for h, m, o, bf in SLOW],
)
def test_export_and_onnx_matrix(heads, mask_name, opset_version, batch_first):
    Hq, Hkv, D = heads
    E = Hq * D
    causal, fixed, padded = MASKS[mask_name]
    fixed = None if fixed is None else fixed()
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    layer = mh.MultiHeadAttention(E, Hq, num_kv_heads=Hkv, causal=causal, batch_first=batch_first).eval()
    example = torch.randn(2, 11, E) if batch_first else torch.randn(11, 2, E)
    program = to_onnx(
        layer, example, lengths=torch.tensor([11, 4]) if padded else None, mask=fixed, opset_version=opset_version
    )
    model = program.model_proto
    counts = ops(model)
    assert opset(model) == opset_version
    if opset_version >= 23:
        assert counts["Attention"] == 1 and counts["Softmax"] == 0, counts
        _, attrs = attention_node(model)
        # a bare causal diagonal is passed as is_causal=1, with no mask tensor
        assert bool(attrs.get("is_causal", 0)) == (mask_name == "causal"), attrs
    else:
        assert counts["Attention"] == 0 and counts["Softmax"] == 1, counts
    session = ort_session(model)
    run = program.exported_program.module()
    for B, n in ((1, 1), (3, 5), (2, 29)):
        if padded:
            x, lengths = padded_inputs(B, n, E, gen, batch_first=batch_first)
            feeds = {"x": x.numpy(), "lengths": lengths.numpy()}
            (out,) = session.run(None, feeds)
            check_padded(layer, out, x, lengths, fixed)
            check_padded(layer, run(x, lengths), x, lengths, fixed)
        else:
            x = torch.randn(B, n, E, generator=gen)
            x = x if batch_first else x.transpose(0, 1)
            (out,) = session.run(None, {"x": x.numpy()})
            ref, base = by_hand(layer, x, fixed, torch.float64), by_hand(layer, x, fixed, torch.float32)
            assert_relative(torch.from_numpy(out), ref, base, F32, f"onnxruntime B={B} L={n}")
            assert_relative(run(x), ref, base, F32, f"exported program B={B} L={n}")


@pytest.mark.slow
def test_the_layer_itself_exports_a_bool_mask_tensor_and_cross_attention():
    """What docs/integrations.md says exports without the wrapper: a bool mask tensor as the
    layer's ``mask=`` input (dynamic in both lengths) and cross-attention with its own key length."""
    torch.manual_seed(4)
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    L, S = torch.export.Dim("L", min=1, max=1024), torch.export.Dim("S", min=1, max=1024)
    x = torch.randn(2, 9, 32)
    masked = torch.export.export(
        layer,
        (x,),
        kwargs={"mask": torch.rand(2, 1, 9, 9) > 0.3},
        dynamic_shapes={"query": {1: L}, "mask": {2: L, 3: L}},
    ).module()
    cross = torch.export.export(
        layer, (x, torch.randn(2, 7, 32)), dynamic_shapes={"query": {1: L}, "key": {1: S}}
    ).module()
    for n, s in ((1, 5), (13, 30)):
        x2, kv = torch.randn(2, n, 32), torch.randn(2, s, 32)
        m = torch.rand(2, 1, n, n) > 0.3
        m[..., 0] = True  # no row without a key (the naive baseline's convention is checked elsewhere)
        ref, base = (
            by_hand(layer, x2, mh.masks.as_mask(m), torch.float64),
            by_hand(layer, x2, mh.masks.as_mask(m), torch.float32),
        )
        assert_relative(masked(x2, mask=m), ref, base, F32, f"bool mask L={n}")
        ref, base = by_hand_cross(layer, x2, kv, torch.float64), by_hand_cross(layer, x2, kv, torch.float32)
        assert_relative(cross(x2, kv), ref, base, F32, f"cross L={n} S={s}")
