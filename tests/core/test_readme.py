"""The README's quick start runs as written (every claim in the README is one the code makes good)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_quick_start_runs_and_its_comments_hold():
    text = README.read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S)
    assert block, "README has no python quick start block"
    namespace: dict = {}
    exec(compile(block.group(1), str(README), "exec"), namespace)
    # "decode token by token ... one step: sees all 11"
    assert namespace["cache"].length == 11
    y, weights = namespace["y"], namespace["weights"]
    assert y.shape == (2, 1, 512) and weights.shape == (2, 8, 10, 10)
    assert torch.isfinite(namespace["out"]).all()
