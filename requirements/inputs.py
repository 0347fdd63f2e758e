"""The inputs a lock is made from, as one digest: the requirement lists of ``pyproject.toml``
(``project.dependencies``, every extra, ``build-system.requires``), the requirements of
``requirements/tools.in`` and the pins of ``constraints.txt``, normalised (comments, order and
spacing do not count).

``python requirements/inputs.py --write`` (``make lock`` runs it after uv) writes the digest under
the lock's header; ``tests/project/test_lock.py`` fails when the inputs change and the lock
is not made again (as Poetry's ``content-hash``): a range edited in ``pyproject.toml`` then needs
``make lock`` before ``make test`` passes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
PREFIX = "# inputs: sha256 "


def _lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8").splitlines()
    return sorted(" ".join(line.split()) for line in text if line.strip() and not line.lstrip().startswith("#"))


def digest() -> str:
    """sha256 of the normalised inputs (hex)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    inputs = {
        "dependencies": sorted(project["project"].get("dependencies", [])),
        "extras": {k: sorted(v) for k, v in sorted(project["project"].get("optional-dependencies", {}).items())},
        "build": sorted(project["build-system"]["requires"]),
        "tools": _lines(ROOT / "requirements" / "tools.in"),
        "constraints": _lines(ROOT / "constraints.txt"),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def recorded() -> str | None:
    """The digest the lock was made from (``None``: none written)."""
    for line in LOCK.read_text(encoding="utf-8").splitlines()[:5]:
        if line.startswith(PREFIX):
            return line[len(PREFIX) :].strip()
    return None


def write() -> None:
    """Put the current digest on the lock's third line, under uv's header."""
    lines = [line for line in LOCK.read_text(encoding="utf-8").splitlines() if not line.startswith(PREFIX)]
    lines.insert(2, PREFIX + digest())  # after uv's two header lines
    LOCK.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(digest())
