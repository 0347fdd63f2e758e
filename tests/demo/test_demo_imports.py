"""Floor-4 modules import their optional dependencies only when used (STYLE.md, "Which way imports run")."""

from __future__ import annotations

import subprocess
import sys


def test_optional_dependencies_are_imported_lazily():
    code = (
        "import sys, multihead, multihead.models, multihead.viz, multihead.apps.demo, multihead.apps.cli, "
        "multihead.apps.walkthrough\n"
        "print(sorted(m for m in ('matplotlib', 'safetensors', 'tokenizers', 'transformers', 'selenium',"
        " 'sentence_transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
