"""Shared fixtures of the demo tests: the real MiniLM folder, one loaded encoder, one quick demo run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from multihead.models import SentenceEncoder, find_minilm


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    return find_minilm()


@pytest.fixture(scope="session")
def encoder(minilm_folder) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(minilm_folder)


@pytest.fixture()
def model_copy(minilm_folder, tmp_path) -> Path:
    """A writable copy of the MiniLM folder (the 90 MB weights linked, not copied) to break."""
    copy = tmp_path / "model"
    copy.mkdir()
    for item in minilm_folder.iterdir():
        if item.is_dir():
            shutil.copytree(item, copy / item.name)
        elif item.name == "model.safetensors":
            (copy / item.name).symlink_to(item)
        else:
            shutil.copy(item, copy / item.name)
    return copy


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory):
    """``multihead demo --quick`` run once, in process: ``(exit code, stdout, stderr, out folder)``."""
    import contextlib
    import io

    from multihead.apps.cli import main

    out = tmp_path_factory.mktemp("demo-run") / "multihead-demo"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["demo", "--quick", "--out", str(out), "--no-progress"])
    return code, stdout.getvalue(), stderr.getvalue(), out
