"""``benchmarks/generate_caches.py --quick`` (issue 29, "End to end") runs and reports what its table
claims: the three caches, tokens/s, and how many greedy tokens each shares with the fp32 cache. A
slow-tier test: it decodes through a 2-layer model three times (tens of seconds on a loaded machine)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_generate_caches_quick_reports_every_cache(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    monkeypatch.setattr(common, "ROOT", tmp_path)  # the CSV lands in the test's folder
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    import generate_caches

    rows = generate_caches.main(["--quick"])
    assert [r["cache"] for r in rows] == ["fp32", "bf16", "int8"]
    assert all(r["decode tok/s"] > 0 and r["prefill s"] > 0 for r in rows)
    assert rows[0]["x fp32"] == 1 and rows[1]["x bf16"] == 1
    # The int8 cache holds fewer bytes than the bf16 one, which holds half of fp32's.
    assert rows[2]["cache MiB"] < rows[1]["cache MiB"] == pytest.approx(rows[0]["cache MiB"] / 2)
    for r in rows:
        agreed, total = map(int, re.match(r"(\d+)/(\d+), first difference ", r["tokens vs fp32"]).groups())
        assert total == 32 and 0 <= agreed <= total
    assert rows[0]["tokens vs fp32"] == "32/32, first difference none"  # fp32 against itself
    assert rows[2]["tokens vs bf16"].startswith(tuple(f"{n}/32" for n in range(33)))
    assert (tmp_path / "results" / "generate_caches_quick.csv").is_file()
    sys.modules.pop("generate_caches", None)
