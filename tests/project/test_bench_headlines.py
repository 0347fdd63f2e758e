"""The headlines ``make bench-quick`` ends with say what the numbers mean (issue 32, item 4): a
ratio below 1 is said as "slower" (never "0.63x faster"), and the decode headline reports what
``attention()`` runs by itself (``auto``, with the backend it chose), the forced ``decode``
backend only beside it. Fed made-up rows; nothing is timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("bench_run_all", BENCHMARKS / "run_all.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_speed_words_says_slower_below_one(run_all):
    assert run_all.speed_words(1.59, "X") == "1.59x faster than X"
    assert run_all.speed_words(0.63, "X") == "1.59x slower than X"
    assert run_all.speed_words(1.0, "X") == "1.00x faster than X"


def test_the_decode_headline_reports_auto_and_its_backend(run_all, capsys):
    row = {
        "B": 1,
        "Lk": 32768,
        "KV_vs_LLC": "beyond",
        "auto backend": "decode",
        "auto/sdpa_gqa": 2.61,
        "multihead auto %read": 52.0,
        "decode/sdpa_gqa": 2.70,
        "multihead decode %read": 54.0,
    }
    run_all._headlines({"decode": [row]})
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("decode step"))
    assert "multihead auto (decode) 2.61x the speed of SDPA enable_gqa" in line
    assert "52% of the measured read bandwidth" in line
    assert line.index("auto") < line.index("forced") and "backend='decode' forced: 2.70x, 54%" in line


def test_headlines_below_one_say_slower(run_all, capsys):
    run_all._headlines(
        {
            "documents": [{"speedup": 0.5}],
            "sliding_window": [{"L": 16384, "window": 512, "speedup": 0.8}],
        }
    )
    out = capsys.readouterr().out
    assert "packed documents: 2.00x slower than padded + dense mask" in out
    assert "sliding window L=16384 w=512: 1.25x slower than SDPA + dense mask" in out
    assert "0.50x faster" not in out and "0.80x faster" not in out
