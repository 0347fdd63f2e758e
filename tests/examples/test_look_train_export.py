"""The examples in ``examples/`` run, at their quick settings, and do what their docstrings say
(issue 32, item 3): each script's ``main(argv)`` is called in-process and its result checked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import optional

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_look_and_patch(tmp_path):
    optional("transformers", "the example runs a Hugging Face model (extra 'hf')", minversion="5.23")
    out = tmp_path / "attention.html"
    found = example("hf_look_and_patch").main(["--out", str(out)])
    assert len(found["points"]) == 36 and found["points"][0] == "encoder.layer.0.attention.self.q"
    assert found["names"][5] == "encoder.layer.5.attention.self"
    # the demo's finding (docs/demo.md, tests/demo/test_findings.py): layer 5, head 11 sends "it" to "cat"
    assert found["top"] == "cat" and found["top_weight"] > 0.5
    assert found["change"] > 0.01  # the ablation changes the output ...
    assert found["mismatch"] < 1e-5  # ... exactly as zeroing the head's columns of the projection does
    page = out.read_text(encoding="utf-8")
    assert "encoder.layer.5.attention.self" in page and '"highlight"' in page


def test_train_causal_lm_learns_to_copy():
    result = example("train_causal_lm").main(["--quick"])
    losses = result["losses"]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.25 * losses[0], losses[::10]  # chance is ln(16) ~ 2.8
    assert result["accuracy"] > 0.9
    assert result["generated"].shape == (1, 8)  # generate returns the new tokens only
    assert torch.equal(result["generated"][0], result["prompt"][0, :8])  # the copy
    assert (result["looked"] == 0).any()  # at the separator, a head looks at the first symbol


def test_export_onnx(tmp_path):
    optional("onnxruntime", "the example runs the ONNX file (extra 'onnx')")
    result = example("export_onnx").main(["--out", str(tmp_path / "layer.onnx")])
    assert (tmp_path / "layer.onnx").stat().st_size > 0
    assert result["ops"]["Attention"] == 1
    for (B, L), err in result["errors"].items():
        assert err < 1e-4, f"onnxruntime vs the layer at B={B}, L={L}: {err}"


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_speculative_tree_equals_greedy_decoding_in_fewer_calls():
    result = example("speculative_tree").main(["--quick"])
    assert result["tokens"] == result["greedy"] and len(result["tokens"]) == 24
    assert result["rounds"] < 24 and result["accepted"] > 0  # drafts accepted: fewer target calls than tokens
