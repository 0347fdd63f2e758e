"""Issue 15's small defects in the docs and the benchmarks, each a regression test (the CLI's are
in test_cli.py): no placeholder numbers, docs that stand alone, benchmarks that leave the
tracked figures under docs/img/ alone unless asked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_performance_page_has_no_placeholder_numbers():
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert not re.search(r"\bx%|: \.\.\. \(|\bTODO\b|\bTBD\b", text)
    # The band example's count is a number, and its share is that number over the square.
    done, total, share = re.search(r"scores computed: (\d+) of (\d+) \(([\d.]+)% of the square\)", text).groups()
    assert abs(100 * int(done) / int(total) - float(share)) < 0.05


@pytest.mark.parametrize("doc", ["README.md", "docs/tutorials.md"])
def test_docs_stand_alone_without_the_seed_files(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert not re.search(r"seed (tutorial|file|system)s?|shared/seeds|every seed|\bseed\.\w|\b00[0-4] —", text), (
        "a reader has no seed files: describe the tutorial instead"
    )


# One interpreter for every benchmark check (each start imports torch: seconds on a loaded machine).
_PROBE = """
import contextlib, importlib.util, io, sys
from pathlib import Path
bench = Path({root!r}) / "benchmarks"
sys.path.insert(0, str(bench))
import common
common.RESULTS, common.IMAGES = Path(sys.argv[1]), Path(sys.argv[2])
print(common.plot("probe", "t", "x", "y", {{"a": ([1, 2], [1, 2])}}))
print(common.plot("probe", "t", "x", "y", {{"a": ([1, 2], [1, 2])}}, update_docs=True))
for name in ("core", "sliding_window", "run_all"):
    spec = importlib.util.spec_from_file_location("bench_" + name, bench / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        module.main(["--help"])
    print("help", name, "--update-docs" in text.getvalue() and "docs/img" in text.getvalue())
"""


def test_benchmark_plots_go_to_results_unless_asked_to_update_the_docs(tmp_path):
    results, images = tmp_path / "results", tmp_path / "img"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(root=str(ROOT)), str(results), str(images)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("wrote ")]
    default, asked = lines[:2]
    assert Path(default) == results / "probe.png" and (results / "probe.png").is_file()
    assert Path(asked) == images / "probe.png" and (images / "probe.png").is_file()
    # The benchmarks that plot take --update-docs and say where it writes.
    assert lines[2:] == ["help core True", "help sliding_window True", "help run_all True"]
