"""Ring and Ulysses attention in worlds of 2, 3 and 4 gloo processes, against single-process
:func:`multihead.attention` (fp64: ``assert_close``; fp32: the relative rule of TESTING.md).

Each world is started once per session (``dist_world.run_world``) and runs every check of
``dist_checks`` for it; each test below reads the result of one check on every rank. The whole
default tier costs about 30 s on two cores, most of it computing, not starting processes.

The slow tier (``pytest -m slow tests/distributed``; ``dist_checks_slow``) runs its own worlds
of 2, 3, 4 and 8 processes: odd head dims, three batch rows, fp32 at longer lengths, seeded
random cases, and the per-rank memory bound at eight ranks.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_checks  # noqa: E402
import dist_checks_decode  # noqa: E402, F401 (registers the decoding checks)
import dist_checks_documents  # noqa: E402, F401 (registers the document-layout checks)
import dist_checks_fsdp  # noqa: E402, F401 (registers the FSDP2 training example)
import dist_checks_mesh  # noqa: E402, F401 (registers the 2-D mesh checks)
import dist_checks_scores  # noqa: E402, F401 (registers the score-modifier checks)
import dist_checks_slow  # noqa: E402
import dist_checks_traffic  # noqa: E402, F401 (registers the bytes-moved checks)
from dist_world import report, run_world  # noqa: E402

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)

WORLD_TIMEOUT = 300.0  # seconds for a whole world; a hang fails every check it did not finish


def names_for(world: int) -> list[str]:
    # Halving the world (error growth) needs an even world.
    return [
        n
        for n in dist_checks.CHECKS
        if not n.startswith(("slow-", "agree-")) and not (n == "ring-error-does-not-grow" and world % 2)
    ]


SLOW_WORLDS = (2, 3, 4, 8)
SLOW_TIMEOUT = 900.0


def slow_names_for(world: int) -> list[str]:
    # Eight ranks: the memory bound also catches sent gradients kept until the end of the ring;
    # the bytes-moved formulas are checked at the largest world the scale model is checked at.
    extra = ["ring-memory-per-rank", "traffic-equals-formulas"] if world == 8 else []
    return [n for n in dist_checks.CHECKS if n.startswith("slow-")] + extra


NOTES: dict[str, list[str]] = {}  # "P2 name" -> the lines its ranks wrote with dist_checks.note (conftest prints them)


def _run(world: int, names: list[str], timeout: float) -> dict:
    notes: dict = {}
    results = run_world(world, names, timeout=timeout, notes=notes)
    for name, lines in notes.items():
        NOTES[f"P{world} {name}"] = lines
    return results


@functools.cache
def world_results(world: int) -> dict:
    return _run(world, names_for(world), WORLD_TIMEOUT)


CASES = [(w, n) for w in (2, 3, 4) for n in names_for(w)]


@pytest.mark.parametrize("world,name", CASES, ids=[f"P{w}-{n}" for w, n in CASES])
def test_sharded_equals_single_process(world, name):
    results = world_results(world)[name]
    failures = report(results)
    notes = "\n".join(NOTES.get(f"P{world} {name}", []))
    print(notes)
    assert not failures, f"{name} failed in a world of {world}:\n{notes}\n{failures}"


@functools.cache
def slow_world_results(world: int) -> dict:
    return _run(world, slow_names_for(world), SLOW_TIMEOUT)


def _slow_id(world: int, name: str) -> str:
    if name.startswith("slow-random-"):
        return f"P{world}-{name}-{dist_checks_slow.describe(dist_checks_slow.random_case(int(name[-2:]), world))}"
    return f"P{world}-{name}"


SLOW_CASES = [(w, n) for w in SLOW_WORLDS for n in slow_names_for(w)]


@pytest.mark.slow
@pytest.mark.parametrize("world,name", SLOW_CASES, ids=[_slow_id(w, n) for w, n in SLOW_CASES])
def test_sharded_equals_single_process_slow(world, name):
    results = slow_world_results(world)[name]
    failures = report(results)
    notes = "\n".join(NOTES.get(f"P{world} {name}", []))
    print(notes)
    assert not failures, f"{name} failed in a world of {world}:\n{notes}\n{failures}"
