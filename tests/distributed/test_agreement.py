"""Ranks that disagree on a call are refused on every rank within seconds, and the world works
afterwards: masks of 10^5 elements compared by content, and ``requires_grad`` / grad mode, for
ring and Ulysses attention (the checks: ``dist_checks_agree``).

One world of 2 gloo processes runs every check in order. Its process group times out after
:data:`GROUP_TIMEOUT` seconds, so a rank left waiting by a disagreement that went unseen fails
that check (and the world stops) instead of blocking for a minute.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_checks  # noqa: E402
import dist_checks_agree  # noqa: E402, F401 (registers the checks)
from dist_world import report, run_world  # noqa: E402

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)

WORLD = 2
GROUP_TIMEOUT = 20.0  # above dist_checks_agree.LIMIT, so a slow refusal is reported as slow
WORLD_TIMEOUT = 180.0
NAMES = [n for n in dist_checks.CHECKS if n.startswith("agree-")]


@functools.cache
def results() -> dict:
    return run_world(WORLD, NAMES, timeout=WORLD_TIMEOUT, group_timeout=GROUP_TIMEOUT)


@pytest.mark.parametrize("name", NAMES, ids=[f"P{WORLD}-{n}" for n in NAMES])
def test_disagreement_raises_on_every_rank(name):
    failures = report(results()[name])
    assert not failures, f"{name} failed in a world of {WORLD}:\n{failures}"
