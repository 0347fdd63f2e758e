"""C sources of multihead's CPU kernels built for this machine, once, by the host's compiler.

A kernel is a C file beside this one (with the headers it includes from here), built with
``cc -O3 -march=native -fopenmp`` into ``$XDG_CACHE_HOME/multihead`` (``~/.cache/multihead``)
under a name that hashes the source and its headers, the flags, the compiler and the CPU: nothing
is rebuilt until one of them changes, and a shared home folder may serve machines of several
kinds. The library is built beside its final name and renamed, so concurrent processes never load
half a file. No dependency, no PyTorch header.
:class:`NativeLibrary` is a kernel's library for the process: built, bound (``ctypes``
signatures, struct mirrors checked) and self-tested once per set of flags, or ``None`` with the
reason (``cpu_kernels``, ``cpu_sparse``, ``cpu_topk``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["FLAGS", "compile_library", "NativeLibrary"]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")


def compile_library(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Compile ``source`` with ``flags`` (or reuse the build of the same source, flags, compiler and
    CPU) and load it. Raises ``RuntimeError`` when no compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH): the PyTorch paths run")
    text = source.read_bytes()
    # the headers it includes from beside it (cpu_vector.h) count as its text: a change rebuilds it
    headers = [(source.parent / name.decode()).read_bytes() for name in re.findall(rb'^#include "([^"]+)"', text, re.M)]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [text, *headers, " ".join(flags).encode(), version.encode(), _cpu().encode()]
    digest = hashlib.sha256(b"\0".join(parts))
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


class NativeLibrary:
    """``source``'s library in this process: :meth:`build` compiles it (:func:`compile_library`) and
    ``bind(lib)`` sets its ``ctypes`` signatures and checks its struct mirrors (raising
    ``RuntimeError``); :meth:`library` also runs ``self_test(lib)`` (raising ``AssertionError``),
    once per set of flags, and gives ``None`` when any step failed, :meth:`unavailable` saying why.
    The callers then run their PyTorch paths: a kernel that is not built, or gives wrong answers,
    is never called."""

    def __init__(self, source: Path, bind: Callable[[ctypes.CDLL], None], self_test: Callable[[ctypes.CDLL], None]):
        self.source, self._bind, self._self_test = source, bind, self_test
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, ...], ctypes.CDLL | None] = {}
        self._why: dict[tuple[str, ...], str] = {}

    def build(self, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
        """The library built with ``flags`` and bound (no self-test): raises when either fails."""
        lib = compile_library(self.source, flags)
        self._bind(lib)
        return lib

    def library(self, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
        """The built, bound and self-tested library, or ``None`` (:meth:`unavailable`)."""
        lib = self._loaded.get(flags, False)
        if lib is not False:
            return lib  # type: ignore[return-value]
        with self._lock:
            if flags not in self._loaded:
                try:
                    lib = self.build(flags)
                    self._self_test(lib)
                    self._loaded[flags] = lib
                except (OSError, RuntimeError, subprocess.SubprocessError, AssertionError) as error:
                    text = str(error).strip()
                    self._why[flags] = text.splitlines()[0] if text else type(error).__name__
                    self._loaded[flags] = None
        return self._loaded[flags]

    def unavailable(self, flags: tuple[str, ...] = FLAGS) -> str | None:
        """Why :meth:`library` is ``None`` (no compiler, a failed build, a failed self-test); ``None``
        if it is not."""
        return None if self.library(flags) is not None else self._why.get(flags, "not built")


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
        return platform.machine() + "\n" + "\n".join(lines)
    except OSError:
        return platform.machine() + platform.processor()
