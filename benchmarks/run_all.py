"""Run every benchmark: ``python benchmarks/run_all.py`` (``make bench``), ``--quick`` for the
short version (``make bench-quick``). Prints each table and, at the end, the headline ratios."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import context, machine_state, speed_words  # noqa: E402

PLOTS = {"core", "sliding_window"}  # the benchmarks that draw a plot (and take --update-docs)
SUITE = [
    "core",
    "dtypes",
    "bf16_prefill",
    "overhead",
    "sliding_window",
    "documents",
    "gqa",
    "decode",
    "dropout",
    "under_load",
    "memory",
    "layers",
    "hf",
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short version (a few minutes)")
    parser.add_argument("--only", nargs="*", choices=SUITE, help="run only these benchmarks")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="write the plots to docs/img/ (tracked; default: benchmarks/results/)",
    )
    args = parser.parse_args(argv)
    print(f"# multihead benchmarks ({'quick' if args.quick else 'full'}): {context()}")
    print(f"before: {machine_state()}")  # the duration below means little without the load it ran under
    results, started = {}, time.time()
    for name in args.only or SUITE:
        path = HERE / f"{name}.py"
        if not path.exists():  # layers.py belongs to the layers work and may not exist yet
            print(f"\n(skipping {name}: {path.name} not found)")
            continue
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        t0 = time.time()
        flags = (["--quick"] if args.quick else []) + (["--update-docs"] if args.update_docs and name in PLOTS else [])
        results[name] = module.main(flags)
        print(f"({name}: {time.time() - t0:.0f} s)")
    _headlines(results)
    print(f"\ntotal {time.time() - started:.0f} s; after: {machine_state()}")


def _headlines(results) -> None:
    print("\n# headline ratios (same run)")
    for r in results.get("core") or []:
        if r["causal"] and r["L"] >= 1024:
            print(
                f"dense causal L={r['L']}: auto ({r['backend']}) / raw SDPA = {r['multihead/sdpa']:.3f}  "
                "(target <= 1.05)"
            )
    overhead = {r["case"]: r for r in results.get("overhead") or []}
    for case, before in (
        ("no mask", "about 3x"),
        ("causal() & sliding_window(w) built once", "about 77x"),
        ("causal() & sliding_window(w) rebuilt per call", "should fall to the built-once cost"),
    ):
        if case in overhead:
            print(
                f"per-call overhead, {case}: {overhead[case]['/ raw no mask']:.1f}x a raw SDPA call without mask "
                f"(before issue 8: {before})"
            )
    for r in results.get("sliding_window") or []:
        if r["L"] == 16384 and r["window"] == 512 and "speedup" in r:
            faster = speed_words(r["speedup"], "SDPA + dense mask")
            print(f"sliding window L=16384 w=512: {faster}  (target >= 8x faster)")
        if "dense/multihead" in r:
            print(
                f"sliding window L={r['L']} w={r['window']}, load {r['load']} ({r['load_cores_used']:.1f} cores used "
                f"by it): multihead {speed_words(r['dense/multihead'], 'SDPA + dense mask')} (one call per block: "
                f"{speed_words(r['dense/per_block'], 'it')})  (target >= 8x faster under load, at L=16384)"
            )
    for r in results.get("decode") or []:  # the targets are about what attention() runs: auto
        if r["Lk"] >= 4096:
            print(
                f"decode step B={r['B']} Lk={r['Lk']}: multihead auto ({r['auto backend']}) "
                f"{r['auto/sdpa_gqa']:.2f}x the speed of SDPA enable_gqa (target >= 2), "
                f"{r['multihead auto %read']:.0f}% of the measured read bandwidth (target >= 60% where K/V "
                f"exceed the LLC: {r['KV_vs_LLC']}); backend='decode' forced: {r['decode/sdpa_gqa']:.2f}x, "
                f"{r['multihead decode %read']:.0f}%"
            )
    for r in results.get("dropout") or []:
        print(
            f"dropout 0.1, fwd+bwd, {r['case']}: {r['dropout / no dropout']:.1f}x the call without dropout "
            f"(target <= 1.5; auto with dropout: {r['backend with dropout']})"
        )
    for r in results.get("documents") or []:
        print(f"packed documents: {speed_words(r['speedup'], 'padded + dense mask')}  (target >= 3x faster)")
    for r in results.get("under_load") or []:
        print(
            f"{r['case']}, load {r['load']}: {r['speedup']:.2f}x SDPA with the dense mask "
            f"(target under load >= {r['target_loaded']:g})"
        )
    for r in results.get("hf") or []:
        target = (
            "<= 1.05, and eager/multihead >= 1.3"
            if r["case"].startswith("prefill 1024")
            else "<= 1"
            if r["case"].startswith("decode")
            else "< 1"
        )
        print(
            f"Hugging Face {r['case']}: multihead / sdpa = {r['multihead/sdpa']:.3f}, eager / multihead = "
            f"{r['eager/multihead']:.2f}  (target {target})"
        )
    for r in results.get("memory") or []:
        if "16384" in r["configuration"] and "baseline" not in r["configuration"]:
            print(f"{r['configuration']}: extra {r['extra_MiB']:.0f} MiB")


if __name__ == "__main__":
    main()
