"""Shared benchmark helpers: the timer, the context line, correctness checks, tables, CSV, plots.

Rules (shared/BENCHMARKS.md): every contender runs in the same process on the same inputs after
a correctness check; ratios are reported because absolute times drift on a shared machine.
"""

from __future__ import annotations

import csv
import os
import platform
import sys
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img"
sys.path.insert(0, str(ROOT / "src"))  # runnable from a fresh clone without installing

import multihead as mh  # noqa: E402

THREADS = int(os.environ.get("BENCH_THREADS", "0")) or min(2, torch.get_num_threads())
torch.set_num_threads(THREADS)


def context() -> str:
    """torch version, threads, machine: printed at the top of every benchmark."""
    return (f"torch {torch.__version__}, {THREADS} threads, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores visible, python {platform.python_version()}")


def time_ms(fn, min_run_time: float = 0.5) -> float:
    """Median milliseconds of ``fn()`` with ``torch.utils.benchmark.Timer.blocked_autorange``."""
    fn()  # warm-up (plans, caches, allocator)
    return Timer("fn()", globals={"fn": fn}, num_threads=THREADS).blocked_autorange(
        min_run_time=min_run_time).median * 1e3


def used_backend(q, k, v, **kw) -> str:
    """The backend ``multihead.attention`` actually runs for these arguments (``explain``)."""
    return mh.explain(q, k, v, **kw).backend


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 2e-4) -> None:
    """Correctness gate before timing: contenders must agree on the same inputs."""
    err = float((got.float() - want.float()).abs().max())
    if not err <= atol:
        raise AssertionError(f"{name}: max abs difference {err:.2e} > {atol:.0e}; not timing a wrong result")


def gflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e9


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)), flush=True)


def write_csv(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path.relative_to(ROOT)}")
    return path


def plot(name: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
         logx: bool = True, logy: bool = True) -> Path | None:
    """A PNG line plot in docs/img/ (matplotlib optional: skipped with a note when absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plot skipped (pip install -e '.[bench]')")
        return None
    IMAGES.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = IMAGES / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)}")
    return path


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return "" if x is None else str(x)
