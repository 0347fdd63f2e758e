"""Per-call Python overhead of ``multihead.attention()`` (validation + dispatch) and of the layer.

Many small calls, ``B=1, H=2, L=16, D=16``, fp32, forward under ``torch.no_grad``: the kernel
itself takes a few microseconds, so the time of a call is almost all Python. Every case is
timed next to a raw ``F.scaled_dot_product_attention`` call and reported as ratios:

* ``/ matching raw``: against the raw call that does the same thing (``is_causal=True`` for
  ``causal()``, a dense bool mask built once for ``causal() & sliding_window(w)``);
* ``/ raw no mask``: against the plainest raw call, the unit of the issue's baseline
  (about 3x without a mask, 77x with a ``causal() & sliding_window(w)`` object).

Cases: no mask; ``causal()`` built once; ``causal() & sliding_window(w)`` built once and reused;
no mask and that band again with the plan found last forgotten before each call (as after a call
of another signature: the plan's key is built and looked up instead of its guard checked);
the same mask *rebuilt on every call* (value-equal objects: plan caches keyed on the mask's
value instead of ``id(mask)`` make it as cheap as the reused one); building that mask alone; and
``MultiHeadAttention(causal=True)`` (with no mask, and with a reused ``sliding_window(w)``)
against a hand-written layer with the same projections. ``--quick``: fewer, shorter rounds
(same sizes).

Every call is timed in interleaved rounds keeping its fastest (:func:`common.fastest_ms`), with
ONE thread (``Timer(num_threads=1)``, printed): at this size a second thread adds nothing but
the wake-up of a parallel region, and on a shared machine that wake-up waits for a descheduled
thread (measured here: 8 ms per raw SDPA call with 2 threads while another process
ran tests, 13 us with 1), which would drown the Python overhead this benchmark is about. The raw
call with the suite's thread count is printed once for comparison.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from common import THREADS, check_close, context, fastest_ms, machine_state, mh, print_table, used_backend, write_csv
from multihead import plans

B, H, L, D, WINDOW = 1, 2, 16, 16, 4
TIMED_THREADS = 1  # see the module docstring


class HandWritten(nn.Module):
    """The layer written by hand: q/k/v/out linears with biases, SDPA (``is_causal`` or a dense
    bool mask built once by the caller)."""

    def __init__(self, layer: mh.MultiHeadAttention):
        super().__init__()
        self.H = layer.num_heads
        self.q, self.k, self.v, self.out = layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj  # shared weights

    def forward(self, x, attn_mask=None):
        Bx, Lx, E = x.shape
        q, k, v = (
            p(x).view(Bx, Lx, self.H, E // self.H).transpose(1, 2) for p in (self.q, self.k, self.v)
        )  # (B, H, L, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        return self.out(y.transpose(1, 2).reshape(Bx, Lx, E))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter timing (same sizes)")
    args = parser.parse_args(argv)
    min_run_time, rounds = (0.1, 3) if args.quick else (0.3, 7)
    print(f"# per-call overhead: B={B} H={H} L={L} D={D} fp32 forward, no_grad, window {WINDOW}  ({context()})")
    print(f"# timed with {TIMED_THREADS} thread (Timer(num_threads={TIMED_THREADS})); {machine_state()}")

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    band = mh.causal() & mh.sliding_window(WINDOW)
    band_dense = band.materialize(B, H, L, L)  # (1, 1, L, L) bool, True = may attend: SDPA's polarity too
    causal = mh.causal()
    layer = mh.MultiHeadAttention(H * D, H, causal=True).eval()
    hand = HandWritten(layer).eval()
    window = mh.sliding_window(WINDOW)
    x = torch.randn(B, L, H * D, generator=gen)

    raw = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    raw_band = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band_dense)  # noqa: E731
    cases = [  # (case, multihead call, matching raw call, backend note)
        ("no mask", lambda: mh.attention(q, k, v), raw, used_backend(q, k, v)),
        (
            "causal() built once",
            lambda: mh.attention(q, k, v, mask=causal),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            used_backend(q, k, v, mask=causal),
        ),
        (
            "causal() & sliding_window(w) built once",
            lambda: mh.attention(q, k, v, mask=band),
            raw_band,
            used_backend(q, k, v, mask=band),
        ),
        (
            "causal() & sliding_window(w) rebuilt per call",
            lambda: mh.attention(q, k, v, mask=mh.causal() & mh.sliding_window(WINDOW)),
            raw_band,
            used_backend(q, k, v, mask=band),
        ),
        ("no mask, the last plan forgotten", lambda: _forgetting(q, k, v), raw, used_backend(q, k, v)),
        (
            "causal() & sliding_window(w), last plan forgotten",
            lambda: _forgetting(q, k, v, mask=band),
            raw_band,
            used_backend(q, k, v, mask=band),
        ),
        ("  building that mask only", lambda: mh.causal() & mh.sliding_window(WINDOW), None, "-"),
        ("layer causal=True, no mask", lambda: layer(x), lambda: hand(x), "layer"),
        (
            "layer causal=True, sliding_window(w) reused",
            lambda: layer(x, mask=window),
            lambda: hand(x, attn_mask=band_dense),
            "layer",
        ),
    ]

    with torch.no_grad():
        for name, ours, theirs, _ in cases:  # correctness first, on the inputs that are timed
            if theirs is not None:
                check_close(name, ours(), theirs(), atol=1e-5)
        timed = {
            fn: fn
            for fn in [ours for _, ours, _, _ in cases] + [raw] + [theirs for _, _, theirs, _ in cases]
            if fn is not None
        }  # each distinct call once
        best = fastest_ms(timed, rounds, min_run_time, threads=TIMED_THREADS)
        fastest = lambda fn: best[fn] if fn is not None else float("nan")  # noqa: E731
        t_raw, t_raw_suite = fastest(raw), fastest_ms({raw: raw}, 1, min_run_time)[raw]
        rows = []
        for name, ours, theirs, backend in cases:
            t_ours, t_theirs = fastest(ours), fastest(theirs)
            rows.append(
                {
                    "case": name,
                    "backend": backend,
                    "multihead_us": t_ours * 1e3,
                    "matching_raw_us": t_theirs * 1e3,
                    "/ matching raw": t_ours / t_theirs,
                    "/ raw no mask": t_ours / t_raw,
                    "overhead_us": (t_ours - t_theirs) * 1e3,
                    "threads": TIMED_THREADS,
                    "rounds": rounds,
                    "torch": torch.__version__,
                }
            )
    print_table(
        f"per-call overhead, fastest of {rounds} interleaved rounds (raw SDPA without mask: "
        f"{t_raw * 1e3:.1f} us; ratios from one run)",
        [
            {
                c: r[c]
                for c in (
                    "case",
                    "backend",
                    "multihead_us",
                    "matching_raw_us",
                    "/ matching raw",
                    "/ raw no mask",
                    "overhead_us",
                )
            }
            for r in rows
        ],
    )
    print(
        f"raw SDPA without mask with {THREADS} threads: {t_raw_suite * 1e3:.1f} us "
        f"({t_raw_suite / t_raw:.1f}x the 1-thread call: the parallel region's wake-up)"
    )
    checked = [  # the first three cases again, asking for the non-finite rules
        (
            "no mask",
            lambda: mh.attention(q, k, v, check_finite=True),
            raw,
            used_backend(q, k, v),
        ),
        (
            "causal() built once",
            lambda: mh.attention(q, k, v, mask=causal, check_finite=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            used_backend(q, k, v, mask=causal),
        ),
        (
            "causal() & sliding_window(w) built once",
            lambda: mh.attention(q, k, v, mask=band, check_finite=True),
            raw_band,
            used_backend(q, k, v, mask=band),
        ),
    ]
    rows += _with_check(checked, raw, rounds, min_run_time)
    write_csv("overhead" + ("_quick" if args.quick else ""), rows)
    return rows


def _forgetting(q, k, v, **kw):
    """``attention()`` as the call after one of another signature runs it: the plan found last
    (run on its guard, ``multihead/guards.py``) forgotten, so the key is built and looked up."""
    plans._last = None
    return mh.attention(q, k, v, **kw)


def _with_check(cases, raw, rounds: int, min_run_time: float) -> list[dict]:
    """The first cases again with ``check_finite=True`` (the non-finite rules of
    ``multihead/nonfinite.py``: one reduction over ``q`` and the output and its host read per
    call), timed beside the raw call in rounds of their own: what the opt-in costs."""
    with torch.no_grad():
        timed = {fn: fn for _, ours, theirs, _ in cases for fn in (ours, theirs)} | {raw: raw}
        best = fastest_ms(timed, rounds, min_run_time, threads=TIMED_THREADS)
    rows = [
        {
            "case": f"{name}, check_finite=True",
            "backend": backend,
            "multihead_us": best[ours] * 1e3,
            "matching_raw_us": best[theirs] * 1e3,
            "/ matching raw": best[ours] / best[theirs],
            "/ raw no mask": best[ours] / best[raw],
            "overhead_us": (best[ours] - best[theirs]) * 1e3,
            "threads": TIMED_THREADS,
            "rounds": rounds,
            "torch": torch.__version__,
        }
        for name, ours, theirs, backend in cases
    ]
    print_table(
        f"the same with check_finite=True (raw SDPA without mask: {best[raw] * 1e3:.1f} us in these rounds)",
        [
            {c: r[c] for c in ("case", "multihead_us", "matching_raw_us", "/ matching raw", "/ raw no mask")}
            for r in rows
        ],
    )
    return rows


if __name__ == "__main__":
    main()
