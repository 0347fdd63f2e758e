"""Export a `multihead` attention layer to ONNX and run it in onnxruntime.

    python examples/export_onnx.py                   # writes attention.onnx
    python examples/export_onnx.py --out /tmp/layer.onnx

A GQA causal layer (8 query heads, 2 key/value heads) is exported once with ``torch.export`` from
one example input, with the padding of each row as a second input (``lengths``: a `multihead` mask
object cannot be a graph input, so ``key_padding(lengths)`` is built inside the graph), converted
to ONNX at opset 23, where the attention is one ``Attention`` node, saved, and run in onnxruntime
at other batch sizes and lengths than the example's; each output is compared with the layer's
own. ``pip install "multihead[onnx]"`` brings onnx, onnxscript and onnxruntime; ``docs/integrations.md``
("Export and ONNX") explains how the mask travels.

``main()`` returns the graph's operator counts and the errors, so
``tests/examples/test_look_train_export.py`` can check them.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import multihead as mh  # noqa: E402
from multihead.integrations.export import export, to_onnx  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.onnx", help="where to write the ONNX model")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(64, 8, num_kv_heads=2, causal=True).eval()
    x, lengths = torch.randn(2, 10, 64), torch.tensor([10, 6])  # an example: (B, L, E) and real tokens per row

    program = export(layer, x, lengths=lengths)  # torch.export.ExportedProgram: B and L stay dynamic
    onnx_program = to_onnx(program)  # opset 23: the attention is one Attention node
    onnx_program.save(args.out)
    model = onnx_program.model_proto
    ops = collections.Counter(n.op_type for n in list(model.graph.node) + [n for f in model.functions for n in f.node])
    inputs = [i.name for i in model.graph.input]
    print(f"wrote {args.out}: {len(model.graph.node)} nodes, Attention x{ops['Attention']}, inputs {inputs}")

    session = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    errors = {}
    for B, L in ((1, 1), (3, 37), (4, 128)):  # other batch sizes and lengths than the example's
        x = torch.randn(B, L, 64)
        lengths = torch.randint(1, L + 1, (B,))
        (out,) = session.run(None, {"x": x.numpy(), "lengths": lengths.numpy()})
        with torch.no_grad():
            expected = layer(x, mask=mh.key_padding(lengths))  # the layer itself, causal & the padding
        real = torch.arange(L) < lengths[:, None]  # padded query rows are not compared
        errors[B, L] = float((torch.from_numpy(out) - expected)[real].abs().max())
        print(f"B={B} L={L}: onnxruntime vs the layer, max |difference| {errors[B, L]:.1e}")
    return {"ops": ops, "errors": errors}


if __name__ == "__main__":
    main()
