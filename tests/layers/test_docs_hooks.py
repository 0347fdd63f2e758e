"""Every ```python block of docs/hooks.md runs, in order, in one namespace (the page's sections
build on each other: the layer, the model and the inputs of the first are used by the later
ones); the blocks assert their own claims, and the main ones are re-checked here under -O too."""

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def test_the_page_runs_and_its_claims_hold():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 6
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["seen"]["pattern"].shape == (2, 8, 10, 10)
    assert sorted(namespace["patterns"]) == ["0.pattern", "1.pattern"]
    assert namespace["w"].shape == (1, 1, 1, 512)
    assert "`sliding_window(128)`" in namespace["report"].advice[0]
    assert not torch.allclose(namespace["ablated"], namespace["out"])
    assert namespace["llama_cap"].names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]  # Hugging Face
    assert not torch.allclose(namespace["patched"], namespace["logits"])
    assert torch.equal(namespace["lens"].top_ids[-1, :, 0], namespace["logits"][0].argmax(-1))  # the logit lens
