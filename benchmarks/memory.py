"""Peak memory of each configuration, one subprocess per configuration: the child's own
high-water mark ``VmHWM`` from ``/proc/self/status`` (reset by ``exec``), falling back to
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` where there is no ``/proc``. On Linux ``ru_maxrss``
is kept across fork+exec, so a child of a large benchmark process would report the parent's size.
"extra" = peak minus the peak of the same
process that only built the inputs. ``--quick``: the headline configurations only."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import context, print_table, write_csv

HERE = Path(__file__).resolve().parent

CONFIGS = {
    # name: (L, code run on q, k, v of shape (1, 8, L, 64))
    "inputs only (baseline) L=16384": (16384, "pass"),
    "sliding window 512, multihead, L=16384": (16384, "mh.attention(q, k, v, mask=mh.sliding_window(512))"),
    "sliding window 512, SDPA + dense bool mask, L=16384": (
        16384,
        "F.scaled_dot_product_attention(q, k, v, attn_mask=mh.sliding_window(512).materialize(1, 8, L, L))",
    ),
    "inputs only (baseline) L=8192": (8192, "pass"),
    "weights of 1 head, causal, weights_heads=0, L=8192": (
        8192,
        "mh.attention(q, k, v, mask=mh.causal(), return_weights=True, weights_heads=0)",
    ),
    "sliding window 512 fwd+bwd, multihead, L=8192": (
        8192,
        "q.requires_grad_(); mh.attention(q, k, v, mask=mh.sliding_window(512)).sum().backward()",
    ),
    "sliding window 512 fwd+bwd, SDPA + dense bool mask, L=8192": (
        8192,
        "q.requires_grad_(); F.scaled_dot_product_attention(q, k, v, "
        "attn_mask=mh.sliding_window(512).materialize(1, 8, L, L)).sum().backward()",
    ),
    "causal, multihead auto, L=8192": (8192, "mh.attention(q, k, v, mask=mh.causal())"),
}
QUICK = [n for n in CONFIGS if "16384" in n or "weights" in n or "L=8192" in n and "baseline" in n]

CHILD = """
import resource, sys, json, torch
sys.path.insert(0, {src!r})
import torch.nn.functional as F
import multihead as mh
torch.set_num_threads(2)
L = {L}
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, L, 64, generator=g) for _ in range(3))
{code}
try:
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    peak = int(hwm.split()[1]) / 1024
except (OSError, IndexError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(peak))
"""


def measure(L: int, code: str) -> float:
    """Peak resident MiB of a fresh process running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(src=str(HERE.parent / "src"), L=L, code=code)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(f"# peak memory  ({context()})")
    names = QUICK if args.quick else list(CONFIGS)
    peaks = {}
    for name in names:
        L, code = CONFIGS[name]
        peaks[name] = measure(L, code)
        print(f"{name}: {peaks[name]:.0f} MiB", flush=True)
    rows = []
    for name in names:
        L = CONFIGS[name][0]
        base = peaks.get(f"inputs only (baseline) L={L}", 0.0)
        rows.append({"configuration": name, "peak_MiB": peaks[name], "extra_MiB": peaks[name] - base})
    extra = {r["configuration"]: r["extra_MiB"] for r in rows}
    ours, dense = "sliding window 512, multihead, L=16384", "sliding window 512, SDPA + dense bool mask, L=16384"
    if ours in extra and dense in extra and extra[dense] > 0:
        print(f"sliding window L=16384: extra memory multihead / dense-mask SDPA = {extra[ours] / extra[dense]:.3f}")
    w = "weights of 1 head, causal, weights_heads=0, L=8192"
    if w in extra:
        print(
            f"weights of one head at L=8192: extra {extra[w]:.0f} MiB; all heads B*H*L^2 fp32 would be "
            f"{8 * 8192 * 8192 * 4 / 2**20:.0f} MiB"
        )
    print_table("peak memory (MiB, one subprocess per configuration)", rows)
    write_csv("memory" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
