"""Run named checks inside a world of spawned gloo processes, once per world size.

Process start-up (a fresh interpreter importing torch) is the cost of a distributed test, so a
world runs many checks and reports each one: ``run_world(P, names)`` starts ``P`` processes with
``torch.multiprocessing`` (:func:`start_method`; file-based rendezvous in a temporary folder, no
port), each runs every
check of :mod:`dist_checks` in ``names`` in order and writes one line per check, and the parent
returns ``{name: {rank: None | traceback}}`` (and, if asked, the lines each check wrote with
``dist_checks.note``: measurements the test log keeps whether the check passes or not). A world
that outlives its ``timeout`` is killed and
its unfinished checks are reported as timed out, so a hang fails instead of blocking.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def start_method() -> str:
    """``forkserver`` where the platform has it: a clean interpreter (like ``spawn``, nothing of the
    parent's threads) that imports torch and the checks once, then forks every rank of every
    world from there, which saves the import per process. ``spawn`` elsewhere."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the first backward through a checkpoint imports it (seconds per process)
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch._dynamo",
            "multihead",
            "dist_checks",
            "dist_checks_slow",
            "dist_checks_agree",
            "dist_checks_decode",
            "dist_checks_fsdp",
            "dist_checks_scores",
            "dist_checks_mesh",
            "dist_checks_documents",
            "dist_checks_traffic",
        ]
    )
    return "forkserver"


def run_world(
    world: int,
    names: list[str],
    timeout: float = 240.0,
    times: dict | None = None,
    group_timeout: float = 60.0,
    notes: dict | None = None,
) -> dict[str, dict[int, str | None]]:
    """``{name: {rank: None (passed) | the traceback}}``; ``times`` (if given) receives each
    check's slowest rank's seconds, ``notes`` (if given) ``{name: ["rank r: line", ...]}``.
    ``group_timeout``: the process group's ``timeout``, after
    which a rank waiting in a collective raises."""
    folder = tempfile.mkdtemp(prefix="multihead_dist_")
    try:
        ctx = mp.start_processes(
            _worker,
            args=(world, folder, list(names), group_timeout),
            nprocs=world,
            join=False,
            start_method=start_method(),
        )
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            try:
                if ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                    break
            except (mp.ProcessRaisedException, mp.ProcessExitedException):
                break  # what each rank finished is in its file; the rest is reported as not run
            if time.monotonic() > deadline:
                timed_out = True
                break
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        results: dict[str, dict[int, str | None]] = {n: {} for n in names}
        for rank in range(world):
            path = os.path.join(folder, f"rank{rank}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        entry = json.loads(line)
                        results[entry["name"]][rank] = entry["error"]
                        if notes is not None and entry.get("notes"):
                            notes.setdefault(entry["name"], []).extend(f"rank {rank}: {n}" for n in entry["notes"])
                        if times is not None:
                            times[entry["name"]] = max(times.get(entry["name"], 0.0), entry["seconds"])
        missing = (
            "not run: the world timed out"
            if timed_out
            else "not run: the world stopped (a rank failed or fell out of step) before this check"
        )
        for n in names:
            for rank in range(world):
                results[n].setdefault(rank, f"rank {rank}: {missing} (world of {world}, limit {timeout:.0f} s)")
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _worker(rank: int, world: int, folder: str, names: list[str], group_timeout: float) -> None:
    import sys

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)  # P processes share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=group_timeout),
    )
    import dist_checks
    import dist_checks_agree  # noqa: F401 (registers the agreement checks)
    import dist_checks_decode  # noqa: F401 (registers the decoding checks)
    import dist_checks_documents  # noqa: F401 (registers the document-layout checks)
    import dist_checks_fsdp  # noqa: F401 (registers the FSDP2 training example)
    import dist_checks_mesh  # noqa: F401 (registers the 2-D mesh checks)
    import dist_checks_scores  # noqa: F401 (registers the score-modifier checks)
    import dist_checks_slow  # noqa: F401 (registers the slow tier's checks)
    import dist_checks_traffic  # noqa: F401 (registers the bytes-moved checks)

    try:
        for name in names:
            start = time.perf_counter()
            try:
                dist_checks.CHECKS[name](rank, world)
                error = None
            except Exception:
                error = traceback.format_exc()
            seconds = time.perf_counter() - start
            entry = {"name": name, "error": error, "seconds": seconds, "notes": dist_checks.NOTES[:]}
            dist_checks.NOTES.clear()
            with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")
            # A check that failed on one rank between collectives leaves the ranks out of step;
            # then the remaining checks would only report that, so the world stops here.
            done: list = [None] * world
            try:
                dist.all_gather_object(done, name)
            except RuntimeError:
                break
            if any(d != name for d in done):
                break
    finally:
        dist.destroy_process_group()


def report(results: dict[int, str | None]) -> str:
    return "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(results.items()) if e is not None)
