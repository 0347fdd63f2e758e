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
    assert not re.search(r"seed (tutorial|file|system)s?|shared/seeds|every seed|\bseed\.\w|\b00[0-4] —", text), \
        "a reader has no seed files: describe the tutorial instead"


_PLOT = """
import sys
from pathlib import Path
sys.path.insert(0, str(Path({root!r}) / "benchmarks"))
import common
common.RESULTS, common.IMAGES = Path(sys.argv[1]), Path(sys.argv[2])
print(common.plot("probe", "t", "x", "y", {{"a": ([1, 2], [1, 2])}}))
print(common.plot("probe", "t", "x", "y", {{"a": ([1, 2], [1, 2])}}, update_docs=True))
"""


def test_benchmark_plots_go_to_results_unless_asked_to_update_the_docs(tmp_path):
    results, images = tmp_path / "results", tmp_path / "img"
    done = subprocess.run([sys.executable, "-c", _PLOT.format(root=str(ROOT)), str(results), str(images)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    default, asked = [line for line in done.stdout.splitlines() if not line.startswith("wrote ")]
    assert Path(default) == results / "probe.png" and (results / "probe.png").is_file()
    assert Path(asked) == images / "probe.png" and (images / "probe.png").is_file()


@pytest.mark.parametrize("script", ["core.py", "sliding_window.py", "run_all.py"])
def test_the_plotting_benchmarks_take_update_docs(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--update-docs" in done.stdout and "docs/img" in done.stdout
