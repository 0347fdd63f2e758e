"""Shared benchmark helpers: the timer, the context line, correctness checks, tables, CSV, plots.

Rules (shared/BENCHMARKS.md): every contender runs in the same process on the same inputs after
a correctness check; ratios are reported because absolute times drift on a shared machine.
"""

from __future__ import annotations

import copy
import csv
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img"  # plots land here only when asked (--update-docs): the files are tracked
sys.path.insert(0, str(ROOT / "src"))  # runnable from a fresh clone without installing

import multihead as mh  # noqa: E402

THREADS = int(os.environ.get("BENCH_THREADS", "0")) or min(2, torch.get_num_threads())
torch.set_num_threads(THREADS)


def context() -> str:
    """torch version, threads, machine: printed at the top of every benchmark."""
    return (
        f"torch {torch.__version__}, {THREADS} threads, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores visible, python {platform.python_version()}"
    )


def machine_state() -> str:
    """Load average and runnable tasks (``/proc/loadavg``): what "idle" meant for this run."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        runnable = Path("/proc/loadavg").read_text().split()[3].split("/")[0]  # includes this process
    except (OSError, IndexError):
        runnable = "?"
    return f"load average {load} (1/5/15 min), {runnable} runnable now, {os.cpu_count()} cores"


def last_level_cache_bytes() -> int | None:
    """Size of the largest (last-level) CPU cache seen by cpu0, from sysfs; ``None`` if unknown.
    On a VM this is the host's shared cache, of which this machine gets an unknown share."""
    sizes = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


