"""The development environment is the lock, and the lock covers what the code imports.

``requirements/lock.txt`` (``make lock``) pins every package ``make setup`` installs but torch,
which ``constraints.txt`` pins to the CPU build; ``pyproject.toml`` keeps the ranges users install
from, and ``requirements/compat/`` records the two environments ``make test-compat`` last passed
with (the lowest release of each range and the newest).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# Imported somewhere in the tree, deliberately in no extra (so in no lock), with the reason.
NOT_LOCKED = {
    "IPython": "Viewer.display() in a notebook, which brings its own IPython",
    "triton": "the triton extra (a 285 MB wheel): locked apart in requirements/triton.txt, `make setup-triton`",
}
# Extras locked apart from requirements/lock.txt, so that `make setup` does not install them.
SEPARATE_LOCKS = {"triton": ROOT / "requirements" / "triton.txt"}
# The extras `make test-compat` installs at both ends of their ranges (check and bench are tools
# of development only: the lock alone pins them).
COMPAT_EXTRAS = ["test", "test-demo", "demo", "viz", "models", "hf", "onnx"]


def pins(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a requirements file of ``name==version`` lines."""
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)", line)
        if m:
            found[canonicalize_name(m[1])] = m[2]
    return found


def torch_pin() -> str:
    (version,) = pins(ROOT / "constraints.txt").values()
    return version


