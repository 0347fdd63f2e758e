"""The package users install: the wheel and the sdist ``make dist`` builds, the wheel installed
into a clean virtual environment and used from there, not from the source tree.

The clean environment has no packages of its own but the wheel; it reaches the development
environment's torch through a ``.pth`` line (a path entry only: the ``.pth`` files there, among
them the editable install's, are not run), so no torch is installed twice and nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from multihead import __version__

ROOT = Path(__file__).resolve().parents[2]
# What a wheel must carry besides the modules: the viewer's page and scripts, and the type marker.
DATA = ["multihead/py.typed", "multihead/viz/viewer.html", "multihead/viz/viewer.css"] + [
    f"multihead/viz/{name}" for name in ("viewer.js", "viewer_text.js", "viewer_lens.js", "viewer_main.js")
]


def _run(*command: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """``make dist``'s build (the locked setuptools, no build isolation) into a fresh folder."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the build package is not installed (make setup installs it from the lock)")
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT, cwd=out)
    return out


def test_the_wheel_and_the_sdist_carry_the_package_and_its_files(dist):
    (wheel,) = dist.glob("multihead-*.whl")
    (sdist,) = dist.glob("multihead-*.tar.gz")
    assert wheel.name.startswith(f"multihead-{__version__}-") and sdist.name == f"multihead-{__version__}.tar.gz"
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in DATA + ["multihead/__init__.py", "multihead/integrations/hf_closures.py"]:
        assert path in names, f"{path} missing from {wheel.name}"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    entry_points = zipfile.ZipFile(wheel).read(f"multihead-{__version__}.dist-info/entry_points.txt").decode()
    assert "multihead = multihead.apps.cli:main" in entry_points
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for path in ["pyproject.toml", "README.md"] + [f"src/{p}" for p in DATA]:
        assert path in in_sdist, f"{path} missing from {sdist.name}"


def test_the_wheel_installed_in_a_clean_environment_runs(dist, tmp_path):
    """``import multihead``, one attention call against the reference, ``multihead walkthrough``
    and the viewer's page, all from the installed wheel (cwd outside the source tree)."""
    (wheel,) = dist.glob("multihead-*.whl")
    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", env, cwd=tmp_path)
    python = env / "bin" / "python"
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path).stdout.strip()
    )
    (site / "torch-from-dev.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(
        sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path
    )
    script = (
        "import pathlib, torch, multihead as mh\n"
        "print(pathlib.Path(mh.__file__).resolve())\n"
        "q, k, v = (torch.randn(1, 4, 9, 16, dtype=torch.float64) for _ in range(3))\n"
        "out = mh.attention(q, k, v, mask=mh.causal())\n"
        "ref = mh.attention(q, k, v, mask=mh.causal(), backend='reference')\n"
        "torch.testing.assert_close(out, ref)\n"
        "from importlib import resources\n"
        "assert 'canvas' in resources.files('multihead.viz').joinpath('viewer.html').read_text()\n"
        "print(mh.__version__)\n"
    )
    done = _run(python, "-c", script, cwd=tmp_path)
    where, version = done.stdout.split()
    assert Path(where).is_relative_to(env) and not Path(where).is_relative_to(ROOT), where
    assert version == __version__
    walkthrough = _run(env / "bin" / "multihead", "walkthrough", cwd=tmp_path)
    assert "auto order:" in walkthrough.stdout