def memory_read_gbps(min_bytes: int = 256 << 20, min_run_time: float = 0.3) -> float:
    """Memory read bandwidth in GB/s: ``x.sum()`` over an fp32 tensor at least twice the
    last-level cache (so that it streams from memory), timed like everything else."""
    llc = last_level_cache_bytes() or 0
    nbytes = min(max(min_bytes, 2 * llc), 1 << 30)
    x = torch.ones(nbytes // 4)
    seconds = (
        Timer("x.sum()", globals={"x": x}, num_threads=THREADS).blocked_autorange(min_run_time=min_run_time).median
    )
    return nbytes / seconds / 1e9


# A child that keeps one core busy until it is killed: a pure-Python integer loop ("python") or
# single-threaded 256x256 fp32 matmuls ("torch", which also uses caches and memory bandwidth);
# or ONE child that keeps every core busy with 512x512 fp32 matmuls on as many threads as there
# are cores ("torch-threads": another PyTorch job, whose OpenMP threads contend with ours).
_LOAD_CHILD = {
    "python": "print('ready', flush=True)\nx = 0\nwhile True:\n    x = (x + 1) & 0xFFFF",
    "torch": (
        "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nprint('ready', flush=True)\n"
        "while True:\n    b = a @ a"
    ),
    "torch-threads": (
        f"import torch\ntorch.set_num_threads({os.cpu_count() or 1})\na = torch.randn(512, 512)\n"
        "print('ready', flush=True)\nwhile True:\n    b = a @ a"
    ),
}
#: The kinds of load :func:`background_load` starts (``--load`` of the benchmarks).
LOAD_KINDS = tuple(_LOAD_CHILD)


@contextmanager
def background_load(kind: str = "python", procs: int | None = None):
    """Keep every core busy in ``procs`` child processes for the duration of the ``with`` block, as
    other users of a shared machine do (default: one child per core, or one multi-threaded child
    for ``"torch-threads"``); the children are killed on exit, also on error. Yields a dict that,
    after the block, holds ``load_cpu``: the cores the children actually used on average (e.g.
    1.4 of 2 while the benchmark competed with them)."""
    procs = procs or (1 if kind == "torch-threads" else os.cpu_count() or 1)
    children = [
        subprocess.Popen([sys.executable, "-c", _LOAD_CHILD[kind]], stdout=subprocess.PIPE, text=True)
        for _ in range(procs)
    ]
    report = {"kind": kind, "procs": procs}
    try:
        for child in children:
            child.stdout.readline()  # "ready": the loop is running
        start, ticks0 = time.perf_counter(), sum(_cpu_ticks(c.pid) for c in children)
        yield report
        elapsed = time.perf_counter() - start
        used = (sum(_cpu_ticks(c.pid) for c in children) - ticks0) / os.sysconf("SC_CLK_TCK")
        report["load_cpu"] = used / elapsed if elapsed > 0 else float("nan")
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()
            child.stdout.close()


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process in clock ticks (``/proc/<pid>/stat`` fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def time_ms(fn, min_run_time: float = 0.5) -> float:
    """Median milliseconds of ``fn()`` with ``torch.utils.benchmark.Timer.blocked_autorange``."""
    fn()  # warm-up (plans, caches, allocator)
    return (
        Timer("fn()", globals={"fn": fn}, num_threads=THREADS).blocked_autorange(min_run_time=min_run_time).median * 1e3
    )


def fastest_ms(fns: dict, rounds: int, min_run_time: float = 0.5, log=None, threads: int = THREADS) -> dict:
    """Milliseconds of each ``fns[key]()``: the fastest of ``rounds`` interleaved rounds, each round
    the median of a ``blocked_autorange``. Every contender is warmed up once first. On a shared
    machine, other processes come and go; interleaving spreads them over all contenders, and since
    they only ever add time, the fastest round is each contender's least disturbed one.
    ``log(key, ms)`` is called after every measurement."""
    for fn in fns.values():
        fn()
    best = {key: float("inf") for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            ms = (
                Timer("fn()", globals={"fn": fn}, num_threads=threads)
                .blocked_autorange(min_run_time=min_run_time)
                .median
                * 1e3
            )
            best[key] = min(best[key], ms)
            if log is not None:
                log(key, ms)
    return best


def cpu_ms(fns: dict, rounds: int, calls: int = 1, warmup: bool = True) -> dict:
    """Milliseconds of process CPU time per ``fns[key]()`` on one thread: the fastest of ``rounds``
    interleaved rounds of ``calls`` calls each (every contender warmed up once first, unless
    ``warmup=False``). Process time counts this process alone, so other engineers' load, which
    only adds, moves it less than the wall clock; the threads are ``THREADS`` again afterwards."""
    torch.set_num_threads(1)
    try:
        if warmup:
            for fn in fns.values():
                fn()
        best = {key: float("inf") for key in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                start = time.process_time()
                for _ in range(calls):
                    fn()
                best[key] = min(best[key], (time.process_time() - start) / calls * 1e3)
        return best
    finally:
        torch.set_num_threads(THREADS)


def layer_passes(layers: dict, x: torch.Tensor, backward: bool = True) -> dict:
    """``{(name, "forward"): fn, ...}`` for each layer: a forward of ``x`` without autograd, and with
    ``backward`` a forward and backward of a copy of ``x`` that requires grad (every forward first)."""
    xg = x.clone().requires_grad_()

    def forward(layer):
        def fn():
            with torch.no_grad():
                layer(x)

        return fn

    def training(layer):
        def fn():
            layer(xg).sum().backward()

        return fn

    fns = {(name, "forward"): forward(layer) for name, layer in layers.items()}
    if backward:
        fns |= {(name, "forward+backward"): training(layer) for name, layer in layers.items()}
    return fns


def check_layers(layers: dict, x: torch.Tensor, atol: float = 1e-4) -> None:
    """Each layer in its dtype against a float64 copy of itself on the same input."""
    with torch.no_grad():
        for name, layer in layers.items():
            check_close(name, layer(x), copy.deepcopy(layer).double()(x.double()), atol=atol)


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


def plot(
    name: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list, list]],
    logx: bool = True,
    logy: bool = True,
    *,
    update_docs: bool = False,
) -> Path | None:
    """A PNG line plot in ``benchmarks/results/`` (untracked), or in ``docs/img/`` with
    ``update_docs`` (a benchmark's ``--update-docs``: replaces the figure the docs show).
    matplotlib is optional: the plot is skipped with a note when it is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plot skipped (pip install -e '.[bench]')")
        return None
    folder = IMAGES if update_docs else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
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
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {_shown(path)}")
    return path


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return "" if x is None else str(x)


def speed_words(ratio: float, than: str) -> str:
    """``ratio`` = their time / ours, said the way it reads: ``"1.59x faster than X"`` at or above
    1, ``"1.59x slower than X"`` below (1 / ratio), never ``"0.63x faster"``."""
    if ratio >= 1:
        return f"{ratio:.2f}x faster than {than}"
    return f"{1 / ratio:.2f}x slower than {than}"


#: The decode backend with multihead's CPU kernel off, by name (:func:`torch_gemms_backend`).
GEMMS_BACKEND = "decode-torch-gemms"


def torch_gemms_backend() -> str:
    """Register, once, the decode backend with its CPU kernel off (``kernel="torch"``: the fold's
    PyTorch GEMMs, what runs without a C compiler) under :data:`GEMMS_BACKEND`, never chosen by
    ``auto``, so that one run times both; returns the name to pass as ``backend=``."""
    from multihead.backends.decode import DecodeBackend

    class _DecodeWithGemms(DecodeBackend):
        name = GEMMS_BACKEND

        def __init__(self):
            super().__init__(kernel="torch")

    if GEMMS_BACKEND not in mh.available_backends():
        mh.register_backend(_DecodeWithGemms(), priority=None)
    return GEMMS_BACKEND
