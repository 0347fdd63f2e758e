"""``examples/streaming.py`` runs at short settings: its first ``sinks + window`` steps are checked
inside it against the uncached layer (``assert_close``), and here the cache's size stays flat at
``sinks + window`` tokens once the stream is longer (issue 32, item 3: every example runs)."""

from __future__ import annotations

import re

from test_look_train_export import example


def test_streaming_keeps_sinks_and_window_and_flat_memory(capsys):
    example("streaming").main(["--tokens", "96", "--sinks", "2", "--window", "14"])
    out = capsys.readouterr().out
    held = {
        int(n): (int(h), int(b))
        for n, h, b in re.findall(r"(\d+) tokens: cache holds\s+(\d+) tokens,\s+(\d+) bytes", out)
    }
    assert set(held) == {1, 2, 4, 8, 16, 32, 64, 96}
    assert [held[n][0] for n in (1, 2, 4, 8)] == [1, 2, 4, 8]  # fills up ...
    assert {held[n] for n in (16, 32, 64, 96)} == {held[16]} and held[16][0] == 2 + 14  # ... then stays flat
    assert "memory flat at 16 tokens after 96 streamed" in out
