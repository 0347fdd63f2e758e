"""The measurements distributed checks write with ``dist_checks.note`` (memory peaks and their
bounds), printed at the end of every session that ran them, passed or failed: a check that fails
only in some combined runs leaves its numbers in the log of the runs that passed too."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    module = sys.modules.get("test_distributed")
    notes = getattr(module, "NOTES", None)
    if not notes:
        return
    terminalreporter.section("distributed measurements (dist_checks.note)")
    for key, lines in sorted(notes.items()):
        for line in lines:
            terminalreporter.write_line(f"{key}: {line}")
