"""The public surface's habits: one version everywhere, a docstring on every exported name, and
shapes in the notation of :mod:`multihead.conventions` on the entry points that take tensors."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import multihead

ROOT = Path(__file__).resolve().parents[2]

# The packages whose ``__all__`` is public API (floor 4's load on first use, but are public too).
PACKAGES = [
    "multihead",
    "multihead.masks",
    "multihead.scores",
    "multihead.positions",
    "multihead.caches",
    "multihead.layers",
    "multihead.backends",
    "multihead.distributed",
    "multihead.models",
    "multihead.viz",
]

# A shape in the conventions' notation: a parenthesised tuple of at least two dimensions among
# B, H, Hq, Hkv, L, Lq, Lk, S, T, D, Dv, E, ... e.g. ``(B, Hq, Lq, D)``.
SHAPE = re.compile(r"\((?:B|Hq|Hkv|H|L|Lq|Lk|S|T)\b\s*,[^\n]*\)")

# The entry points that take or return attention tensors: their docstrings (the class's or its
# forward's / update's) must name the shapes.
SHAPED = [
    "multihead.attention",
    "multihead.reference_attention",
    "multihead.merge_partials",
    "multihead.cascade_attention",
    "multihead.capture_attention",
    "multihead.MultiHeadAttention",
    "multihead.MultiHeadLatentAttention",
    "multihead.compat.MultiheadAttention",
    "multihead.caches.KVCache",
    "multihead.caches.CacheRead",
    "multihead.caches.DynamicKVCache",
    "multihead.caches.StaticKVCache",
    "multihead.caches.SlidingWindowKVCache",
    "multihead.caches.PagedKVCache",
    "multihead.caches.LatentKVCache",
    "multihead.masks.Mask",
    "multihead.masks.key_padding",
    "multihead.masks.document",
    "multihead.scores.bias",
    "multihead.positions.apply_rotary",
    "multihead.positions.RotaryEmbedding",
    "multihead.distributed.ring_attention",
    "multihead.distributed.ulysses_attention",
]


def _exported() -> list[tuple[str, str, object]]:
    found, seen = [], set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            found.append((package, name, obj))
    return found


def _own_doc(obj: object) -> str:
    """The object's own docstring (a class inheriting ``object``'s or a data value's does not count)."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__") or ""
    if inspect.ismodule(obj) or inspect.isroutine(obj):
        return obj.__doc__ or ""
    return ""


def _documented_by_value(obj: object) -> bool:
    # Constants (kind names, the auto order, layouts) are data: their meaning is in the module's docstring.
    return not (inspect.isclass(obj) or inspect.ismodule(obj) or inspect.isroutine(obj))


@pytest.mark.parametrize("package,name,obj", [pytest.param(*e, id=f"{e[0]}.{e[1]}") for e in _exported()])
def test_every_exported_name_has_a_docstring(package, name, obj):
    if _documented_by_value(obj):
        return
    assert _own_doc(obj).strip(), f"{package}.{name} has no docstring"


def _public_methods(cls: type):
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        if inspect.isfunction(func):
            yield name, attr, func


def _inherited_doc(cls: type, name: str) -> str:
    for base in cls.__mro__[1:]:
        if name in vars(base):
            attr = vars(base)[name]
            func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if getattr(func, "__doc__", None):
                return func.__doc__
    return ""


def test_every_public_method_of_an_exported_class_has_a_docstring():
    missing = []
    for _package, _name, obj in _exported():
        if not inspect.isclass(obj) or not obj.__module__.startswith("multihead"):
            continue
        for method, _attr, func in _public_methods(obj):
            if not (func.__doc__ or "").strip() and not _inherited_doc(obj, method).strip():
                missing.append(f"{obj.__module__}.{obj.__qualname__}.{method}")
    assert not missing, "public methods without a docstring (an override inherits its base's):\n" + "\n".join(missing)


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", SHAPED)
def test_entry_points_name_their_shapes(path):
    obj = _resolve(path)
    docs = [_own_doc(obj)]
    if inspect.isclass(obj):
        docs += [(vars(obj)[m].__doc__ or "") for m in ("forward", "update", "__init__") if m in vars(obj)]
    text = "\n".join(docs)
    assert SHAPE.search(text), f"{path}: no shape like (B, Hq, Lq, D) in its docstring"


# ----------------------------------------------------------------------------------- version
def _pyproject_version_source() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text, "pyproject.toml should read the version from multihead/_version.py"
    match = re.search(r'^version\s*=\s*\{\s*attr\s*=\s*"([\w.]+)"\s*\}', text, re.M)
    assert match, "pyproject.toml: [tool.setuptools.dynamic] version = { attr = ... } is missing"
    assert not re.search(r'^version\s*=\s*"', text, re.M), "pyproject.toml writes a version of its own"
    return match.group(1)


def test_the_version_is_written_once_and_reported_everywhere():
    source = _pyproject_version_source()
    module, _, attr = source.rpartition(".")
    written = getattr(importlib.import_module(module), attr)
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[.-]?(?:a|b|rc|dev|post)\d+)?", written), written
    assert multihead.__version__ == written
    assert metadata.version("multihead") == written, "installed metadata is stale: re-run `make setup`"
    out = subprocess.run([sys.executable, "-m", "multihead", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"multihead {written}"


def test_the_changelog_has_an_entry_for_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(multihead.__version__)}\]", changelog, re.M), (
        f"CHANGELOG.md has no '## [{multihead.__version__}]' section"
    )