def requirements(extras: list[str] | None = None) -> list[Requirement]:
    """The requirements of the extras named (all of them by default), the build backend's and the tools'."""
    groups = PYPROJECT["project"]["optional-dependencies"]
    out = [Requirement(r) for name in (extras or groups) for r in groups[name]]
    if extras is None:
        out += [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
        tools = (ROOT / "requirements" / "tools.in").read_text(encoding="utf-8").splitlines()
        out += [Requirement(line) for line in tools if line.strip() and not line.startswith("#")]
    return out


def imported_modules() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package, tests, benchmarks and examples -> the
    files importing them: ``import``/``from`` statements (also inside functions) and the names
    passed to ``pytest.importorskip``, ``importlib.import_module`` and ``find_spec``."""
    found: dict[str, set[str]] = {}
    for folder in ["src", "tests", "benchmarks", "examples"]:
        for path in (ROOT / folder).rglob("*.py"):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), where)):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    called = getattr(node.func, "attr", getattr(node.func, "id", None))
                    if called in ("importorskip", "import_module", "find_spec") and isinstance(node.args[0].value, str):
                        names = [node.args[0].value]
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(where)
    return found


def local_modules() -> set[str]:
    """Modules of the tree itself: the package, and the helpers tests and benchmarks import by name."""
    names = {"multihead"}
    for folder in ["tests", "benchmarks", "examples"]:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix == ".py" or (path.is_dir() and "__pycache__" not in path.parts):
                names.add(path.stem)
    return names


def test_every_package_the_code_imports_is_locked():
    """A test, the demo or a benchmark importing a package that no extra brings (so the lock does
    not pin it) passes only where someone installed it by hand: it fails here first."""
    locked = pins(LOCK)
    distributions = importlib.metadata.packages_distributions()
    local = local_modules()
    problems = []
    for module, files in sorted(imported_modules().items()):
        if module in sys.stdlib_module_names or module in local or module in NOT_LOCKED:
            continue
        owners = distributions.get(module)
        if not owners:
            problems.append(
                f"{module} (imported by {sorted(files)[0]}) is not installed: add it to an extra, make lock"
            )
            continue
        for owner in owners:
            name = canonicalize_name(owner)
            if name != "torch" and name not in locked:
                problems.append(f"{module} ({owner}, imported by {sorted(files)[0]}) is not in {LOCK.name}")
    assert not problems, "\n".join(problems)


def test_every_requirement_is_locked_within_its_range():
    """Every extra's requirement, the build backend and the tools are pinned in the lock, at a
    version their range admits (a lock older than a raised floor fails here)."""
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        lock = SEPARATE_LOCKS.get(name, LOCK)
        locked = pins(lock)
        assert name in locked, f"{requirement} is not in {lock.name}: run make lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"{lock.name} pins {name}=={locked[name]}, outside {requirement}: run make lock"
        )


def _inputs():
    """requirements/inputs.py (the lock's digest of its inputs), loaded from its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_inputs", ROOT / "requirements" / "inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_was_made_from_the_current_inputs(monkeypatch, tmp_path):
    """The lock records the digest of what it was made from (pyproject.toml's requirements,
    tools.in, constraints.txt): a range edited without ``make lock`` fails here. Comments and
    order do not count; a changed range does."""
    inputs = _inputs()
    assert inputs.recorded() == inputs.digest(), "the inputs changed since the lock was made: run make lock"
    copy = tmp_path / "root"
    (copy / "requirements").mkdir(parents=True)
    for name in ["pyproject.toml", "constraints.txt", "requirements/tools.in"]:
        (copy / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(inputs, "ROOT", copy)
    same = inputs.digest()
    tools = copy / "requirements" / "tools.in"
    tools.write_text("# a comment\n" + "\n".join(reversed(tools.read_text().splitlines())) + "\n")
    assert inputs.digest() == same
    project = copy / "pyproject.toml"
    project.write_text(project.read_text().replace('"transformers>=5.23,<6"', '"transformers>=5.24,<6"'))
    assert inputs.digest() != same


def test_the_lock_holds_no_cuda_build():
    """torch is resolved as the CPU build of constraints.txt: a CUDA build's packages in the lock
    would be gigabytes of downloads in set-up."""
    cuda = sorted(n for n in pins(LOCK) if n.startswith(("nvidia-", "cuda-")) or n in ("torch", "triton"))
    assert cuda == []
    assert torch_pin().endswith("+cpu")


def test_the_environment_is_the_lock():
    """What is installed is what the lock says (``make setup`` installs it and nothing else): a
    package upgraded by hand, or a lock changed without ``make setup``, fails here."""
    if not Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        pytest.skip(f"not the project's .venv (sys.prefix {sys.prefix}): make setup builds that from the lock")
    wrong = []
    for name, version in pins(LOCK).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "missing"
        if installed == "missing" or Version(installed) != Version(version):
            wrong.append(f"{name}: locked {version}, installed {installed}")
    assert importlib.metadata.version("torch") == torch_pin()
    assert not wrong, "run make setup:\n" + "\n".join(wrong)


@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_the_ranges_are_what_make_test_compat_passed(end):
    """``requirements/compat/{lowest,newest}.txt`` are the environments ``make test-compat`` last
    passed with. The lowest holds every direct requirement of the extras at its range's floor
    (so the floor is a version that was tested, not a guess); the newest inside every range."""
    record = pins(ROOT / "requirements" / "compat" / f"{end}.txt")
    for requirement in requirements(COMPAT_EXTRAS):
        name = canonicalize_name(requirement.name)
        assert name in record, f"{requirement.name} missing from the {end} record: run make test-compat"
        assert requirement.specifier.contains(record[name], prereleases=True), (requirement, record[name])
        if end == "lowest":
            floors = [s.version for s in requirement.specifier if s.operator == ">="]
            assert len(floors) == 1, f"{requirement}: one floor (>=) per range, tested by make compat-lowest"
            assert Version(record[name]) == Version(floors[0]), (
                f"{requirement}: make compat-lowest installed {record[name]}; the floor must be what was tested"
            )


def test_the_tested_versions_are_in_the_docs():
    """``docs/integrations.md`` lists both ends as tested, for the integrations' packages."""
    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    lowest = pins(ROOT / "requirements" / "compat" / "lowest.txt")
    newest = pins(ROOT / "requirements" / "compat" / "newest.txt")
    for name in ["transformers", "onnx", "onnxscript", "onnxruntime", "safetensors", "tokenizers"]:
        row = f"| `{name}` | {lowest[name]} | {newest[name]} |"
        assert row in text, f"docs/integrations.md lacks the row {row!r}"
