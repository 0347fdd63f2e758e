"""C sources of multihead's CPU kernels built for this machine, once, by the host's compiler.

A kernel is a C file beside this one, built with ``cc -O3 -march=native -fopenmp`` into
``$XDG_CACHE_HOME/multihead`` (``~/.cache/multihead``) under a name that hashes the source, the
flags, the compiler and the CPU: nothing is rebuilt until one of them changes, and a shared home
folder may serve machines of several kinds. The library is built beside its final name and
renamed, so concurrent processes never load half a file. No dependency, no PyTorch header.
Callers (``cpu_kernels``) load the library with ``ctypes``, check it and self-test it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["FLAGS", "compile_library"]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")


def compile_library(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Compile ``source`` with ``flags`` (or reuse the build of the same source, flags, compiler and
    CPU) and load it. Raises ``RuntimeError`` when no compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH): the PyTorch paths run")
    text = source.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), version.encode(), _cpu().encode()]))
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    path = folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # built beside its final name and renamed: a process that loads it never sees half a file
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as part:
            partial = Path(part.name)
        try:
            done = subprocess.run(
                [compiler, *flags, str(source), "-o", str(partial), "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise RuntimeError(f"building {source.name} failed: {done.stderr.strip()[:2000]}")
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return ctypes.CDLL(str(path))


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
        return platform.machine() + "\n" + "\n".join(lines)
    except OSError:
        return platform.machine() + platform.processor()
