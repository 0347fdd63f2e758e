"""Every ```python block of docs/inference.md runs, in order, in one namespace (the page builds
its example layer once and reuses it), and asserts its own claims."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "inference.md"


def test_every_python_block_of_the_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/inference.md [block {i}]", "exec"), namespace)  # noqa: S102 - the page's examples
    assert namespace["cache"].keys.shape[2] == namespace["window"] + 1


def test_the_page_names_every_cache_and_has_its_measurements():
    text = DOC.read_text()
    for name in ("DynamicKVCache", "StaticKVCache", "SlidingWindowKVCache", "generate(", "benchmarks/generate.py"):
        assert name in text, name
    assert "MEASURED_" not in text, "a placeholder for measured numbers is left in the page"
