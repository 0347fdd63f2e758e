"""Export and ONNX: the cost of exporting, and one layer's forward in onnxruntime against PyTorch.

    .venv/bin/python benchmarks/export.py [--quick]

One ``MultiHeadAttention`` (E=256, Hq=8, Hkv=2, causal), exported once at 10 tokens through
``multihead.integrations.export`` and run at B=4, L=512 (rows of 512, 300, 100 and 1 real tokens
with padding): the eager layer, the ``torch.export`` program and the ONNX model in onnxruntime, at
opsets 23 (one ``Attention`` node) and 18 (``MatMul``/``Softmax``). One thread each; times are the
least process CPU time of a few calls (a shared machine's load inflates wall time, not CPU time).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch

import multihead
from multihead.integrations.export import export, to_onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import context  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def least_cpu_ms(fn, calls: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        start = cpu_s()
        fn()
        times.append(cpu_s() - start)
    return min(times) * 1e3


def main(argv=None) -> dict:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 calls per timing instead of 7")
    args = parser.parse_args(argv)
    calls = 3 if args.quick else 7
    torch.set_num_threads(1)
    print(f"# export and ONNX: {context()}; load {os.getloadavg()[0]:.1f}")
    print(f"# torch and onnxruntime on one thread here; least process CPU ms of {calls} calls")
    torch.manual_seed(0)
    layer = multihead.MultiHeadAttention(256, 8, num_kv_heads=2, causal=True).eval()
    x, lengths = torch.randn(4, 512, 256), torch.tensor([512, 300, 100, 1])
    print("| mask | opset | export (CPU s) | to ONNX (CPU s) | onnxruntime ms | exported program ms | eager ms |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, padded in (("causal", False), ("causal & padding", True)):
        example = (torch.randn(2, 10, 256), torch.tensor([10, 6]) if padded else None)
        start = cpu_s()
        program = export(layer, example[0], lengths=example[1])
        export_s = cpu_s() - start
        run = program.module()
        inputs = (x, lengths) if padded else (x,)
        mask = multihead.key_padding(lengths) if padded else None
        with torch.no_grad():
            eager = least_cpu_ms(lambda: layer(x, mask=mask), calls)
            exported = least_cpu_ms(lambda: run(*inputs), calls)
        for opset in (23, 18):
            start = cpu_s()
            model = to_onnx(program, opset_version=opset).model_proto
            convert_s = cpu_s() - start
            options = ort.SessionOptions()
            options.intra_op_num_threads = options.inter_op_num_threads = 1
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
            onnx_ms = least_cpu_ms(lambda: session.run(None, feeds), calls)
            results[(name, opset)] = onnx_ms / eager
            row = [
                name,
                opset,
                f"{export_s:.1f}",
                f"{convert_s:.1f}",
                f"{onnx_ms:.1f}",
                f"{exported:.1f}",
                f"{eager:.1f}",
            ]
            print("| " + " | ".join(map(str, row)) + " |")
    return results


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"({time.time() - started:.0f} s)")
